"""Scripted policies: the opponents for evaluation and for ``polytinker env play``.

A scripted policy is a plain (synchronous) callable with the coordinator's policy signature,
``policy(agent_id, PolicyInput) -> str``; the coordinator accepts it as is. It reads only what
the agent may see: the observation text, its legal moves and ``info["view"]``. Each built-in env
lists its policies in the class attribute ``scripted`` (``{"random": ..., "heuristic": ...}``).
"""

from __future__ import annotations

import random
from typing import Any

from polytinker.envs.types import AgentID, PolicyInput
from polytinker.errors import ConfigError


class ScriptedPolicy:
    """Base of scripted policies: seeded, so that evaluations repeat."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)

    def __call__(self, agent: AgentID, inp: PolicyInput) -> str:
        return self.move(agent, inp, turn=len(inp.history))

    def move(self, agent: AgentID, inp: PolicyInput, *, turn: int) -> str:
        """The policy's move, ``turn`` being the agent's earlier decisions in the episode: an env
        server, which keeps no history, plays the same moves as a local policy that has it."""
        if inp.seed is not None:
            # Randomness derived from the episode and the decision, not from a stream shared by
            # every episode: the same seeds give the same games however episodes interleave.
            key = f"{self.seed}/{inp.seed}/{agent}/{turn}/{inp.retry}/{inp.observation.text}"
            self.rng = random.Random(key)
        return self.act(agent, inp, inp.observation.info.get("view", {}))

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        raise NotImplementedError


class RandomPolicy(ScriptedPolicy):
    """Plays a uniformly random legal move."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        legal = inp.observation.legal_moves
        if not legal:
            raise ConfigError(f"RandomPolicy needs legal moves, and {agent} has none; the env must supply its own")
        return self.rng.choice(legal)


def scripted_policy(env: Any, kind: str, seed: int | None = None) -> ScriptedPolicy:
    """The env's scripted policy of ``kind`` (``"random"`` or ``"heuristic"``)."""
    table = getattr(env, "scripted", None) or {"random": RandomPolicy}
    if kind not in table:
        raise ConfigError(f"{type(env).__name__} has no scripted policy {kind!r}; it has: {', '.join(sorted(table))}")
    return table[kind](seed)


__all__ = ["RandomPolicy", "ScriptedPolicy", "scripted_policy"]
