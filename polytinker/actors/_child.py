"""Entry point of an actor process: ``python -m polytinker.actors._child``.

It reads a :class:`~polytinker.actors._protocol.ChildSpec` from stdin, arranges to die
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

from polytinker.actors import _actor, _logs, _process, _protocol, _spawn
from polytinker.actors._mailbox import MailboxServer
from polytinker.errors import ActorDeadError, ActorError, ProtocolError

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_WATCHDOG_PERIOD_S = 0.5
_CONCURRENT_THREADS = 8

log = logging.getLogger("polytinker.actor")


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the parent: the kernel's parent-death signal, then a watchdog as a fallback
    (other platforms; or a parent whose spawning thread differs from the one that dies)."""
    # The variable exists so tests can exercise the watchdog alone.
    if sys.platform.startswith("linux") and os.environ.get("POLYTINKER_ACTOR_NO_PDEATHSIG") != "1":
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


def _extend_sys_path(parent_path: list[str]) -> None:
    missing = [p for p in parent_path if p not in sys.path]
    sys.path[:0] = missing


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
        raise ActorError(f"actor target {target!r} is not a subclass of polytinker.actors.Actor")
    return obj


class _Runner:
    """Holds the running actor, its mailboxes, and how it stops.

    The main mailbox runs one handler thread, so messages are handled one at a time and in the
    order they arrived (actor semantics; a pool of threads racing for a lock would reorder them).
    Kinds declared ``concurrent=True`` get a second mailbox with several threads. An actor with no
    handlers gets no mailbox (see ``__init__``).
    """

    def __init__(self, spec: _protocol.ChildSpec, actor: _actor.Actor) -> None:
        self.spec = spec
        self.actor = actor
        self.failed = False
        self.stopped = False  # on_stop has run (or the actor failed): later messages are refused
        self.exit_code = _protocol.EXIT_OK
        self.servers: list[MailboxServer] = []
        specs = actor.handler_specs()
        self.concurrent_kinds = sorted(k for k, s in specs.items() if s.concurrent)
        serial = {k: self._wrap(k) for k, s in specs.items() if not s.concurrent}
        serial[_protocol.TELL_KIND] = self.tell
        serial[_protocol.PING_KIND] = lambda _payload: {"name": spec.name, "pid": os.getpid()}
        serial[_protocol.STOP_KIND] = lambda _payload: self.stop()
        # An actor that declares no handlers takes its work another way (a worker's own RPC server):
        # it binds no mailbox, and its supervisor stops it with SIGTERM, which runs on_stop as a
        # stop message would. One way into the process.
        self.main = MailboxServer(spec.address, serial, threads=1) if specs else None
        self.concurrent: MailboxServer | None = None
        if self.concurrent_kinds:
            table = {k: self._wrap(k) for k in self.concurrent_kinds}
            self.concurrent = MailboxServer(_second_address(spec.address), table, threads=_CONCURRENT_THREADS)

    def start(self) -> None:
        for server in (self.main, self.concurrent):
            if server is not None:
                server.start()
                self.servers.append(server)

    def _wrap(self, kind: str) -> Any:
        def run(payload: Any) -> Any:
            if self.stopped:
                raise ActorDeadError(f"actor {self.spec.name!r} is stopping")
            return self.actor.dispatch(kind, payload)

        return run

    def tell(self, message: Any) -> None:
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            log.error("malformed tell dropped: %r", message)
            return
        if self.stopped:
            log.warning("tell %r after stop dropped", message["kind"])
            return
        try:
            if message["kind"] not in self.actor.handler_specs():
                raise ProtocolError(f"no handler for kind {message['kind']!r}")
            _actor.check_payload_type(message["kind"], message.get("payload"))
        except ProtocolError as exc:
            # A sender's mistake, not the actor's failure: do not stop for it.
            log.error("tell dropped: %s", exc)
            return
        try:
            self.actor.dispatch(message["kind"], message.get("payload"))
        except Exception as exc:
            self.fail_no_asker(exc, f"tell {message['kind']!r} failed")

    def fail_no_asker(self, exc: BaseException, what: str) -> None:
        if self.spec.tell_failure == "stop":
            self.fail(exc, what)
            return
        log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        with contextlib.suppress(Exception):
            self.actor.on_failure(exc)

    def fail(self, exc: BaseException, what: str) -> None:
        """End the actor with code 1, leaving the traceback for its supervisor (on_stop does not run)."""
        with self.actor._mailbox_lock:  # after the message being handled, as a stop
            if self.failed:
                return
            log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
            with contextlib.suppress(Exception):
                self.actor.on_failure(exc)
            _write_traceback(self.spec, exc)
            self.failed = self.stopped = True
            self.exit_code = _protocol.EXIT_FAILED
        self.actor.stop_self()

    def stop(self) -> None:
        """Run on_stop once, after the message being handled (the mailbox lock), then let main exit."""
        with self.actor._mailbox_lock:
            if not self.stopped:
                self.stopped = True
                try:
                    self.actor.on_stop()
                except Exception as exc:
                    _write_traceback(self.spec, exc)
                    log.error("on_stop failed: %s", exc, exc_info=exc)
                    self.exit_code = _protocol.EXIT_FAILED
        self.actor.stop_self()


def _second_address(address: str) -> str:
    if address.startswith("ipc://"):
        return address[: -len(".sock")] + ".c.sock" if address.endswith(".sock") else address + ".c"
    return address  # tcp://host:* binds another free port


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


def _start(spec: _protocol.ChildSpec) -> _Runner:
    _actor._set_context(_actor.ActorContext(name=spec.name, run_dir=Path(spec.run_dir)))
    actor: _actor.Actor | None = None
    try:
        _extend_sys_path(spec.sys_path)
        cls = _resolve(spec.target)
        actor = cls(*spec.args, **spec.kwargs)
        actor.on_start()
        runner = _Runner(spec, actor)
        runner.start()
        return runner
    except BaseException as exc:
        text = _write_traceback(spec, exc)
        log.error("startup failed: %s: %s", type(exc).__name__, exc, extra={"traceback": text})
        if actor is not None:
            with contextlib.suppress(Exception):
                actor.on_failure(exc)
        report = _protocol.ReadyReport(
            ok=False,
            pid=os.getpid(),
            error_type=type(exc).__name__,  # as the transport names remote errors
            error_message=str(exc),
            traceback=text,
        )
        _report(spec.ready_fd, report)
        raise SystemExit(_protocol.EXIT_FAILED) from None


def _serve(spec: _protocol.ChildSpec, runner: _Runner) -> int:
    actor = runner.actor
    # SIGTERM stops at once (after the current message); a stop message waits for those queued before it.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: actor.stop_self())
    ready = _protocol.ReadyReport(
        ok=True,
        pid=os.getpid(),
        address=runner.main.address if runner.main is not None else "",
        concurrent_address=runner.concurrent.address if runner.concurrent else "",
        concurrent_kinds=runner.concurrent_kinds,
        kinds=sorted(actor.handler_specs()),
    )
    _report(spec.ready_fd, ready)
    log.info("ready", extra={"address": ready.address})
    # Wake up now and then so signal handlers run promptly in the main thread.
    while not actor._stop_requested.wait(0.2):
        pass
    if actor._failure is not None:
        runner.fail(actor._failure, "the actor failed itself")
    runner.stop()
    for server in runner.servers:
        with contextlib.suppress(Exception):
            server.stop()
        _process.remove_ipc_files(server.address)
    log.info("stopped", extra={"exit_code": runner.exit_code})
    return runner.exit_code


def main() -> int:
    spec: _protocol.ChildSpec = _protocol.unpack(sys.stdin.buffer.read(), _protocol.ChildSpec)
    _die_with_parent(spec.parent_pid)
    # Ctrl-C in a terminal reaches the whole process group; the parent decides how its actors stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_logging(spec)
    os.environ["POLYTINKER_RUN_DIR"] = spec.run_dir  # this actor's own actors log beside it
    faulthandler.enable()  # a hard crash (segfault) still leaves a stack on stderr, which the parent logs
    try:
        return _serve(spec, _start(spec))
    except SystemExit as exc:
        return int(exc.code or 0)
    except BaseException as exc:
        _write_traceback(spec, exc)
        log.critical("actor process crashed: %s", exc, exc_info=exc)
        return _protocol.EXIT_FAILED


if __name__ == "__main__":
    code = main()
    # Actors this actor spawned get a graceful stop too (os._exit below skips atexit).
    _spawn._stop_all_at_exit()
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # os._exit: a non-daemon thread left by actor code must not keep a stopped actor alive.
    os._exit(code)
