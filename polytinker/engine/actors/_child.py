"""Entry point of an actor process: ``python -m polytinker.engine.actors._child``.

It reads a :class:`~polytinker.engine.actors._protocol.ChildSpec` from stdin, arranges to die
with its parent, sets up the JSON-lines log, builds the actor, runs ``on_start``, binds the
mailbox, reports ready on the inherited pipe, and serves until asked to stop (SIGTERM,
``stop_self()``, or a failed tell). This module imports no torch: an actor that needs it
imports it itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from polytinker.engine.actors import _actor, _logs, _protocol
from polytinker.engine.actors._mailbox import MailboxServer
from polytinker.errors import ActorError

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_WATCHDOG_PERIOD_S = 0.5

log = logging.getLogger("polytinker.actor")


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the parent: the kernel's parent-death signal, then a watchdog as a fallback
    (other platforms; or a parent whose spawning thread differs from the one that dies)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before prctl took effect; then we are already someone else's child.
    if os.getppid() != parent_pid:
        os._exit(_protocol.EXIT_ORPHANED)

    def watch() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if os.getppid() != parent_pid:
                os._exit(_protocol.EXIT_ORPHANED)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _setup_logging(spec: _protocol.ChildSpec) -> _logs.LogFile:
    logfile = _logs.LogFile(_logs.log_path(spec.run_dir, spec.name))
    root = logging.getLogger()
    root.handlers[:] = [_logs.JsonLinesHandler(logfile, spec.name)]
    root.setLevel(spec.log_level)
    return logfile


def _resolve(target: str) -> type[_actor.Actor]:
    where, _, qualname = target.rpartition(":")
    if not where or not qualname:
        raise ActorError(f"actor target {target!r} must look like 'package.module:ClassName'")
    if where.endswith(".py"):
        # A class from the parent's __main__ script: run the script under another name so its
        # `if __name__ == "__main__":` block stays quiet (what multiprocessing's spawn does).
        namespace: Any = runpy.run_path(where, run_name="__mp_main__")
        obj: Any = namespace[qualname.split(".")[0]]
        rest = qualname.split(".")[1:]
    else:
        obj = importlib.import_module(where)
        rest = qualname.split(".")
    for part in rest:
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, _actor.Actor)):
        raise ActorError(f"actor target {target!r} is not a subclass of polytinker.engine.actors.Actor")
    return obj


class _Runner:
    """Holds the running actor and turns mailbox messages into handler calls."""

    def __init__(self, spec: _protocol.ChildSpec, actor: _actor.Actor) -> None:
        self.spec = spec
        self.actor = actor
        self.failed = threading.Event()

    def handlers(self) -> dict[str, Any]:
        table: dict[str, Any] = {}
        for kind in self.actor.handler_specs():
            table[kind] = lambda payload, kind=kind: self.actor.dispatch(kind, payload)
        table[_protocol.TELL_KIND] = self.tell
        table[_protocol.PING_KIND] = lambda _payload: {"name": self.spec.name, "pid": os.getpid()}
        return table

    def tell(self, message: Any) -> None:
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            log.error("malformed tell dropped: %r", message)
            return
        try:
            self.actor.dispatch(message["kind"], message.get("payload"))
        except Exception as exc:
            self.fail_no_asker(exc, f"tell {message['kind']!r} failed")

    def fail_no_asker(self, exc: BaseException, what: str) -> None:
        log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        with contextlib.suppress(Exception):
            self.actor.on_failure(exc)
        if self.spec.tell_failure == "stop":
            _write_traceback(self.spec, exc)
            self.failed.set()
            self.actor.stop_self()


def _write_traceback(spec: _protocol.ChildSpec, exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    with contextlib.suppress(OSError):
        _logs.traceback_path(spec.run_dir, spec.name, os.getpid()).write_text(text, encoding="utf-8")
    return text


def _report(fd: int, report: _protocol.ReadyReport) -> None:
    data = _protocol.pack(report)
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]
    with contextlib.suppress(OSError):
        os.close(fd)


def _start(spec: _protocol.ChildSpec) -> tuple[_Runner, MailboxServer]:
    _actor._set_context(_actor.ActorContext(name=spec.name, run_dir=Path(spec.run_dir)))
    actor: _actor.Actor | None = None
    try:
        cls = _resolve(spec.target)
        actor = cls(*spec.args, **spec.kwargs)
        actor.on_start()
        runner = _Runner(spec, actor)
        server = MailboxServer(spec.address, runner.handlers())
        server.start()
        return runner, server
    except BaseException as exc:
        text = _write_traceback(spec, exc)
        log.error("startup failed: %s: %s", type(exc).__name__, exc, extra={"traceback": text})
        if actor is not None:
            with contextlib.suppress(Exception):
                actor.on_failure(exc)
        kind = type(exc)
        report = _protocol.ReadyReport(
            ok=False,
            pid=os.getpid(),
            error_type=f"{kind.__module__}.{kind.__qualname__}",
            error_message=str(exc),
            traceback=text,
        )
        _report(spec.ready_fd, report)
        raise SystemExit(_protocol.EXIT_FAILED) from None


def _serve(spec: _protocol.ChildSpec, runner: _Runner, server: MailboxServer) -> int:
    actor = runner.actor
    signal.signal(signal.SIGTERM, lambda _sig, _frame: actor.stop_self())
    _report(spec.ready_fd, _protocol.ReadyReport(ok=True, pid=os.getpid(), address=server.address))
    log.info("ready", extra={"address": server.address})
    # Wake up now and then so signal handlers run promptly in the main thread.
    while not actor._stop_requested.wait(0.2):
        pass
    code = _protocol.EXIT_OK
    if runner.failed.is_set():
        code = _protocol.EXIT_FAILED
    else:
        # The mailbox lock makes the stop wait for the message being handled.
        with actor._mailbox_lock:
            try:
                actor.on_stop()
            except Exception as exc:
                _write_traceback(spec, exc)
                log.error("on_stop failed: %s", exc, exc_info=exc)
                code = _protocol.EXIT_FAILED
    with contextlib.suppress(Exception):
        server.stop()
    log.info("stopped", extra={"exit_code": code})
    return code


def main() -> int:
    spec: _protocol.ChildSpec = _protocol.unpack(sys.stdin.buffer.read(), _protocol.ChildSpec)
    _die_with_parent(spec.parent_pid)
    _setup_logging(spec)
    faulthandler.enable()  # a hard crash (segfault) still leaves a stack on stderr, which the parent logs
    try:
        runner, server = _start(spec)
        return _serve(spec, runner, server)
    except SystemExit as exc:
        return int(exc.code or 0)
    except BaseException as exc:
        _write_traceback(spec, exc)
        log.critical("actor process crashed: %s", exc, exc_info=exc)
        return _protocol.EXIT_FAILED


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # os._exit: a non-daemon thread left by actor code must not keep a stopped actor alive.
    os._exit(code)
