"""The one exception root of polytinker.

Every error polytinker raises derives from :class:`PolytinkerError`; where a builtin exception
fits, the subclass also inherits it, so ``except ValueError`` keeps working for callers that
do not know polytinker.

- ``ConfigError``: a setting or argument is wrong (also ``ValueError``); ``RequestKeyReused``: a
  ``create_job`` request key the tenant already used for a job with other fields.
- ``AuthError``: not admitted (unknown key, refused Curve key, another tenant's job).
- ``ProtocolError``: a message on the wire is malformed, oversized or of an unknown kind.
- ``TransportError``: a socket-level failure; ``PeerDeadError`` when heartbeats stop.
- ``RequestTimeout``: a call did not finish in its time (also ``TimeoutError``).
- ``RemoteError``: the peer ran the request and it raised; carries the error's wire code, the
  remote type name and the error id the server logged its traceback under.
- ``ActorError`` / ``ActorDeadError``: an actor failed or is no longer running;
  ``ActorStartError``: an actor process failed to start; ``RuntimeDead``: an actor a runtime
  cannot do without stayed down, and the runtime stopped.
- ``OverloadedError``, ``JobNotRunning``: the scheduler refused a call for now (retry later).
- ``WorkerUnavailable``, ``WorkerFailed``, ``NotResident``, ``GradientLost``: between the scheduler and its workers.
- ``ModelError``: a model could not be found, fetched or loaded.
- ``EnvError``: an environment broke its contract or raised; ``EnvHookError``: a game's hook
  returned what the contract does not allow (also ``TypeError``; it names the hook and the line
  of the game's code); ``EnvBusy``: an env source refuses a new episode for now (retry after
  ``retry_after_s``).
- ``SimulationError``: the scheduler's simulator reached an impossible state (also ``AssertionError``).
- ``NotBuiltError``: a documented part that this version does not implement yet.

Errors a caller acts on declare a wire ``code``: a server that raises one in a handler answers
with that code (docs/wire-protocol.md), and ``error_class(code)`` gives a client the class back,
so error kinds cross processes as codes, never as class-name strings.
"""

from __future__ import annotations

from typing import ClassVar

_BY_CODE: dict[str, type[PolytinkerError]] = {}


class PolytinkerError(Exception):
    """Root of every polytinker error."""

    code: ClassVar[str] = ""
    """The wire code of this kind of error ('' for none: it travels as a generic handler error)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code", "")
        if code:
            if code in _BY_CODE:
                raise TypeError(f"error code {code!r} is taken by {_BY_CODE[code].__qualname__}")
            _BY_CODE[code] = cls


def error_class(code: str) -> type[PolytinkerError] | None:
    """The error class that declares wire ``code``, or None."""
    return _BY_CODE.get(code)


class ConfigError(PolytinkerError, ValueError):
    """A configuration value or argument is invalid; the message says which and how to fix it."""

    code = "config"


class StateDirInUse(ConfigError):
    """Another live runtime holds the state directory a runtime was to start on (the message names
    its process): connect to that one, or give this one another ``state_dir``."""


class RequestKeyReused(ConfigError):
    """A create_job's ``request_key`` that the tenant already used for a job with other fields: a
    resent call carries its own key with the same fields, a new call a new key (409 over HTTP)."""

    code = "request_key_reused"


class ProtocolError(PolytinkerError, ValueError):
    """A message broke the wire protocol (malformed, oversized, unknown kind, wrong version)."""

    code = "protocol"


class TransportError(PolytinkerError, ConnectionError):
    """A socket-level failure."""


class PeerDeadError(TransportError):
    """The peer stopped answering heartbeats."""


class AuthError(PolytinkerError, PermissionError):
    """Not admitted: an unknown API key, a Curve key the server refuses, or a tenant asking for
    what it may not touch."""

    code = "auth"


class RequestTimeout(PolytinkerError, TimeoutError):
    """A request did not complete within its timeout."""


class RemoteError(PolytinkerError, RuntimeError):
    """The remote side raised while handling a request.

    ``code`` is the error's wire code (``handler`` for one no caller acts on; else the code of a
    class ``error_class`` knows); ``error_id`` names the server's log line with the traceback.
    ``remote_traceback`` is empty unless the server exposes tracebacks (an actor to its parent)."""

    def __init__(
        self,
        message: str,
        *,
        remote_type: str = "",
        remote_traceback: str = "",
        code: str = "handler",
        error_id: str = "",
    ) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.code = code  # type: ignore[misc]  # an instance's code: the remote error's
        self.error_id = error_id

    def __str__(self) -> str:
        base = super().__str__()
        base = f"{self.remote_type}: {base}" if self.remote_type else base
        return f"{base} [error id {self.error_id}]" if self.error_id else base


class ActorError(PolytinkerError, RuntimeError):
    """An actor failed to start or a handler failed."""


class ActorStartError(ActorError):
    """An actor process failed to start: its ``on_start`` raised, it exited early, or it was too slow."""

    def __init__(self, message: str, *, name: str, pid: int, child_traceback: str = "") -> None:
        super().__init__(message)
        self.name = name
        self.pid = pid
        self.child_traceback = child_traceback
        # Filled in once the failed process is gone (negative for a signal).
        self.exit_code: int | None = None


class ActorDeadError(ActorError):
    """A message was sent to an actor that is not running."""


class RuntimeDead(ActorError):
    """An actor the runtime cannot do without stayed down (its supervisor gave up on it), and the
    runtime stopped; the message names the actor, its last exit code, restarts and error."""

    code = "runtime_dead"


class OverloadedError(PolytinkerError):
    """The scheduler is at a bound; try again after ``retry_after_s`` seconds."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobNotRunning(PolytinkerError):
    """The job exists but cannot take this call now (queued, paused, finished); ``state`` says which,
    ``tenant`` whose job it is (for the scheduler's counts; empty on the client side)."""

    code = "job_not_running"

    def __init__(self, message: str, state: str = "", tenant: str = "") -> None:
        super().__init__(message)
        self.state = state
        self.tenant = tenant


class WorkerUnavailable(TransportError):
    """A worker did not come back within the scheduler's ``worker_retry_s``."""

    code = "worker_unavailable"


class WorkerFailed(PolytinkerError):
    """A worker's answer: its process failed as a whole (a learner group lost one of its ranks) and
    is going away; whatever supervises it starts a new incarnation. The scheduler sends the request
    to that one, as when a worker dies under a call: a tenant never sees this error."""

    code = "worker_failed"


class NotResident(PolytinkerError):
    """A worker's answer: what the request names (an adapter, a full-parameter model) is not loaded
    there, never prepared or dropped since; the scheduler prepares it again and resends."""

    code = "not_resident"


class GradientLost(PolytinkerError):
    """A resent optim_step reached a learner process that holds no gradient for it (the one that
    took the step's forward_backward calls died before stepping): redo the step's calls."""

    code = "gradient_lost"


class ModelError(PolytinkerError, RuntimeError):
    """A model could not be found, fetched or loaded."""

    code = "model"


class EnvError(PolytinkerError, RuntimeError):
    """An environment broke its contract or raised."""

    code = "env"


class EnvHookError(EnvError, TypeError):
    """A game's hook returned what the text-env contract does not allow (a dict from ``_render``, a
    reward for an agent the game does not have, numbers as legal moves). The message names the
    hook and where the game defines it; ``hook`` (``"Class.name"``), ``where`` (``"FILE:LINE"``)
    and ``expected`` (what it must return) say the same to a checker. It travels as ``EnvError``."""

    def __init__(self, message: str, hook: str = "", where: str = "", expected: str = "") -> None:
        super().__init__(message)
        self.hook = hook
        self.where = where
        self.expected = expected


class EnvBusy(EnvError):
    """No episode can be opened now (the server has ``max_episodes`` open); try after
    ``retry_after_s``. ``max_episodes`` is the server's bound (0 when unknown)."""

    def __init__(self, message: str, retry_after_s: float = 0.5, max_episodes: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.max_episodes = max_episodes


class SimulationError(PolytinkerError, AssertionError):
    """The simulated cluster reached an impossible state (an over-committed resource, say)."""


class NotBuiltError(PolytinkerError, NotImplementedError):
    """A documented capability that this version of polytinker does not implement yet."""

    code = "not_built"


__all__ = [
    "ActorDeadError",
    "ActorError",
    "ActorStartError",
    "AuthError",
    "ConfigError",
    "EnvBusy",
    "EnvError",
    "EnvHookError",
    "GradientLost",
    "JobNotRunning",
    "ModelError",
    "NotBuiltError",
    "NotResident",
    "OverloadedError",
    "PeerDeadError",
    "PolytinkerError",
    "ProtocolError",
    "RemoteError",
    "RequestKeyReused",
    "RequestTimeout",
    "RuntimeDead",
    "SimulationError",
    "StateDirInUse",
    "TransportError",
    "WorkerFailed",
    "WorkerUnavailable",
    "error_class",
]
