"""The one exception root of polytinker.

Every error polytinker raises derives from :class:`PolytinkerError`; where a builtin exception
fits, the subclass also inherits it, so ``except ValueError`` keeps working for callers that
do not know polytinker.

- ``ConfigError``: a setting or argument is wrong (also ``ValueError``).
- ``ProtocolError``: a message on the wire is malformed, oversized or of an unknown kind.
- ``TransportError``: a socket-level failure; ``PeerDeadError`` when heartbeats stop.
- ``RequestTimeout``: a call did not finish in its time (also ``TimeoutError``).
- ``RemoteError``: the peer ran the request and it raised; carries the remote type and traceback.
- ``ActorError`` / ``ActorDeadError``: an actor failed or is no longer running.
- ``ModelError``: a model could not be found, fetched or loaded.
- ``EnvError``: an environment broke its contract or raised.
- ``NotBuiltError``: a documented part that this version does not implement yet.
"""

from __future__ import annotations


class PolytinkerError(Exception):
    """Root of every polytinker error."""


class ConfigError(PolytinkerError, ValueError):
    """A configuration value or argument is invalid; the message says which and how to fix it."""


class ProtocolError(PolytinkerError, ValueError):
    """A message broke the wire protocol (malformed, oversized, unknown kind, wrong version)."""


class TransportError(PolytinkerError, ConnectionError):
    """A socket-level failure."""


class PeerDeadError(TransportError):
    """The peer stopped answering heartbeats."""


class RequestTimeout(PolytinkerError, TimeoutError):
    """A request did not complete within its timeout."""


class RemoteError(PolytinkerError, RuntimeError):
    """The remote side raised while handling a request."""

    def __init__(self, message: str, *, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        base = super().__str__()
        return f"{self.remote_type}: {base}" if self.remote_type else base


class ActorError(PolytinkerError, RuntimeError):
    """An actor failed to start or a handler failed."""


class ActorDeadError(ActorError):
    """A message was sent to an actor that is not running."""


class ModelError(PolytinkerError, RuntimeError):
    """A model could not be found, fetched or loaded."""


class EnvError(PolytinkerError, RuntimeError):
    """An environment broke its contract or raised."""


class NotBuiltError(PolytinkerError, NotImplementedError):
    """A documented capability that this version of polytinker does not implement yet."""


__all__ = [
    "ActorDeadError",
    "ActorError",
    "ConfigError",
    "EnvError",
    "ModelError",
    "NotBuiltError",
    "PeerDeadError",
    "PolytinkerError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeout",
    "TransportError",
]
