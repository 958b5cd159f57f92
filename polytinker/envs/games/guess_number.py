"""Guess the number: a single-agent task through the same multi-agent API (one agent,
``player_0``). The secret is drawn from the seed in 1..``high``; after each guess the agent
learns "higher" or "lower". Reward: 1 for finding it within ``max_guesses``, else 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError


class GuessRandom(ScriptedPolicy):
    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        return str(self.rng.randint(1, view["high"]))


class GuessBisect(ScriptedPolicy):
    """Binary search over what is still possible."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        return str((view["low"] + view["possible_high"]) // 2)


class GuessNumberEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {
        "name": "guess_number_v0",
        "render_modes": ["ansi"],
        "is_parallelizable": False,
    }
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": GuessRandom, "heuristic": GuessBisect}

    def __init__(
        self, config: EnvConfig | None = None, render_mode: str | None = None, high: int = 100, max_guesses: int = 7
    ) -> None:
        if high < 2 or max_guesses < 1:
            raise ConfigError(f"guess_number: need high >= 2 and max_guesses >= 1, got {high}, {max_guesses}")
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self.high, self.max_guesses = high, max_guesses
        self.secret = 1
        self.guesses: list[int] = []

    def instructions(self, agent: AgentID) -> str:
        return (
            f"Find a secret whole number between 1 and {self.high} in at most {self.max_guesses} guesses. After "
            "each guess you are told whether the secret is higher or lower. Answer with one number."
        )

    def _new_game(self) -> None:
        self.secret = int(self._rng.integers(1, self.high + 1))
        self.guesses = []

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return () if self._is_over() else tuple(str(i) for i in range(1, self.high + 1))

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        words = [w.strip(".,!?:;()") for w in text.split()]
        numbers = [w for w in words if w.isascii() and w.isdigit()]  # '²'.isdigit() is True
        if not numbers:
            return InvalidAction(f"answer with a whole number between 1 and {self.high}")
        value = int(numbers[-1])
        if not 1 <= value <= self.high:
            return InvalidAction(f"{value} is outside 1..{self.high}")
        return value

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.guesses.append(int(move))
        return {agent: 1.0} if move == self.secret else {}

    def _is_over(self) -> bool:
        return (bool(self.guesses) and self.guesses[-1] == self.secret) or len(self.guesses) >= self.max_guesses

    def _bounds(self) -> tuple[int, int]:
        low, high = 1, self.high
        for g in self.guesses:
            if g < self.secret:
                low = max(low, g + 1)
            elif g > self.secret:
                high = min(high, g - 1)
        return low, high

    def _render(self, agent: AgentID) -> str:
        lines = [
            f"{g}: {'higher' if g < self.secret else 'lower' if g > self.secret else 'correct!'}" for g in self.guesses
        ]
        if self.guesses and self.guesses[-1] == self.secret:
            lines.append(f"Found in {len(self.guesses)} guesses.")
        elif self._is_over():
            lines.append(f"Out of guesses; the number was {self.secret}.")
        else:
            lines.append(f"Guess {len(self.guesses) + 1} of {self.max_guesses} (1..{self.high}):")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        low, high = self._bounds()
        return {"low": low, "possible_high": high, "high": self.high, "guesses": list(self.guesses)}
