"""Frozen settings of the environments subsystem, one dataclass per part.

- ``EnvConfig``: how a text env treats invalid actions and how long texts may be.
- ``CoordinatorConfig``: concurrency and time limits of the episode coordinator.
- ``RemoteEnvConfig``: the client side of a remote env (timeouts).
- ``EnvServerConfig``: the server side of remote envs (episode limits, step timeout, sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from polytinker.errors import ConfigError


def _positive(owner: str, name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{owner}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class EnvConfig:
    """How a text env treats invalid actions, and the bounds of its texts."""

    invalid_action_penalty: float = -0.1
    """Reward added for each invalid action (<= 0)."""
    max_retries: int = 2
    """Invalid actions an agent may make in a row before ``on_retries_exhausted`` applies."""
    on_retries_exhausted: Literal["fallback", "forfeit"] = "fallback"
    """``fallback``: the env plays its fallback move for the agent (a seeded random legal move,
    or the game's default) and play goes on; ``forfeit``: the episode ends and the agent gets
    ``forfeit_reward`` (the others get 0)."""
    forfeit_reward: float = -1.0
    """Reward of an agent that forfeits (only with ``on_retries_exhausted="forfeit"``)."""
    max_observation_chars: int = 4096
    """Longest observation text (the observation space's bound)."""
    max_action_chars: int = 512
    """Longest action text; longer actions are invalid."""

    def __post_init__(self) -> None:
        if self.invalid_action_penalty > 0:
            raise ConfigError(
                f"EnvConfig.invalid_action_penalty must be <= 0 (it is a penalty), got {self.invalid_action_penalty}"
            )
        if self.max_retries < 0:
            raise ConfigError(f"EnvConfig.max_retries must be >= 0, got {self.max_retries}")
        if self.on_retries_exhausted not in ("fallback", "forfeit"):
            raise ConfigError(
                f"EnvConfig.on_retries_exhausted must be 'fallback' or 'forfeit', got {self.on_retries_exhausted!r}"
            )
        _positive("EnvConfig", "max_observation_chars", self.max_observation_chars)
        _positive("EnvConfig", "max_action_chars", self.max_action_chars)


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the episode coordinator drives episodes."""

    max_concurrent_episodes: int = 64
    """Episodes in flight at once."""
    policy_timeout_s: float = 60.0
    """A policy call that takes longer counts as an invalid (empty) action."""
    max_steps_per_episode: int = 10_000
    """Env steps after which an episode is aborted (guards against envs that never end)."""
    keep_history: bool = True
    """Pass each agent's earlier turns to the policy (``PolicyInput.history``)."""
    open_wait_s: float = 300.0
    """How long an episode keeps trying to open while the env server refuses (``EnvBusy``:
    ``max_episodes`` open) before it is recorded as aborted."""
    open_backoff_cap_s: float = 5.0
    """The longest wait between two tries of a refused open (exponential back-off, full jitter)."""

    def __post_init__(self) -> None:
        _positive("CoordinatorConfig", "max_concurrent_episodes", self.max_concurrent_episodes)
        _positive("CoordinatorConfig", "open_wait_s", self.open_wait_s)
        _positive("CoordinatorConfig", "open_backoff_cap_s", self.open_backoff_cap_s)
        _positive("CoordinatorConfig", "policy_timeout_s", self.policy_timeout_s)
        _positive("CoordinatorConfig", "max_steps_per_episode", self.max_steps_per_episode)


@dataclass(frozen=True)
class RemoteEnvConfig:
    """The client side of a remote env."""

    request_timeout_s: float = 30.0
    """A request with no reply in this time raises ``RequestTimeout`` (the server may be dead)."""

    def __post_init__(self) -> None:
        _positive("RemoteEnvConfig", "request_timeout_s", self.request_timeout_s)


@dataclass(frozen=True)
class EnvServerConfig:
    """The server side of remote envs."""

    max_episodes: int = 1024
    """Open episodes at once; ``open`` beyond this gets an error reply."""
    step_timeout_s: float = 30.0
    """A reset or step that runs longer aborts its episode with an error reply."""
    max_observation_bytes: int = 64 * 1024
    """Largest encoded observation (text plus legal moves) per agent; a larger one aborts the episode."""
    max_action_bytes: int = 16 * 1024
    """Largest action text accepted in a step request."""
    idle_episode_s: float = 600.0
    """Episodes untouched this long are closed (clients that vanished)."""

    def __post_init__(self) -> None:
        for name in ("max_episodes", "step_timeout_s", "max_observation_bytes", "max_action_bytes", "idle_episode_s"):
            _positive("EnvServerConfig", name, getattr(self, name))


__all__ = ["CoordinatorConfig", "EnvConfig", "EnvServerConfig", "RemoteEnvConfig"]
