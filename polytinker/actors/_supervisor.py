"""One-for-one supervision of actor processes (Erlang/OTP style).

When a supervised child exits and its :class:`RestartPolicy` says so, the supervisor waits an
exponentially growing back-off and starts a new incarnation with the same constructor
arguments. More than ``max_restarts`` restarts within ``window_s`` and it gives up on that child
(the others are untouched: one-for-one). Every exit is kept in the child's report: exit code
(negative for a signal, -9 for SIGKILL) and the traceback the child left, if any.

The ref returned by :meth:`Supervisor.spawn` is stable: the supervisor attaches each new
incarnation to the same :class:`ActorRef`, so callers never re-resolve addresses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytinker.actors import _logs, _spawn
from polytinker.actors._process import ChildProcess
from polytinker.actors._ref import ActorRef
from polytinker.actors.config import ActorConfig
from polytinker.errors import ActorError, ActorStartError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildExit:
    """One exit of one incarnation of a supervised actor."""

    pid: int
    """Pid of the incarnation that exited (0 when it never started)."""
    exit_code: int | None
    """Its exit code; a signal shows as its negative number (-9 for SIGKILL)."""
    traceback: str
    """The traceback it left (an exception in on_start, a failed tell, a crash); '' for none."""
    time: float
    """When the exit was seen (Unix time)."""
    action: str
    """What the supervisor did about it: 'restart', 'give up', 'none' (stopped on purpose or policy)."""


@dataclass(frozen=True)
class ChildReport:
    """The state and exit history of one supervised actor."""

    name: str
    alive: bool
    pid: int | None
    restarts: int
    """Restarts made so far (all time)."""
    gave_up: bool
    """True once the restart limit was hit; the actor stays down."""
    exits: tuple[ChildExit, ...]

    @property
    def last_exit_code(self) -> int | None:
        return self.exits[-1].exit_code if self.exits else None

    @property
    def last_traceback(self) -> str:
        return next((e.traceback for e in reversed(self.exits) if e.traceback), "")

    @property
    def last_error(self) -> str:
        """The last non-empty line of the last traceback (``ValueError: ...``); '' for none."""
        lines = [line.strip() for line in self.last_traceback.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def describe(self) -> str:
        """One line for an operator: which actor, its state, its last exit and why."""
        state = "down, and not restarted again" if self.gave_up else ("alive" if self.alive else "down")
        last = self.exits[-1] if self.exits else None
        line = f"actor {self.name!r} is {state} ({self.restarts} restarts)"
        if last is not None:
            line += f"; last exit code {last.exit_code} (pid {last.pid})"
        return line + (f": {self.last_error}" if self.last_error else "")


@dataclass
class _Entry:
    ref: ActorRef
    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    restart_times: deque[float]
    restarts: int = 0
    gave_up: bool = False
    exits: tuple[ChildExit, ...] = ()
    timer: threading.Timer | None = None


class Supervisor:
    """Starts actors and restarts them one-for-one when they die.

    ``on_give_up(report)`` is called (on a background thread) when a child hits its restart limit.
    ``on_change(report)`` is called (likewise) after every exit of a child and every restart, with
    that child's report, as soon as the exit is seen: an owner that routes work to the child can stop
    waiting on the dead process at once instead of at its next heartbeat.
    """

    def __init__(
        self,
        *,
        run_dir: str | Path | None = None,
        name: str = "supervisor",
        on_give_up: Callable[[ChildReport], None] | None = None,
        on_change: Callable[[ChildReport], None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).absolute() if run_dir is not None else _spawn.default_run_dir()
        self.name = _spawn.check_name(name)
        self._on_give_up = on_give_up
        self._on_change = on_change
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._events = _logs.LogFile(_logs.log_path(self.run_dir, name))

    def spawn(
        self,
        actor: type | str,
        *args: Any,
        name: str | None = None,
        config: ActorConfig | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Start a supervised actor; same arguments as :func:`spawn` (the run dir is the supervisor's)."""
        target = _spawn.target_of(actor)
        name = _spawn.check_name(name or _spawn.default_name(target))
        config = config or ActorConfig()
        with self._lock:
            if self._closed:
                raise ActorError(f"supervisor {self.name!r} is stopped")
            if name in self._entries:
                raise ConfigError(f"supervisor {self.name!r} already has an actor named {name!r}; pick another name")
            entry = _Entry(ActorRef(name, config), target, args, dict(kwargs), deque())
            self._entries[name] = entry
        try:
            child = _spawn.start_child(target, args, entry.kwargs, name=name, run_dir=self.run_dir, config=config)
        except BaseException:
            with self._lock:
                del self._entries[name]
            raise
        self._attach(entry, child)
        return entry.ref

    def children(self) -> dict[str, ActorRef]:
        with self._lock:
            return {name: e.ref for name, e in self._entries.items()}

    def report(self) -> dict[str, ChildReport]:
        """Each child's state and exit history."""
        with self._lock:
            entries = list(self._entries.values())
        return {
            e.ref.name: ChildReport(e.ref.name, e.ref.alive, e.ref.pid, e.restarts, e.gave_up, e.exits) for e in entries
        }

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop every child gracefully (SIGKILL after its stop timeout) and restart none."""
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
        threads = []
        for e in entries:
            if e.timer is not None:
                e.timer.cancel()
            e.ref.stop_requested = True
            threads.append(threading.Thread(target=e.ref.stop, args=(timeout_s,), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- restarts ---------------------------------------------------------------------------------

    def _attach(self, entry: _Entry, child: ChildProcess) -> None:
        entry.ref._attach(child)
        child.on_exit(lambda c, code: self._child_exited(entry, c.pid, code, c.last_traceback()))

    def _child_exited(self, entry: _Entry, pid: int, code: int | None, tb: str) -> None:
        ref, policy = entry.ref, entry.ref.config.restart
        now = time.time()
        with self._lock:
            wanted = self._closed or ref.stop_requested or _spawn.is_exiting()
            if wanted or policy.mode == "temporary" or (policy.mode == "transient" and code == 0):
                action = "none"
            else:
                while entry.restart_times and now - entry.restart_times[0] > policy.window_s:
                    entry.restart_times.popleft()
                action = "give up" if len(entry.restart_times) >= policy.max_restarts else "restart"
            entry.exits = (*entry.exits, ChildExit(pid, code, tb, now, action))
            delay = policy.backoff_s(len(entry.restart_times))
            if action == "restart":
                entry.restart_times.append(now + delay)
                ref._set_down_reason(f"is restarting after exit code {code} (restart in {delay:.2f} s)")
                entry.timer = threading.Timer(delay, self._restart, (entry,))
                entry.timer.daemon = True
                entry.timer.start()
            elif action == "give up":
                entry.gave_up = True
                ref._set_down_reason(
                    f"is down: it failed {len(entry.restart_times) + 1} times within {policy.window_s} s "
                    f"(RestartPolicy.max_restarts={policy.max_restarts}); supervisor {self.name!r} gave up"
                )
        if action == "give up":
            level = "ERROR"
        elif wanted and code == 0:
            level = "INFO"  # a stop that was asked for and went cleanly: no warning for the user to read
        else:
            level = "WARNING"
        self._event(ref.name, level, f"child exited; {action}", pid, code, tb)
        self._notify(self._on_change, ref.name)
        if action == "give up":
            self._notify(self._on_give_up, ref.name)

    def _notify(self, callback: Callable[[ChildReport], None] | None, name: str) -> None:
        if callback is None:
            return
        try:
            callback(self.report()[name])
        except Exception:  # an owner's bug must not stop the supervision of the other children
            log.exception("%s: callback on actor %r failed", self.name, name)

    def _restart(self, entry: _Entry) -> None:
        ref = entry.ref
        with self._lock:
            if self._closed or ref.stop_requested:
                return
        try:
            child = _spawn.start_child(
                entry.target, entry.args, entry.kwargs, name=ref.name, run_dir=self.run_dir, config=ref.config
            )
        except ActorStartError as exc:
            # A failed restart is one more failure: count it and go round again (or give up).
            self._child_exited(entry, exc.pid, exc.exit_code, exc.child_traceback or str(exc))
            return
        except Exception as exc:
            self._child_exited(entry, 0, None, f"restart failed: {exc!r}")
            return
        with self._lock:
            unwanted = self._closed or ref.stop_requested  # stopped while the new incarnation started
        if unwanted:
            child.stop(ref.config.stop_timeout_s)
            return
        # Outside the lock: on_exit runs the callback at once if the child already died.
        self._attach(entry, child)
        with self._lock:
            entry.restarts += 1
            unwanted = self._closed or ref.stop_requested
        if unwanted:
            ref.stop()
            return
        self._event(ref.name, "INFO", "child restarted", child.pid, None, "")
        self._notify(self._on_change, ref.name)

    def _event(self, actor: str, level: str, message: str, pid: int, code: int | None, tb: str) -> None:
        extra = {"child": actor, "child_pid": pid, "exit_code": code}
        if tb:
            extra["traceback"] = tb
        self._events.write_line(_logs.make_line(self.name, os.getpid(), level, message, extra))
        log.log(
            logging.getLevelName(level), "%s: actor %r (pid %s) %s, exit code %s", self.name, actor, pid, message, code
        )
