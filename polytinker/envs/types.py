"""Vocabulary of the environments subsystem.

- ``AgentID``: the name of an agent in an env (``player_0``), as in PettingZoo.
- ``EnvKind``: ``"aec"`` (turn-taking, PettingZoo ``AECEnv``) or ``"parallel"`` (``ParallelEnv``).
- ``TextObservation``: what one agent sees: text, plus the legal moves, whose turn it is and the
  agent's info dict (structured, agent-visible state such as ``view``; invalid-action feedback).
- ``InvalidAction``: what ``parse_action`` returns when the text names no legal move, with the reason.
- ``ModelSample``: what a model policy sampled for one decision: the agent and adapter version,
  the prompt tokens, the completion tokens and their logprobs (what training needs of the turn).
- ``AgentAction``: a policy's answer: the action text, the ``ModelSample`` when a model answered,
  and free-form ``meta``; the coordinator stores both untouched in the trajectory.
- ``PolicyInput``: everything a policy needs to build a chat prompt for one decision.
- ``Turn`` / ``Trajectory``: one agent's decisions in one episode and what they earned.
- ``EpisodeResult``: the outcome of one episode driven by the coordinator.
- ``EnvBusy`` lives in ``polytinker.errors`` (re-exported from ``polytinker.envs``): an env source
  (a remote env server at ``max_episodes``) refuses a new episode for now; the coordinator waits
  and opens it again.

Observations on the PettingZoo side are dicts ``{"text", "legal_moves", "current_player"}``
(see ``polytinker.envs.base``); ``TextObservation.from_raw`` turns one into the typed form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

AgentID = str
EnvKind = Literal["aec", "parallel"]


@dataclass(frozen=True)
class TextObservation:
    """One agent's observation, typed."""

    text: str
    # Canonical spellings of the moves the agent may play now; empty for free-form actions
    # (messages, offers) or when it is not this agent's turn.
    legal_moves: tuple[str, ...] = ()
    # The agent whose turn it is (AEC envs); "" in parallel envs, where everyone moves at once.
    current_player: AgentID = ""
    # The agent's info dict from the env: ``view`` (agent-visible structured state, what the
    # scripted opponents read), ``invalid_action`` (why the last action was refused), ...
    info: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_raw(cls, raw: Any, info: Mapping[str, Any] | None = None) -> TextObservation:
        """Build from a PettingZoo observation of a text env (a dict) or a bare string."""
        if isinstance(raw, str):
            return cls(text=raw, info=dict(info or {}))
        if not isinstance(raw, Mapping) or "text" not in raw:
            raise TypeError(f"not a text observation: {type(raw).__name__}; expected a dict with 'text'")
        return cls(
            text=str(raw["text"]),
            legal_moves=tuple(raw.get("legal_moves", ())),
            current_player=str(raw.get("current_player", "")),
            info=dict(info or {}),
        )


@dataclass(frozen=True)
class InvalidAction:
    """Returned by ``parse_action`` when action text is not a legal move; ``reason`` says why,
    in words the acting agent is shown."""

    reason: str

    def __bool__(self) -> bool:
        # So that ``if not (move := env.parse_action(...))`` reads naturally.
        return False


@dataclass(frozen=True)
class ModelSample:
    """What a model policy sampled for one decision; the coordinator keeps it in the ``Turn``
    and the training loop turns it into a training sample (``polytinker.agents.TurnSample``)."""

    agent: str  # the agent (adapter) whose model answered
    version: int  # the adapter version that sampled it
    prompt_tokens: tuple[int, ...]
    # Everything after the prompt: the tokens the model sampled and, when it called tools during
    # the turn, the tool results (and chat markup) shown to it between them.
    completion_tokens: tuple[int, ...]
    logprobs_T: tuple[float, ...]  # one per completion token, the sampling model's own (0.0 where shown)
    # One per completion token: True where the model sampled it, False where it was shown (a tool
    # result). Empty: every completion token was sampled (a turn with no tool call).
    sampled_T: tuple[bool, ...] = ()


@dataclass(frozen=True)
class AgentAction:
    """A policy's answer. A plain ``str`` from a policy means ``AgentAction(text)``."""

    text: str
    # Opaque to the coordinator, kept in the Turn: whatever the policy wants to find there again.
    meta: Mapping[str, Any] = field(default_factory=dict)
    # What the model sampled, when a model answered (None: a scripted policy, a plain string).
    sample: ModelSample | None = None


@dataclass(frozen=True)
class Turn:
    """One decision of one agent, and what followed it until the agent's next decision."""

    observation: TextObservation
    # The text sent to the env ("" when the policy timed out).
    action: str
    # Reward the agent received from this action until its next decision (or the episode's end),
    # invalid-action penalties included.
    reward: float = 0.0
    # Why the env refused the action, or None when it was legal.
    invalid_reason: str | None = None
    timed_out: bool = False
    # Seconds the policy took to answer.
    latency_s: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)
    # The policy's ``AgentAction.sample``; None when no model answered (scripted, timed out).
    sample: ModelSample | None = None


@dataclass(frozen=True)
class Trajectory:
    """All the turns of one agent in one episode."""

    agent: AgentID
    turns: tuple[Turn, ...]
    # Sum of every reward the agent received, including any that came after its last turn.
    total_reward: float
    terminated: bool
    truncated: bool


@dataclass(frozen=True)
class PolicyInput:
    """What a policy receives for one decision: enough to build a chat prompt.

    ``history`` holds this agent's earlier turns in the episode (its own observations and
    actions, never another agent's private information); ``to_messages()`` renders the usual
    system / user / assistant chat list from it.
    """

    agent: AgentID
    episode_id: str
    env_id: str
    # The agent's system prompt: the rules, its role, and the answer format.
    instructions: str
    observation: TextObservation
    history: tuple[Turn, ...] = ()
    # How many times in a row this agent's action was just refused (0 on a fresh decision).
    retry: int = 0
    # The episode's seed (None when unseeded): lets scripted policies draw per-episode randomness,
    # so that concurrent episodes repeat exactly whatever order they interleave in.
    seed: int | None = None
    # Names of the tools the agent may call before it answers (``env.tools(agent)``).
    tools: tuple[str, ...] = ()

    def to_messages(self) -> list[dict[str, str]]:
        """``[{"role": "system", ...}, {"role": "user", obs0}, {"role": "assistant", act0}, ...,
        {"role": "user", current obs}]``."""
        messages = [{"role": "system", "content": self.instructions}]
        for turn in self.history:
            messages.append({"role": "user", "content": turn.observation.text})
            messages.append({"role": "assistant", "content": turn.action})
        messages.append({"role": "user", "content": self.observation.text})
        return messages


@dataclass(frozen=True)
class EpisodeResult:
    """The outcome of one episode."""

    episode_id: str
    env_id: str
    seed: int | None
    trajectories: Mapping[AgentID, Trajectory]
    # Environment steps taken (AEC: one per agent turn; parallel: one per round).
    num_steps: int
    wall_s: float
    # Why the episode was cut short (env error, step limit), or None when it ended normally.
    aborted: str | None = None

    @property
    def total_rewards(self) -> dict[AgentID, float]:
        return {agent: t.total_reward for agent, t in self.trajectories.items()}


__all__ = [
    "AgentAction",
    "AgentID",
    "EnvKind",
    "EpisodeResult",
    "InvalidAction",
    "ModelSample",
    "PolicyInput",
    "TextObservation",
    "Trajectory",
    "Turn",
]
