"""The :class:`Actor` base class: lifecycle hooks and handlers by message kind.

An actor lives in its own process (see :func:`~polytinker.actors.spawn`) and serves its
mailbox one message at a time: two handlers of the same actor never run at once, unless a
handler is declared ``concurrent=True`` (then it runs as soon as it arrives, next to whatever
else is running, and must guard its own state).

Handlers are found two ways, which can be mixed:

- methods decorated with ``@handler("kind")``;
- an explicit class attribute ``handler_table = {"kind": "method_name"}``.

A handler takes the decoded payload and returns the reply (``None`` for none).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from polytinker.errors import ConfigError, ProtocolError
from polytinker.transport.messages import message_type

F = TypeVar("F", bound=Callable[..., Any])

# Kinds that start with this prefix belong to the actor machinery (pings, stop requests).
RESERVED_PREFIX = "_pt."


@dataclass(frozen=True)
class HandlerSpec:
    """How one message kind is handled."""

    kind: str
    """The message kind the handler answers."""
    method: str
    """Name of the actor method that handles it."""
    concurrent: bool = False
    """Run without taking the mailbox lock (the handler guards its own state)."""


def handler(kind: str, *, concurrent: bool = False) -> Callable[[F], F]:
    """Mark an actor method as the handler of messages of ``kind``."""
    if not isinstance(kind, str) or not kind or kind.startswith(RESERVED_PREFIX):
        raise ConfigError(
            f"handler kind must be a non-empty string not starting with {RESERVED_PREFIX!r}, got {kind!r}"
        )

    def mark(fn: F) -> F:
        fn._polytinker_handler = (kind, concurrent)  # type: ignore[attr-defined]
        return fn

    return mark


def check_payload_type(kind: str, payload: Any) -> None:
    """A kind that names a typed message (``@polytinker.transport.message(kind)``) takes only that type."""
    expected = message_type(kind)
    if expected is not None and type(payload) is not expected:
        raise ProtocolError(f"kind {kind!r} takes a {expected.__qualname__}, got {type(payload).__qualname__}")


@dataclass(frozen=True)
class ActorContext:
    """What the process knows about the actor it runs; set before the actor is constructed."""

    name: str
    """The actor's name (unique within a run directory)."""
    run_dir: Path | None
    """The run directory (``None`` for an actor constructed in-process, e.g. in a unit test)."""


# One actor per process: the child sets this before constructing the actor, so ``self.name`` and
# ``self.log`` work inside ``__init__`` even when a subclass forgets to call ``super().__init__``.
_current_context: ActorContext | None = None


def _set_context(ctx: ActorContext | None) -> None:
    global _current_context
    _current_context = ctx


class Actor:
    """Base class of process actors; subclass it and add handlers.

    Lifecycle, all called in the actor's process:

    - ``on_start()``: after construction, before the actor is reported ready; an exception here
      makes :func:`spawn` raise ActorError carrying this process's traceback.
    - ``on_stop()``: on a graceful stop, after the message being handled finishes.
    - ``on_failure(exc)``: after an exception that no asker receives (in a handler reached by
      ``tell``, a failed ``on_start``, or one passed to ``fail_self``); the process then exits
      with code 1 unless the config says ``tell_failure="log"`` (``fail_self`` always exits).
    """

    handler_table: ClassVar[Mapping[str, str]] = {}
    _handlers: ClassVar[dict[str, HandlerSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._handlers = _collect_handlers(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Actor:
        self = super().__new__(cls)
        ctx = _current_context or ActorContext(name=cls.__name__, run_dir=None)
        self._context = ctx
        self._mailbox_lock = threading.RLock()
        self._stop_requested = threading.Event()
        self._failure = None
        return self

    # Attributes set in __new__; declared for type checkers.
    _context: ActorContext
    _mailbox_lock: threading.RLock
    _stop_requested: threading.Event
    _failure: BaseException | None

    @property
    def name(self) -> str:
        """This actor's name."""
        return self._context.name

    @property
    def run_dir(self) -> Path | None:
        """The run directory the actor writes to (its log is ``run_dir/actors/<name>.log``)."""
        return self._context.run_dir

    @property
    def log(self) -> logging.Logger:
        """A logger whose records land as JSON lines in the actor's log; pass fields with ``extra=``."""
        return logging.getLogger(f"polytinker.actor.{self.name}")

    def on_start(self) -> None:
        """Called once in the actor's process before it serves messages."""

    def on_stop(self) -> None:
        """Called once on a graceful stop."""

    def on_failure(self, exc: BaseException) -> None:
        """Called when an exception reaches no asker; the default only logs it (already done)."""

    def stop_self(self) -> None:
        """Ask for a graceful stop from inside the actor; the current handler finishes first."""
        self._stop_requested.set()

    def fail_self(self, exc: BaseException) -> None:
        """End this actor as failed, from any thread: its own work broke it (a child process it
        depends on died, a background thread crashed) and no asker is waiting to hear. The
        process runs ``on_failure(exc)``, not ``on_stop``, keeps the traceback for its
        supervisor's report and exits with code 1, so a supervisor restarts it."""
        if self._failure is None:
            self._failure = exc
        self._stop_requested.set()

    @classmethod
    def handler_specs(cls) -> Mapping[str, HandlerSpec]:
        """Every message kind this actor answers, with its handler."""
        return dict(cls._handlers)

    def dispatch(self, kind: str, payload: Any) -> Any:
        """Run the handler of ``kind`` on ``payload`` under the mailbox lock (unless it is concurrent)."""
        spec = self._handlers.get(kind)
        if spec is None:
            known = ", ".join(sorted(self._handlers)) or "none"
            raise ConfigError(f"actor {self.name!r} has no handler for kind {kind!r} (known: {known})")
        method = getattr(self, spec.method)
        if spec.concurrent:
            return method(payload)
        with self._mailbox_lock:
            return method(payload)


def _collect_handlers(cls: type[Actor]) -> dict[str, HandlerSpec]:
    found: dict[str, HandlerSpec] = {}
    # Walk the MRO from the base up so a subclass's handler for a kind replaces its parent's.
    for klass in reversed(cls.__mro__):
        local: dict[str, HandlerSpec] = {}
        for attr, value in vars(klass).items():
            mark = getattr(value, "_polytinker_handler", None)
            if mark is not None:
                kind, concurrent = mark
                if kind in local:
                    raise ConfigError(
                        f"{klass.__qualname__} has two handlers for kind {kind!r}: {local[kind].method} and {attr}"
                    )
                local[kind] = HandlerSpec(kind, attr, concurrent)
        table = vars(klass).get("handler_table", {})
        for kind, method in table.items():
            handler(kind)  # the same checks as the decorator form
            if not callable(getattr(klass, method, None)):
                raise ConfigError(
                    f"{klass.__qualname__}.handler_table maps {kind!r} to {method!r}, which is not a method"
                )
            if kind in local and local[kind].method != method:
                raise ConfigError(
                    f"{klass.__qualname__} handles kind {kind!r} twice: by decorator and in handler_table"
                )
            local.setdefault(kind, HandlerSpec(kind, method, False))
        found.update(local)
    return found
