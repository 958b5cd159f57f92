"""Negotiation ("deal or no deal"): two players divide a pool of books, hats and balls.

Each player has private values per item (each player's whole pool is worth 10 to it). Players
alternate, ``player_0`` first, for at most ``max_turns`` turns. A move is one of:

- ``propose books=B hats=H balls=L``: the counts *I* take; the rest go to the other player;
- ``accept``: take the other player's last proposal (ends the game with a deal);
- ``walk away``: no deal.

With a deal each player's reward is the value of its share divided by 10 (0..1); with no deal
(walk away, or turns run out) both get 0.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

ITEMS = ("books", "hats", "balls")
TOTAL_VALUE = 10


def _offer_text(take: dict[str, int]) -> str:
    return "propose " + " ".join(f"{k}={take[k]}" for k in ITEMS)


def _value(take: dict[str, int], values: dict[str, int]) -> int:
    return sum(take[k] * values[k] for k in ITEMS)


class NegotiationRandom(ScriptedPolicy):
    """Accepts a third of the time when it can, else proposes a random split."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if view.get("offer_to_me") is not None and self.rng.random() < 1 / 3:
            return "accept"
        return _offer_text({k: self.rng.randint(0, view["counts"][k]) for k in ITEMS})


class NegotiationHeuristic(ScriptedPolicy):
    """Asks for the items it values most; accepts an offer worth at least half its pool
    (any positive offer on the last turn)."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        values, counts = view["my_values"], view["counts"]
        offer = view.get("offer_to_me")
        if offer is not None:
            worth = _value(offer, values)
            last = view["turn"] >= view["max_turns"] - 1
            if worth * 2 >= TOTAL_VALUE or (last and worth > 0):
                return "accept"
        # Take every item worth more than average per unit; give the rest away.
        take = {k: (counts[k] if values[k] * sum(counts.values()) >= TOTAL_VALUE else 0) for k in ITEMS}
        if _value(take, values) == 0:
            take = dict(counts)
        return _offer_text(take)


class NegotiationEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {
        "name": "negotiation_v0",
        "render_modes": ["ansi"],
        "is_parallelizable": False,
    }
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {
        "random": NegotiationRandom,
        "heuristic": NegotiationHeuristic,
    }

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None, max_turns: int = 6) -> None:
        if max_turns < 2:
            raise ConfigError(f"negotiation: max_turns must be >= 2, got {max_turns}")
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self.max_turns = max_turns
        self.counts: dict[str, int] = {}
        self.values: dict[AgentID, dict[str, int]] = {}
        self.log: list[tuple[AgentID, str]] = []
        self.offer: tuple[AgentID, dict[str, int]] | None = None  # (proposer, what the proposer takes)
        self.outcome: str | None = None

    def instructions(self, agent: AgentID) -> str:
        return (
            f"You negotiate with another player over a pool of books, hats and balls. You know only your own "
            f"value per item; the whole pool is worth {TOTAL_VALUE} points to each of you. Players take turns "
            f"(at most {self.max_turns} turns in all). On your turn answer with exactly one of: "
            "'propose books=B hats=H balls=L' (the counts you take; the rest go to the other player), "
            "'accept' (take the other player's last proposal), or 'walk away' (no deal). With a deal you score "
            "the value of your share; with no deal, or when turns run out, both score 0."
        )

    def _new_game(self) -> None:
        while True:  # redraw the pool until both players can value it at exactly TOTAL_VALUE
            counts = {k: int(self._rng.integers(1, 4)) for k in ITEMS}
            drawn = [self._split_values(counts) for _ in self.possible_agents]
            if all(v is not None for v in drawn):
                break
        self.counts = counts
        self.values = {a: v for a, v in zip(self.possible_agents, drawn, strict=True) if v is not None}
        self.log, self.offer, self.outcome = [], None, None

    def _split_values(self, counts: dict[str, int]) -> dict[str, int] | None:
        """Random integer values per item such that the pool is worth TOTAL_VALUE."""
        for _ in range(200):
            vals = {k: int(self._rng.integers(0, TOTAL_VALUE + 1)) for k in ITEMS[:-1]}
            rest = TOTAL_VALUE - sum(vals[k] * counts[k] for k in ITEMS[:-1])
            if rest >= 0 and rest % counts[ITEMS[-1]] == 0:
                vals[ITEMS[-1]] = rest // counts[ITEMS[-1]]
                return vals
        return None

    def _current_agent(self) -> AgentID:
        return self.possible_agents[len(self.log) % 2]

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if self._is_over() or agent != self._current_agent():
            return ()
        fixed = ("accept", "walk away") if self.offer is not None else ("walk away",)
        return (*fixed, _offer_text(self.counts))  # one example proposal; any valid split is legal

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        lowered = text.strip().lower()
        if re.search(r"\bpropose\b", lowered):
            take = {}
            for k in ITEMS:
                m = re.search(rf"\b{k}\s*=\s*(\d+)", lowered)
                if m is None:
                    return InvalidAction(f"a proposal must give a count for {k}, e.g. {_offer_text(self.counts)}")
                take[k] = int(m.group(1))
                if take[k] > self.counts[k]:
                    return InvalidAction(f"there are only {self.counts[k]} {k}")
            return ("propose", take)
        if re.search(r"\bwalk away\b", lowered):
            return ("walk away", None)
        if re.search(r"\baccept\b", lowered):
            if self.offer is None:
                return InvalidAction("there is no proposal to accept yet")
            return ("accept", None)
        return InvalidAction("answer 'propose books=B hats=H balls=L', 'accept' or 'walk away'")

    def fallback_move(self, agent: AgentID) -> Any:
        return ("walk away", None)

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        kind, take = move
        self.log.append((agent, _offer_text(take) if kind == "propose" else kind))
        if kind == "propose":
            self.offer = (agent, take)
        elif kind == "walk away":
            self.outcome = "no deal"
        else:
            assert self.offer is not None
            proposer, proposer_take = self.offer
            shares = {proposer: proposer_take, agent: {k: self.counts[k] - proposer_take[k] for k in ITEMS}}
            self.outcome = "deal"
            return {a: _value(shares[a], self.values[a]) / TOTAL_VALUE for a in self.possible_agents}
        if len(self.log) >= self.max_turns and self.outcome is None:
            self.outcome = "no deal (out of turns)"
        return {}

    def _is_over(self) -> bool:
        return self.outcome is not None

    def _offer_to(self, agent: AgentID) -> dict[str, int] | None:
        if self.offer is None or self.offer[0] == agent:
            return None
        return {k: self.counts[k] - self.offer[1][k] for k in ITEMS}

    def _render(self, agent: AgentID) -> str:
        pool = ", ".join(f"{self.counts[k]} {k}" for k in ITEMS)
        worth = ", ".join(f"{k} {self.values[agent][k]}" for k in ITEMS)
        lines = [f"Pool: {pool}. Your values per item: {worth}."]
        for who, what in self.log:
            lines.append(f"{'You' if who == agent else 'Other'}: {what}")
        if self.outcome is not None:
            lines.append(f"Game over: {self.outcome}.")
        elif agent == self._current_agent():
            offer = self._offer_to(agent)
            if offer is not None:
                lines.append(f"Accepting gives you {offer} worth {_value(offer, self.values[agent])} to you.")
            lines.append(f"Turn {len(self.log) + 1} of {self.max_turns}: propose, accept or walk away.")
        else:
            lines.append("Waiting for the other player.")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "my_values": dict(self.values.get(agent, {})),
            "offer_to_me": self._offer_to(agent),
            "turn": len(self.log),
            "max_turns": self.max_turns,
        }
