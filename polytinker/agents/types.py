"""Vocabulary of the agents subsystem.

- ``AgentName``: the name of a learning (or frozen) agent; one LoRA adapter per trainable agent.
- ``AlgorithmName``: ``grpo``, ``ppo``, ``reinforce`` (RL) and ``sft`` (supervised).
- ``MappingKind``: how env agent ids map to agents: ``independent``, ``self_play``, ``league``,
  ``round_robin``.
- ``SlotKind``: what plays one env role in one episode: a ``learner`` (the agent's current
  adapter), a ``past`` version of it (league play), a ``frozen`` agent, or a ``scripted`` opponent.
- ``LoopMode``: ``sync`` (sample, then train) or ``async`` (sample step k+1 while step k trains).
- ``Slot``: one role's assignment in one episode.
- ``TurnSample``: one sampled decision of a model-played role, as the learner needs it: the prompt
  and completion tokens, the sampling logprobs, the reward, and the group it belongs to.
- ``StepRecord``: the metrics of one training step, as written to ``metrics.jsonl``.

Shapes in names: ``_T`` is per token, ``_G`` per member of a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

AgentName = str


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    PPO = "ppo"
    REINFORCE = "reinforce"
    SFT = "sft"


class MappingKind(StrEnum):
    INDEPENDENT = "independent"  # each env role has its own agent (its own adapter)
    SELF_PLAY = "self_play"  # one agent plays every role; the role is named in its prompt
    LEAGUE = "league"  # one agent against its past versions and the frozen agents (or itself)
    ROUND_ROBIN = "round_robin"  # many agents in pairs, each step a new pairing (the circle method)


class SlotKind(StrEnum):
    LEARNER = "learner"
    PAST = "past"
    FROZEN = "frozen"
    SCRIPTED = "scripted"


class LoopMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class Slot:
    """Who plays one env role in one episode."""

    kind: SlotKind
    # The agent (LEARNER, PAST, FROZEN) or the scripted policy's kind ("random", "heuristic").
    name: str
    # The adapter version sampled from (PAST); None: the agent's latest version.
    version: int | None = None

    @property
    def trains(self) -> bool:
        """Only the current version of a trainable agent learns from its turns."""
        return self.kind is SlotKind.LEARNER


@dataclass(frozen=True)
class TurnSample:
    """One decision sampled from an agent's model, ready to become a training datum."""

    agent: AgentName
    role: str  # the env agent id it played
    version: int  # the adapter version that sampled it
    group: str  # samples with the same group key started from the same state (GRPO)
    episode_id: str
    turn_index: int  # position among the role's turns in the episode
    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]
    logprobs_T: tuple[float, ...]  # one per completion token, the sampling model's own
    reward: float  # this turn's own reward (until the role's next decision)
    episode_reward: float  # the role's total reward in the episode
    invalid: bool = False
    # Per completion token: True where the model sampled it, False for a tool result shown to
    # it (masked out of the loss); empty: all sampled (``ModelSample.sampled_T``).
    sampled_T: tuple[bool, ...] = ()

    @property
    def sampled_tokens(self) -> int:
        """How many completion tokens the model wrote (the ones the loss is taken on)."""
        return sum(self.sampled_T) if self.sampled_T else len(self.completion_tokens)


@dataclass(frozen=True)
class StepRecord:
    """One line of ``metrics.jsonl``."""

    step: int
    wall_s: float
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "wall_s": round(self.wall_s, 3), **self.metrics}


__all__ = [
    "AgentName",
    "AlgorithmName",
    "LoopMode",
    "MappingKind",
    "Slot",
    "SlotKind",
    "StepRecord",
    "TurnSample",
]
