"""A cooperative signalling game. The ``speaker`` sees a secret word among a few candidates; the
``listener`` sees only the candidates and the speaker's message, and must pick the secret.

The message is free text of at most ``max_message_chars`` characters and must not contain any
candidate word (a clue, not the answer). Both agents get +1 when the listener picks the secret,
0 otherwise. Agents: ``speaker_0`` and ``listener_0``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

# Word -> a clue the scripted speaker gives; the scripted listener inverts it.
CLUES = {
    "dog": "barks",
    "cat": "purrs",
    "cow": "moos",
    "owl": "hoots",
    "bee": "buzzes",
    "snake": "hisses",
    "lion": "roars",
    "horse": "neighs",
    "frog": "croaks",
    "duck": "quacks",
    "wolf": "howls",
    "sheep": "bleats",
}


class SignalRandom(ScriptedPolicy):
    """Speaker: a random animal sound (often the wrong one); listener: a random candidate."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if view["role"] == "speaker":
            return f"it {self.rng.choice(sorted(CLUES.values()))}"
        return self.rng.choice(view["candidates"])


class SignalHeuristic(ScriptedPolicy):
    """Speaker: the secret's sound; listener: the candidate whose sound the message names."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if view["role"] == "speaker":
            return f"it {CLUES[view['secret']]}"
        for word in view["candidates"]:
            if CLUES[word] in view.get("message", ""):
                return word
        return self.rng.choice(view["candidates"])


class SignalEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "signal_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": SignalRandom, "heuristic": SignalHeuristic}

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        num_candidates: int = 4,
        max_message_chars: int = 80,
    ) -> None:
        if not 2 <= num_candidates <= len(CLUES):
            raise ConfigError(f"signal: num_candidates must be in 2..{len(CLUES)}, got {num_candidates}")
        self.possible_agents = ["speaker_0", "listener_0"]
        super().__init__(config, render_mode)
        self.num_candidates = num_candidates
        self.max_message_chars = max_message_chars
        self.candidates: list[str] = []
        self.secret = ""
        self.message: str | None = None
        self.guess: str | None = None

    def instructions(self, agent: AgentID) -> str:
        if agent == "speaker_0":
            return (
                "You are the speaker in a cooperative game. You see a secret word among a few candidate words; "
                "your partner sees only the candidates and your message, and must pick the secret. Write a short "
                f"clue (at most {self.max_message_chars} characters) that does not contain any candidate word. "
                "You both win if your partner picks the secret."
            )
        return (
            "You are the listener in a cooperative game. Your partner saw a secret word among the candidates "
            "and sent you a clue. Answer with the one candidate word you think is the secret. You both win if "
            "you pick it."
        )

    def _new_game(self) -> None:
        words = sorted(CLUES)
        picks = self._rng.choice(len(words), size=self.num_candidates, replace=False)
        self.candidates = [words[int(i)] for i in picks]
        self.secret = self.candidates[int(self._rng.integers(self.num_candidates))]
        self.message = None
        self.guess = None

    def _current_agent(self) -> AgentID:
        return "speaker_0" if self.message is None else "listener_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if self._is_over() or agent != self._current_agent() or agent == "speaker_0":
            return ()  # the speaker's message is free-form
        return tuple(self.candidates)

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        if agent == "listener_0":
            return super()._parse_move(agent, text)
        message = " ".join(text.split())
        if len(message) > self.max_message_chars:
            return InvalidAction(f"the clue is longer than {self.max_message_chars} characters")
        named = [w for w in self.candidates if re.search(rf"\b{w}", message, flags=re.IGNORECASE)]
        if named:
            return InvalidAction(f"the clue must not contain a candidate word ({', '.join(named)})")
        return message

    def fallback_move(self, agent: AgentID) -> Any:
        return "(no clue)" if agent == "speaker_0" else super().fallback_move(agent)

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        if agent == "speaker_0":
            self.message = str(move)
            return {}
        self.guess = str(move)
        reward = 1.0 if self.guess == self.secret else 0.0
        return dict.fromkeys(self.possible_agents, reward)

    def _is_over(self) -> bool:
        return self.guess is not None

    def _render(self, agent: AgentID) -> str:
        lines = [f"Candidates: {', '.join(self.candidates)}."]
        if agent == "speaker_0":
            lines.append(f"The secret word is: {self.secret}.")
        if self.message is not None:
            lines.append(f"Clue: {self.message}")
        if self.guess is not None:
            lines.append(
                f"The listener picked {self.guess}; the secret was {self.secret}. "
                f"{'You both win.' if self.guess == self.secret else 'You both lose.'}"
            )
        elif agent == self._current_agent():
            lines.append("Write your clue." if agent == "speaker_0" else "Which candidate is the secret?")
        else:
            lines.append("Waiting for your partner.")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        view: dict[str, Any] = {"role": agent.split("_")[0], "candidates": list(self.candidates)}
        if agent == "speaker_0":
            view["secret"] = self.secret
        if self.message is not None:
            view["message"] = self.message
        return view
