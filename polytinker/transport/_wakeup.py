"""A self-pipe that wakes an I/O thread sleeping in poll(); shared by the client and the server.

Other threads call :meth:`WakePipe.wake`; the I/O thread polls :attr:`WakePipe.fd` and calls
:meth:`WakePipe.drain` when it fires. ``wake`` after ``close`` is a no-op, because handler and
caller threads may still wake a loop that is shutting down.
"""

from __future__ import annotations

import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            try:  # noqa: SIM105 (hot path: suppress() costs a context manager per call)
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the I/O thread is awake anyway

    def drain(self) -> None:
        try:  # noqa: SIM105 (once per wake-up; suppress() is slower)
            os.read(self.fd, 65536)
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            os.close(self.fd)
            os.close(self._write_fd)
            self._write_fd = -1
