"""Configuration of process actors: :class:`ActorConfig` and its :class:`RestartPolicy`.

Both are frozen; every field is checked in ``__post_init__`` and a bad value raises
:class:`~polytinker.errors.ConfigError` saying how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from polytinker.errors import ConfigError

RestartMode = Literal["permanent", "transient", "temporary"]
MailboxTransport = Literal["ipc", "tcp"]
TellFailure = Literal["stop", "log"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def _positive(owner: str, name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{owner}.{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class RestartPolicy:
    """When and how fast a :class:`~polytinker.actors.Supervisor` restarts a child (Erlang/OTP style)."""

    mode: RestartMode = "transient"
    """``permanent``: restart after any exit; ``transient``: only after an abnormal exit (non-zero
    code or a signal); ``temporary``: never restart, only report."""
    max_restarts: int = 3
    """Most restarts allowed within ``window_s``; one more failure and the supervisor gives up on
    the child and reports it."""
    window_s: float = 60.0
    """Sliding window, in seconds, over which ``max_restarts`` is counted."""
    backoff_initial_s: float = 0.1
    """Delay before the first restart in a window; later ones grow by ``backoff_factor``."""
    backoff_factor: float = 2.0
    """Growth of the delay per restart already made in the window (exponential back-off)."""
    backoff_max_s: float = 10.0
    """Upper bound of the delay between restarts."""

    def __post_init__(self) -> None:
        if self.mode not in ("permanent", "transient", "temporary"):
            raise ConfigError(f"RestartPolicy.mode must be 'permanent', 'transient' or 'temporary', got {self.mode!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"RestartPolicy.max_restarts must be an int >= 0, got {self.max_restarts!r}")
        _positive("RestartPolicy", "window_s", self.window_s)
        _positive("RestartPolicy", "backoff_initial_s", self.backoff_initial_s)
        _positive("RestartPolicy", "backoff_max_s", self.backoff_max_s)
        if not (isinstance(self.backoff_factor, int | float) and self.backoff_factor >= 1.0):
            raise ConfigError(
                f"RestartPolicy.backoff_factor must be >= 1.0 (1.0 = constant delay), got {self.backoff_factor!r}"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(
                f"RestartPolicy.backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s "
                f"({self.backoff_initial_s}); raise backoff_max_s or lower backoff_initial_s"
            )

    def backoff_s(self, recent_restarts: int) -> float:
        """Delay before the next restart, given how many restarts were already made in the window."""
        return float(min(self.backoff_max_s, self.backoff_initial_s * self.backoff_factor**recent_restarts))


@dataclass(frozen=True)
class ActorConfig:
    """How one actor process is started, addressed, asked and stopped."""

    start_timeout_s: float = 30.0
    """How long :func:`spawn` waits for the child to run ``on_start`` and report ready before it
    kills the child and raises ActorError. Raise it for actors that load models in ``on_start``."""
    stop_timeout_s: float = 5.0
    """How long a graceful stop (``on_stop``) may take before the child is killed with SIGKILL."""
    ask_timeout_s: float = 60.0
    """Default timeout of ``ActorRef.ask`` when the call gives none."""
    transport: MailboxTransport = "ipc"
    """Mailbox socket: ``ipc`` (a Unix socket next to the actor's log) or ``tcp`` (loopback, random port)."""
    tell_failure: TellFailure = "stop"
    """What an exception in a handler reached by ``tell`` does (no one is waiting for it): ``stop``
    calls ``on_failure`` and ends the process with exit code 1, so a supervisor restarts it (pykka
    and Erlang do the same); ``log`` calls ``on_failure`` and keeps serving."""
    log_level: LogLevel = "INFO"
    """Lowest level the child writes to ``<run_dir>/actors/<name>.log``."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for the child, as ``(name, value)`` pairs."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """Used when the actor is spawned through a Supervisor."""

    def __post_init__(self) -> None:
        _positive("ActorConfig", "start_timeout_s", self.start_timeout_s)
        _positive("ActorConfig", "stop_timeout_s", self.stop_timeout_s)
        _positive("ActorConfig", "ask_timeout_s", self.ask_timeout_s)
        if self.transport not in ("ipc", "tcp"):
            raise ConfigError(f"ActorConfig.transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.tell_failure not in ("stop", "log"):
            raise ConfigError(f"ActorConfig.tell_failure must be 'stop' or 'log', got {self.tell_failure!r}")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"ActorConfig.log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        for pair in self.env:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
                raise ConfigError(f"ActorConfig.env must hold (name, value) string pairs, got {pair!r}")
        if not isinstance(self.restart, RestartPolicy):
            raise ConfigError(f"ActorConfig.restart must be a RestartPolicy, got {type(self.restart).__name__}")


__all__ = ["ActorConfig", "LogLevel", "MailboxTransport", "RestartMode", "RestartPolicy", "TellFailure"]
