"""The messages between a parent and the actor process it starts (not the mailbox traffic).

- :class:`ChildSpec`: what to run; the parent writes it, msgpack-encoded, to the child's stdin.
- :class:`ReadyReport`: the readiness handshake; the child writes one to an inherited pipe after
  ``on_start`` (``ok=True`` with its mailbox address) or after its startup failed (``ok=False``
  with the exception's type, message and traceback).

Both are plain msgpack maps: nothing is ever unpickled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack

from polytinker.errors import ProtocolError

# Exit codes of an actor process (a signal shows as its negative number, e.g. -9 for SIGKILL).
EXIT_OK = 0
EXIT_FAILED = 1  # an exception nobody received (failed on_start, a failed tell, a crashed main loop)
EXIT_ORPHANED = 3  # the parent died; the watchdog ended the process

# Mailbox kinds the machinery adds to every actor.
TELL_KIND = "_pt.tell"  # payload {"kind": str, "payload": Any}: a tell, so a failure has no asker
PING_KIND = "_pt.ping"  # answers the actor's name and pid
STOP_KIND = "_pt.stop"  # a graceful stop, queued behind the messages sent before it


@dataclass(frozen=True)
class ChildSpec:
    """What the child process runs."""

    target: str
    """``module:QualName`` of the Actor subclass, or ``path/to/script.py:QualName`` for a class
    defined in the parent's ``__main__`` script."""
    name: str
    """The actor's name."""
    run_dir: str
    """Run directory; the log is ``run_dir/actors/<name>.log``."""
    address: str
    """Where the mailbox should bind (``ipc://...`` or ``tcp://127.0.0.1:*``)."""
    parent_pid: int
    """The parent's pid, watched so the child never outlives it."""
    ready_fd: int
    """Inherited write end of the readiness pipe."""
    log_level: str
    """Lowest level written to the log."""
    tell_failure: str
    """``stop`` or ``log``: see ActorConfig.tell_failure."""
    args: list[Any]
    """Positional arguments of the actor's constructor (msgpack-encodable)."""
    kwargs: dict[str, Any]
    """Keyword arguments of the actor's constructor (msgpack-encodable)."""
    sys_path: list[str]
    """The parent's ``sys.path``; entries the child lacks are added, so the classes the parent
    can import the child can too (multiprocessing's spawn does the same)."""


@dataclass(frozen=True)
class ReadyReport:
    """The child's answer to the readiness handshake."""

    ok: bool
    """True when ``on_start`` finished and the mailbox is bound."""
    pid: int
    """The child's pid."""
    address: str = ""
    """The bound mailbox address (when ok); it serves messages one at a time, in arrival order."""
    concurrent_address: str = ""
    """A second mailbox for the handlers declared ``concurrent=True`` ('' when there are none)."""
    concurrent_kinds: list[str] = field(default_factory=list)
    """The kinds served at ``concurrent_address``."""
    kinds: list[str] = field(default_factory=list)
    """Every kind the actor handles, so a ref can refuse an unknown kind before sending it."""
    error_type: str = ""
    """Type name of the startup exception (when not ok), as RemoteError.remote_type has it."""
    error_message: str = ""
    """``str()`` of the startup exception."""
    traceback: str = ""
    """The formatted traceback of the startup exception, as the child printed it."""


def pack(msg: ChildSpec | ReadyReport) -> bytes:
    try:
        return bytes(msgpack.packb(asdict(msg), use_bin_type=True))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(
            f"cannot encode {type(msg).__name__} with msgpack ({exc}); actor constructor arguments must be "
            "msgpack-encodable (None, bool, int, float, str, bytes, list, dict)"
        ) from exc


def unpack(data: bytes, cls: type[Any]) -> Any:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"malformed {cls.__name__}: {exc}") from exc
    return from_raw(raw, cls)


def from_raw(raw: Any, cls: type[Any]) -> Any:
    """Build ``cls`` from a decoded msgpack map, rejecting unknown or missing fields."""
    names = {f.name for f in fields(cls)}
    if not isinstance(raw, dict) or not set(raw) <= names:
        raise ProtocolError(f"malformed {cls.__name__}: expected a map with keys among {sorted(names)}")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise ProtocolError(f"malformed {cls.__name__}: {exc}") from exc
