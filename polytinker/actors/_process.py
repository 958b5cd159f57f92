"""One running incarnation of an actor: its process, mailbox addresses, output and exit.

``ChildProcess`` is what :mod:`._spawn` starts and what an :class:`~._ref.ActorRef` talks to and
stops; it imports neither of them. Its output pumps copy the child's stdout and stderr, line by
line, into the actor's JSON-lines log; a reaper (in ``_spawn``) calls ``_exited`` once it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from polytinker.actors import _logs

_STDERR_TAIL_LINES = 40

ExitCallback = Callable[["ChildProcess", int], None]


def remove_ipc_files(*addresses: str) -> None:
    for address in addresses:
        if address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(address[len("ipc://") :])


class ChildProcess:
    """One running incarnation of an actor: its process, address and log."""

    def __init__(
        self, popen: subprocess.Popen[bytes], name: str, run_dir: Path, log: _logs.LogFile, stop_timeout_s: float
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.name = name
        self.run_dir = run_dir
        self.stop_timeout_s = stop_timeout_s  # its ActorConfig's: how long on_stop may take at the parent's exit
        self.address = ""
        self.concurrent_address = ""
        self.concurrent_kinds: frozenset[str] = frozenset()
        self.kinds: frozenset[str] = frozenset()
        self.started_at = time.time()
        self._log = log
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._callbacks: list[ExitCallback] = []
        self._cb_lock = threading.Lock()
        self._exit_seen = False
        self._pumps = [
            threading.Thread(target=self._pump, args=(popen.stdout, "stdout"), daemon=True, name=f"{name}-stdout"),
            threading.Thread(target=self._pump, args=(popen.stderr, "stderr"), daemon=True, name=f"{name}-stderr"),
        ]
        for t in self._pumps:
            t.start()

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float | None) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def stop(self, timeout_s: float, request: Callable[[], None] | None = None) -> int:
        """Ask the child to stop (``request()``, else SIGTERM; either way it runs ``on_stop``), then
        SIGKILL it if it is not gone within ``timeout_s``."""
        if request is None:
            self.signal(signal.SIGTERM)
        else:
            try:
                request()
            except Exception:  # the mailbox is closed or full: the signal runs on_stop all the same
                self.signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.popen.wait()
        return code

    def remove_sockets(self) -> None:
        """Remove the child's ipc socket files (a child that exits cleanly removes them itself)."""
        remove_ipc_files(self.address, self.concurrent_address)

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    def last_traceback(self) -> str:
        """The traceback the child left when it died of an exception ('' for none, e.g. after SIGKILL)."""
        try:
            return _logs.traceback_path(self.run_dir, self.name, self.pid).read_text(encoding="utf-8")
        except OSError:
            return ""

    def on_exit(self, callback: ExitCallback) -> None:
        """Run ``callback(child, exit_code)`` once, on the reaper thread, when the process has exited."""
        with self._cb_lock:
            if not self._exit_seen:
                self._callbacks.append(callback)
                return
        code = self.popen.returncode
        callback(self, code)

    def _exited(self) -> None:
        for t in self._pumps:
            t.join(timeout=1.0)  # the last lines of output belong in the log before anyone reads it
        self._log.close()
        self.remove_sockets()
        with self._cb_lock:
            self._exit_seen = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self, self.popen.returncode)
            except Exception as exc:  # a broken callback must not stop the reaper
                print(f"polytinker: exit callback of actor {self.name!r} raised {exc!r}", file=sys.stderr)

    def _pump(self, stream: IO[bytes] | None, which: str) -> None:
        if stream is None:
            return
        level = "INFO" if which == "stdout" else "WARNING"
        with stream:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\n")
                if which == "stderr":
                    self._stderr_tail.append(text)
                self._log.write_line(_logs.make_line(self.name, self.pid, level, text, {"stream": which}))


__all__ = ["ChildProcess", "ExitCallback", "remove_ipc_files"]
