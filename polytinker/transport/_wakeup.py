"""A self-pipe that wakes an I/O thread sleeping in poll(); shared by the client and the server.

Other threads call :meth:`WakePipe.wake`; the I/O thread polls :attr:`WakePipe.fd` and calls
:meth:`WakePipe.drain` when it fires, then reads what it was woken for. ``wake`` after ``close`` is
a no-op, because handler and caller threads may still wake a loop that is shutting down.

Wake-ups coalesce: while a byte is in the pipe that the I/O thread has not drained, ``wake`` writes
nothing, since the I/O thread reads its queue after draining anyway. A write releases the GIL, and
the woken I/O thread takes it: one write per request made each call wait for the I/O thread's turn
(about half of a remote env's round trip went there); now one write serves every request queued
before the I/O thread gets to run.
"""

from __future__ import annotations

import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # True from a wake's write until the drain after it: a byte is (or is going) in the pipe.
        self._armed = False
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        if self._armed:  # read without the lock: a stale True still comes before the drain's reset
            return
        with self._lock:
            if self._armed or self._write_fd < 0:
                return
            self._armed = True
            try:  # noqa: SIM105 (hot path: suppress() costs a context manager per call)
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the I/O thread is awake anyway

    def drain(self) -> None:
        """Empty the pipe, then re-arm ``wake``: a wake that found it armed before this reset queued
        its work before the I/O thread reads its queue (after this), and a later one writes."""
        try:  # noqa: SIM105 (once per wake-up; suppress() is slower)
            os.read(self.fd, 65536)
        except BlockingIOError:
            pass
        self._armed = False

    def close(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            os.close(self.fd)
            os.close(self._write_fd)
            self._write_fd = -1
