"""Starting, watching and ending actor processes.

A child is ``python -m polytinker.actors._child`` started with ``subprocess`` (a fresh
interpreter, as multiprocessing's "spawn" method gives, never a fork of a threaded parent).
It gets its :class:`~._protocol.ChildSpec` on stdin and answers the readiness handshake on an
inherited pipe. Each running child is a :class:`~._process.ChildProcess`, which reads its stdout
and stderr, line by line, into its JSON-lines log; one reaper thread here notices its exit.

Every ``Popen`` runs on one long-lived daemon thread: Linux's parent-death signal fires when the
*thread* that forked the child exits, so a child started from a short-lived thread (a restart
timer) would otherwise be killed when that thread ends.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack

from polytinker.actors import _logs, _protocol
from polytinker.actors._process import ChildProcess
from polytinker.actors._ref import ActorRef
from polytinker.actors.config import ActorConfig
from polytinker.errors import ActorError, ActorStartError, ConfigError, RemoteError

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_IPC_PATH_MAX = 100  # sun_path holds 108 bytes on Linux; keep a margin
_REAP_PERIOD_S = 0.05


class _Launcher:
    """Runs callables on one daemon thread that lives as long as the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="actor-launcher", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future[Any] = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)


class _Reaper:
    """One thread that notices when any child exits and runs its exit callbacks."""

    def __init__(self) -> None:
        self._children: set[ChildProcess] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, child: ChildProcess) -> None:
        with self._lock:
            self._children.add(child)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="actor-reaper", daemon=True)
                self._thread.start()

    def live(self) -> list[ChildProcess]:
        with self._lock:
            return [c for c in self._children if c.poll() is None]

    def _loop(self) -> None:
        while True:
            time.sleep(_REAP_PERIOD_S)
            with self._lock:
                done = [c for c in self._children if c.poll() is not None]
                self._children.difference_update(done)
            for child in done:
                child._exited()


_launcher = _Launcher()
_reaper = _Reaper()
_names = itertools.count(1)
_default_run_dir: Path | None = None
_exiting = threading.Event()


def _after_fork_in_child() -> None:
    # A forked copy of this process has neither the threads nor the children: start afresh.
    global _launcher, _reaper, _exiting
    _launcher, _reaper, _exiting = _Launcher(), _Reaper(), threading.Event()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_run_dir() -> Path:
    """``$POLYTINKER_RUN_DIR``, else one temporary folder per parent process. In an actor's process
    it is that actor's run directory (the child sets the variable), so the actors an actor starts
    log beside it."""
    global _default_run_dir
    env = os.environ.get("POLYTINKER_RUN_DIR")
    if env:
        return Path(env).absolute()
    if _default_run_dir is None:
        _default_run_dir = Path(tempfile.mkdtemp(prefix="polytinker-run-"))
    return _default_run_dir


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"actor name {name!r} is not usable as a file name: use 1-100 letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-'"
        )
    return name


def default_name(target: str) -> str:
    return f"{target.rpartition(':')[2].rpartition('.')[2]}-{next(_names)}"


def target_of(actor: type | str) -> str:
    """``module:QualName`` for an Actor subclass (a script path for one defined in ``__main__``)."""
    if isinstance(actor, str):
        if ":" not in actor:
            raise ConfigError(f"actor {actor!r} must be a class or a 'package.module:ClassName' string")
        return actor
    module, qualname = actor.__module__, actor.__qualname__
    if "<locals>" in qualname:
        raise ConfigError(f"actor class {qualname} is defined inside a function; define it at module level")
    if module in ("__main__", "__mp_main__"):
        main_file = getattr(sys.modules.get(module), "__file__", None)
        if not main_file:
            raise ConfigError(
                f"actor class {qualname} lives in an interactive __main__; move it to a module the child can import"
            )
        return f"{os.path.abspath(main_file)}:{qualname}"
    return f"{module}:{qualname}"


def _child_sys_path() -> list[str]:
    """The parent's import path for the child, less setuptools' vendored packages: importing
    pkg_resources (pygame does) appends them, and in a child they shadow the real packages
    (an old typing_extensions broke pydantic, hence vLLM)."""
    return [p for p in sys.path if isinstance(p, str) and "setuptools/_vendor" not in p]


def _mailbox_address(run_dir: Path, name: str, transport: str) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    path = _logs.actors_dir(run_dir) / f"{name}.{uuid.uuid4().hex[:8]}.sock"
    if len(str(path)) > _IPC_PATH_MAX:
        short = Path(tempfile.gettempdir()) / f"polytinker-{os.getuid()}"
        short.mkdir(mode=0o700, exist_ok=True)
        path = short / f"{uuid.uuid4().hex[:16]}.sock"
    return f"ipc://{path}"


def _popen(env: dict[str, str], ready_w: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "polytinker.actors._child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(ready_w,),
        env=env,
    )


def start_child(
    target: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str, run_dir: Path, config: ActorConfig
) -> ChildProcess:
    """Start one actor process and wait for its readiness handshake; raise ActorError if it fails."""
    if _exiting.is_set():
        raise ActorError(f"not starting actor {name!r}: this process is exiting")
    _logs.actors_dir(run_dir).mkdir(parents=True, exist_ok=True)
    ready_r, ready_w = os.pipe()
    spec = _protocol.ChildSpec(
        target=target,
        name=name,
        run_dir=str(run_dir),
        address=_mailbox_address(run_dir, name, config.transport),
        parent_pid=os.getpid(),
        ready_fd=ready_w,
        log_level=config.log_level,
        tell_failure=config.tell_failure,
        args=list(args),
        kwargs=dict(kwargs),
        sys_path=_child_sys_path(),
    )
    try:
        data = _protocol.pack(spec)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(config.env)}
        popen = _launcher.run(lambda: _popen(env, ready_w))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    child = ChildProcess(popen, name, run_dir, _logs.LogFile(_logs.log_path(run_dir, name)), config.stop_timeout_s)
    _reaper.watch(child)
    try:
        assert popen.stdin is not None
        with popen.stdin:
            popen.stdin.write(data)
        report = _await_ready(child, ready_r, config.start_timeout_s)
    except BaseException as exc:
        # A child that reported its failure exits by itself (code 1); anything else is killed now.
        if not (isinstance(exc, ActorStartError) and child.wait(2.0) is not None):
            child.signal(signal.SIGKILL)
        code = child.wait(None)
        if isinstance(exc, ActorStartError):
            exc.exit_code = code
        raise
    finally:
        os.close(ready_r)
    child.address = report.address
    child.concurrent_address = report.concurrent_address
    child.concurrent_kinds = frozenset(report.concurrent_kinds)
    child.kinds = frozenset(report.kinds)
    return child


def _await_ready(child: ChildProcess, fd: int, timeout_s: float) -> _protocol.ReadyReport:
    # Parse as soon as one whole message arrived: a grandchild that inherited the pipe may keep it open.
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ActorStartError(
                f"actor {child.name!r} (pid {child.pid}) did not report ready within {timeout_s} s; "
                "raise ActorConfig.start_timeout_s if its on_start is slow",
                name=child.name,
                pid=child.pid,
            )
        readable, _, _ = select.select([fd], [], [], min(left, 0.1))
        chunk = os.read(fd, 65536) if readable else None
        if chunk:
            unpacker.feed(chunk)
            for raw in unpacker:
                return _report_to_child(child, _protocol.from_raw(raw, _protocol.ReadyReport))
        elif chunk == b"" or child.poll() is not None:
            code = child.wait(5.0)
            raise ActorStartError(
                f"actor {child.name!r} (pid {child.pid}) exited with code {code} before it was ready; "
                f"its stderr ended with:\n{child.stderr_tail() or '(nothing)'}",
                name=child.name,
                pid=child.pid,
                child_traceback=child.last_traceback(),
            )


def _report_to_child(child: ChildProcess, report: _protocol.ReadyReport) -> _protocol.ReadyReport:
    if report.ok:
        return report
    remote = RemoteError(report.error_message, remote_type=report.error_type, remote_traceback=report.traceback)
    raise ActorStartError(
        f"actor {child.name!r} failed to start: {report.error_type}: {report.error_message}\n"
        f"--- traceback in the actor process (pid {report.pid}) ---\n{report.traceback}",
        name=child.name,
        pid=child.pid,
        child_traceback=report.traceback,
    ) from remote


def spawn(
    actor: type | str,
    *args: Any,
    name: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    config: ActorConfig | None = None,
    **kwargs: Any,
) -> ActorRef:
    """Start ``actor`` (an Actor subclass, or ``"package.module:ClassName"``) in a new process.

    ``args`` and ``kwargs`` go to the actor's constructor in the child; they must be
    msgpack-encodable. Returns once the child ran ``on_start`` and its mailbox is bound; raises
    ActorError carrying the child's traceback if it failed to start. The log is
    ``<run_dir>/actors/<name>.log`` (``run_dir`` defaults to ``$POLYTINKER_RUN_DIR`` or a
    temporary folder).
    """
    target = target_of(actor)
    name = check_name(name or default_name(target))
    config = config or ActorConfig()
    if not isinstance(config, ActorConfig):
        raise ConfigError(f"config must be an ActorConfig, got {type(config).__name__}")
    root = Path(run_dir).absolute() if run_dir is not None else default_run_dir()  # the child may chdir
    child = start_child(target, args, kwargs, name=name, run_dir=root, config=config)
    return ActorRef(name, config, child)


def is_exiting() -> bool:
    """True once the process began stopping its actors to exit (supervisors then restart nothing)."""
    return _exiting.is_set()


def _stop_all_at_exit() -> None:
    """Stop the children still running when the parent exits normally: SIGTERM, then SIGKILL after
    each child's own ``stop_timeout_s``. Children that a thread (a supervisor's restart) was starting
    meanwhile are stopped too: a child never signalled would die by the parent-death SIGKILL instead,
    without its on_stop."""
    _exiting.set()  # from here on start_child refuses, so the rounds below end
    signalled: set[ChildProcess] = set()
    while live := [c for c in _reaper.live() if c not in signalled]:
        for child in live:
            child.signal(signal.SIGTERM)
        signalled.update(live)
        start = time.monotonic()
        for child in live:
            if child.wait(max(0.0, start + child.stop_timeout_s - time.monotonic())) is None:
                child.signal(signal.SIGKILL)
                child.wait(1.0)
            child.remove_sockets()


atexit.register(_stop_all_at_exit)
