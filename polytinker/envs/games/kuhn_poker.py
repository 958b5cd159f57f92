"""Kuhn poker: a three-card deck (J, Q, K), one card each, imperfect information.

Both players ante 1 chip. ``player_0`` acts first: ``check`` or ``bet`` (1 chip). Facing a bet,
a player may ``call`` or ``fold``; after a check, ``player_1`` may ``check`` (showdown) or ``bet``.
The reward is the chips won or lost (between -2 and +2). The deal is drawn from the seed.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID, PolicyInput

CARDS = ("J", "Q", "K")


class KuhnHeuristic(ScriptedPolicy):
    """A simple near-equilibrium strategy: bet or call with K; with Q check, call a bet a third of
    the time; with J bluff a third of the time and fold to a bet."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        card, legal = view["card"], inp.observation.legal_moves
        if "call" in legal:
            if card == "K" or (card == "Q" and self.rng.random() < 1 / 3):
                return "call"
            return "fold"
        if card == "K" or (card == "J" and self.rng.random() < 1 / 3):
            return "bet"
        return "check"


class KuhnPokerEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "kuhn_poker_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy, "heuristic": KuhnHeuristic}

    def __init__(self, config: Any = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self.cards: dict[AgentID, str] = {}
        self.history: list[str] = []
        self._result: dict[AgentID, float] | None = None

    def instructions(self, agent: AgentID) -> str:
        order = "first" if agent == self.possible_agents[0] else "second"
        return (
            f"You play Kuhn poker and act {order}. The deck has three cards: J < Q < K. Each player antes 1 "
            "chip and gets one card, seen only by its owner. Players may check or bet 1 chip; facing a bet "
            "they may call or fold. If nobody folds, the higher card wins the pot. Answer with one word: "
            "check, bet, call or fold (whichever is legal now)."
        )

    def _new_game(self) -> None:
        deal = self._rng.permutation(3)
        self.cards = {a: CARDS[int(deal[i])] for i, a in enumerate(self.possible_agents)}
        self.history = []
        self._result = None

    def _current_agent(self) -> AgentID:
        return self.possible_agents[len(self.history) % 2]

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if self._result is not None or agent != self._current_agent():
            return ()
        return ("call", "fold") if self.history and self.history[-1] == "bet" else ("check", "bet")

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.history.append(str(move))
        p0, p1 = self.possible_agents
        h = self.history
        if h[-1] == "fold":
            folder = agent
            self._result = {a: (-1.0 if a == folder else 1.0) for a in self.possible_agents}
        elif h == ["check", "check"] or h[-1] == "call":
            stake = 2.0 if h[-1] == "call" else 1.0
            high = p0 if CARDS.index(self.cards[p0]) > CARDS.index(self.cards[p1]) else p1
            self._result = {a: (stake if a == high else -stake) for a in self.possible_agents}
        return dict(self._result) if self._result is not None else {}

    def _is_over(self) -> bool:
        return self._result is not None

    def _render(self, agent: AgentID) -> str:
        lines = [f"Your card: {self.cards[agent]}."]
        names = {a: ("You" if a == agent else "Opponent") for a in self.possible_agents}
        for i, action in enumerate(self.history):
            lines.append(f"{names[self.possible_agents[i % 2]]}: {action}")
        if self._result is not None:
            other = next(a for a in self.possible_agents if a != agent)
            shown = "" if self.history[-1] == "fold" else f" Opponent's card: {self.cards[other]}."
            lines.append(
                f"Hand over.{shown} You {'won' if self._result[agent] > 0 else 'lost'} "
                f"{abs(self._result[agent]):g} chip(s)."
            )
        elif agent == self._current_agent():
            lines.append(f"Your move: {' or '.join(self.legal_moves(agent))}.")
        else:
            lines.append("Waiting for the opponent.")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {"card": self.cards.get(agent, ""), "history": list(self.history)}
