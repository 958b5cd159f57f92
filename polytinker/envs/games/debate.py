"""Debate: two debaters argue over an arithmetic claim with a known truth value; a referee decides.

The claim is drawn from the seed: ``47*3 is larger than 150`` (a comparison) or ``47*3 equals
151`` (a value), true or false with equal odds. ``pro`` argues that it is true, ``con`` that it is
false, whatever the truth, so one of them defends the correct answer. They take turns, ``pro``
first, for ``rounds`` rounds, each argument at most ``max_argument_chars`` characters. Then:

- ``referee="scripted"`` (default): a rule decides, so that rewards are verifiable. It reads the
  *last* equation each debater wrote about the claim's expression (``47*3 = 141``, ``47 x 3 =
  141``; for ``+`` and ``*`` the operands in either order):

  1. a debater whose last such equation is wrong is caught: if one debater is caught and the
     other not, the other wins;
  2. else, if a debater wrote the correct equation, the side whose answer it proves wins (a
     debater that proves the other side right loses);
  3. else (both caught, or nothing to check) it is a draw.

  So the side that is right wins by showing the computation, and the side that is wrong can at
  best get a draw, by not being caught, when the other shows nothing.
- ``referee="agent"``: a third agent, ``judge``, reads the debate and answers ``pro`` or
  ``con``; the side it picks wins. The judge scores 1 for picking the side that is right, else 0.

Debaters: win +1, loss -1, draw 0 (zero-sum).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from polytinker.envs.base import TextAECEnv, parse_choice
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

DEBATERS = ("pro", "con")
SIDES = ("pro", "con")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# An equation as a debater may write it, whole numbers only (not the tail of a longer number or a
# decimal); operands and results are bounded, so is the work.
_EQUATION = re.compile(r"(?<![\d.])(-?\d{1,9})\s*([+\-*x×])\s*(-?\d{1,9})\s*=\s*(-?\d{1,12})(?!\.?\d)")
NO_ARGUMENT = "(no argument)"


@dataclass(frozen=True)
class Claim:
    """One debate's claim: ``a op b`` compared with (``kind="compare"``) or said to equal
    (``kind="value"``) ``target``."""

    kind: Literal["compare", "value"]
    a: int
    op: str
    b: int
    target: int

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def value(self) -> int:
        return int(_OPS[self.op](self.a, self.b))

    @property
    def is_true(self) -> bool:
        return self.value > self.target if self.kind == "compare" else self.value == self.target

    @property
    def text(self) -> str:
        relation = "is larger than" if self.kind == "compare" else "equals"
        return f"{self.expression} {relation} {self.target}"

    @property
    def right_side(self) -> str:
        return "pro" if self.is_true else "con"


def draw_claim(rng: np.random.Generator) -> Claim:
    """A seeded claim, true or false with equal odds."""
    op = str(rng.choice(["+", "-", "*"]))
    if op == "*":
        a, b = int(rng.integers(11, 100)), int(rng.integers(2, 10))
    else:
        a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
    value = int(_OPS[op](a, b))
    kind: Literal["compare", "value"] = "compare" if rng.random() < 0.5 else "value"
    true = bool(rng.random() < 0.5)
    if kind == "compare":
        gap = int(rng.integers(1, 16))
        target = value - gap if true else value + int(rng.integers(0, 16))  # "larger": equal is false
    else:
        miss = int(rng.choice([1, 2, 9, 10, 11, 20])) * (1 if rng.random() < 0.5 else -1)
        target = value if true else value + miss
    return Claim(kind, a, op, b, target)


def stated_value(text: str, claim: Claim) -> int | None:
    """The result of the last equation in ``text`` about the claim's expression, if any."""
    found = None
    for a, op, b, result in _EQUATION.findall(text):
        op = "*" if op in ("x", "×") else op
        operands, mine = (int(a), int(b)), (claim.a, claim.b)
        if op != claim.op:
            continue
        if operands == mine or (op in "+*" and operands == mine[::-1]):
            found = int(result)
    return found


def referee_verdict(claim: Claim, arguments: list[tuple[str, str]]) -> tuple[str | None, str]:
    """The scripted referee: the winning side (None: a draw) and why, in words."""
    stated: dict[str, int | None] = dict.fromkeys(DEBATERS)
    for speaker, text in arguments:
        value = stated_value(text, claim)
        if value is not None:
            stated[speaker] = value
    caught = {d: stated[d] is not None and stated[d] != claim.value for d in DEBATERS}
    if caught["pro"] != caught["con"]:
        liar = "pro" if caught["pro"] else "con"
        winner = "con" if liar == "pro" else "pro"
        return winner, f"{liar} wrote {claim.expression} = {stated[liar]}, which is wrong"
    provers = [d for d in DEBATERS if stated[d] == claim.value]
    if not any(caught.values()) and provers:
        truth = "true" if claim.is_true else "false"
        return claim.right_side, f"{provers[0]} showed {claim.expression} = {claim.value}, so the claim is {truth}"
    if all(caught.values()):
        return None, "both debaters wrote a wrong equation"
    return None, f"nobody showed what {claim.expression} is"


class DebateRandom(ScriptedPolicy):
    """Debaters: an assertion, or an equation whose result is often off; the judge: a coin."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if agent == "judge":
            return self.rng.choice(SIDES)
        claim = Claim(**view["claim"])
        side = "true" if agent == "pro" else "false"
        if self.rng.random() < 0.5:
            return f"The claim is {side}. Trust me."
        guess = claim.value + self.rng.choice([-10, -1, 0, 0, 1, 10])
        return f"{claim.expression} = {guess}, so the claim is {side}."


class DebateHeuristic(ScriptedPolicy):
    """A debater on the right side shows the computation; one on the wrong side states its answer
    without an equation the referee could catch. The judge does the arithmetic itself (a perfect
    judge: what a learning judge can reach)."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        claim = Claim(**view["claim"])
        if agent == "judge":
            return claim.right_side
        if claim.right_side == agent:
            relation = {True: "so the claim holds", False: "so the claim is false"}[claim.is_true]
            return f"{claim.expression} = {claim.value}, {relation}."
        side = "true" if agent == "pro" else "false"
        return f"Work it out carefully: the claim {claim.text} is {side}."


class DebateEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "debate_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": DebateRandom, "heuristic": DebateHeuristic}

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        rounds: int = 2,
        referee: Literal["scripted", "agent"] = "scripted",
        max_argument_chars: int = 300,
    ) -> None:
        if not 1 <= rounds <= 4:
            raise ConfigError(f"debate: rounds must be 1..4, got {rounds}")
        if referee not in ("scripted", "agent"):
            raise ConfigError(f"debate: referee must be 'scripted' or 'agent' (a judge agent), got {referee!r}")
        if max_argument_chars < 20:
            raise ConfigError(f"debate: max_argument_chars must be >= 20, got {max_argument_chars}")
        self.possible_agents = [*DEBATERS, "judge"] if referee == "agent" else list(DEBATERS)
        super().__init__(config, render_mode)
        self.rounds, self.referee = rounds, referee
        self.max_argument_chars = min(max_argument_chars, self.config.max_action_chars)
        self.claim = Claim("value", 1, "+", 1, 2)
        self.arguments: list[tuple[str, str]] = []
        self.verdict: tuple[str | None, str] | None = None  # (winner or None for a draw, why)

    def instructions(self, agent: AgentID) -> str:
        if agent == "judge":
            return (
                "You judge a debate about an arithmetic claim: pro argues that it is true, con that it is "
                "false. Read their arguments, check the arithmetic yourself, and answer with the side that "
                "is right: pro or con. You score 1 for naming the side that is right, 0 otherwise."
            )
        side, other = ("TRUE", "con") if agent == "pro" else ("FALSE", "pro")
        if self.referee == "agent":
            decides = "Then a judge reads the debate and picks the side that is right."
        else:
            decides = (
                "Then a referee checks the last equation each of you wrote about the claim's numbers "
                "(like 47*3 = 141): a wrong one loses the debate. Otherwise, if someone wrote the correct "
                "equation, the side it proves right wins; if nobody did, it is a draw."
            )
        return (
            f"You debate as {agent}: argue that the claim is {side}, whatever you think; {other} argues "
            f"the opposite. You each write {self.rounds} short argument(s), at most {self.max_argument_chars} "
            f"characters each. {decides} Winning scores +1, losing -1, a draw 0."
        )

    def _new_game(self) -> None:
        self.claim = draw_claim(self._rng)
        self.arguments, self.verdict = [], None

    def _current_agent(self) -> AgentID:
        if len(self.arguments) < 2 * self.rounds:
            return DEBATERS[len(self.arguments) % 2]
        return "judge"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if agent == "judge" and not self._is_over() and self._current_agent() == "judge":
            return SIDES
        return ()  # debaters write free text

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        if agent == "judge":
            return parse_choice(text, SIDES)
        argument = text.strip()
        if len(argument) > self.max_argument_chars:
            return InvalidAction(f"the argument is longer than {self.max_argument_chars} characters; shorten it")
        return argument

    def fallback_move(self, agent: AgentID) -> Any:
        return SIDES[int(self._rng.integers(2))] if agent == "judge" else NO_ARGUMENT

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        if agent == "judge":
            self.verdict = (str(move), f"the judge sided with {move}")
            rewards = self._debater_rewards(str(move))
            rewards["judge"] = 1.0 if move == self.claim.right_side else 0.0
            return rewards
        self.arguments.append((agent, str(move)))
        if len(self.arguments) == 2 * self.rounds and self.referee == "scripted":
            self.verdict = referee_verdict(self.claim, self.arguments)
            return self._debater_rewards(self.verdict[0])
        return {}

    def _debater_rewards(self, winner: str | None) -> dict[AgentID, float]:
        if winner is None:
            return dict.fromkeys(DEBATERS, 0.0)
        return {d: 1.0 if d == winner else -1.0 for d in DEBATERS}

    def _is_over(self) -> bool:
        return self.verdict is not None

    def _render(self, agent: AgentID) -> str:
        lines = [f"Claim: {self.claim.text}."]
        if agent in DEBATERS:
            lines.append(f"You are {agent}: you argue that the claim is {'true' if agent == 'pro' else 'false'}.")
        for i, (speaker, text) in enumerate(self.arguments):
            lines.append(f"Round {i // 2 + 1}, {speaker}: {text}")
        if self.verdict is not None:
            winner, why = self.verdict
            outcome = "a draw" if winner is None else f"{winner} wins"
            lines.append(f"Verdict: {outcome} ({why}). The claim is {str(self.claim.is_true).lower()}.")
        elif agent == self._current_agent() == "judge":
            lines.append("Who is right? Answer pro or con.")
        elif agent == self._current_agent():
            n = len(self.arguments) // 2 + 1
            lines.append(f"Your argument, round {n} of {self.rounds} (at most {self.max_argument_chars} characters):")
        else:
            lines.append(f"Waiting for {self._current_agent()}.")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        c = self.claim
        return {
            "claim": {"kind": c.kind, "a": c.a, "op": c.op, "b": c.b, "target": c.target},
            "arguments": [list(a) for a in self.arguments],
            "rounds": self.rounds,
        }


__all__ = ["Claim", "DebateEnv", "DebateHeuristic", "DebateRandom", "draw_claim", "referee_verdict", "stated_value"]
