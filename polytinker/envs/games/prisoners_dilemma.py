"""Iterated prisoner's dilemma: two players move at once (a PettingZoo ``ParallelEnv``).

Each round both answer ``cooperate`` or ``defect``. Payoffs per round (mine, theirs):
both cooperate 3/3, both defect 1/1, I defect and they cooperate 5/0. ``rounds`` rounds.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextParallelEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID, PolicyInput
from polytinker.errors import ConfigError

PAYOFF = {
    ("cooperate", "cooperate"): 3.0,
    ("cooperate", "defect"): 0.0,
    ("defect", "cooperate"): 5.0,
    ("defect", "defect"): 1.0,
}


class TitForTat(ScriptedPolicy):
    """Cooperate first, then copy the other player's last move."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        history = view["history"]
        return history[-1][1] if history else "cooperate"


class PrisonersDilemmaEnv(TextParallelEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "prisoners_dilemma_v0", "render_modes": ["ansi"]}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy, "heuristic": TitForTat}

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None, rounds: int = 5) -> None:
        if rounds < 1:
            raise ConfigError(f"prisoners_dilemma: rounds must be >= 1, got {rounds}")
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self.rounds = rounds
        self.history: list[tuple[str, str]] = []  # (player_0's move, player_1's move)

    def instructions(self, agent: AgentID) -> str:
        return (
            f"You play {self.rounds} rounds of the prisoner's dilemma against another player. Each round you "
            "both choose at the same time: cooperate or defect. Points per round: both cooperate 3 each; both "
            "defect 1 each; if you defect while the other cooperates you get 5 and they get 0 (and the reverse). "
            "Score as many points as you can. Answer with one word: cooperate or defect."
        )

    def _new_game(self) -> None:
        self.history = []

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return () if self._is_over() else ("cooperate", "defect")

    def _resolve(self, moves: dict[AgentID, Any]) -> dict[AgentID, float]:
        a, b = (str(moves[p]) for p in self.possible_agents)
        self.history.append((a, b))
        return {self.possible_agents[0]: PAYOFF[(a, b)], self.possible_agents[1]: PAYOFF[(b, a)]}

    def _is_over(self) -> bool:
        return len(self.history) >= self.rounds

    def _mine_theirs(self, agent: AgentID) -> list[tuple[str, str]]:
        first = agent == self.possible_agents[0]
        return [(a, b) if first else (b, a) for a, b in self.history]

    def _render(self, agent: AgentID) -> str:
        lines = []
        total = 0.0
        for i, (mine, theirs) in enumerate(self._mine_theirs(agent)):
            total += PAYOFF[(mine, theirs)]
            lines.append(f"Round {i + 1}: you {mine}, they {theirs} (+{PAYOFF[(mine, theirs)]:g})")
        lines.append(f"Your score: {total:g}.")
        if self._is_over():
            lines.append("Game over.")
        else:
            lines.append(f"Round {len(self.history) + 1} of {self.rounds}: cooperate or defect?")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {"history": [list(p) for p in self._mine_theirs(agent)], "rounds": self.rounds}
