"""A solver and a verifier cooperate on an arithmetic problem (``solver_verifier-v0``): two roles
that two adapters of one base model can learn.

Turns: the ``solver`` answers the problem; the ``verifier`` sees the problem and that answer and
replies ``accept`` or ``reject: <critique>`` (the first of the two words it writes decides; the
text after ``reject`` is the critique), or a number without either word: its own answer, which
accepts the solver's when the two are equal and else rejects it with that number as the critique.
On a reject the solver sees the critique and revises, up to ``rounds`` times (default 1); the
episode ends on an accept or when the revisions run out.

Credit per role:

- solver: 1 if the final answer is right, else 0 (at the end). This is also the team's score:
  the team accuracy is the solver's mean reward.
- verifier: a decision is right when it accepts a right answer or rejects a wrong one.
  ``verifier_credit = "mean"`` (default): the share of its decisions that were right, at the end
  (so a needless reject of a right answer costs it); ``"sum"``: +1 at each right decision;
  ``"correction"``: as ``"mean"``, but a reject is right only when its critique states the right
  answer (its last number): a verifier paid for corrections the solver can use;
  ``"team"``: the team's score, as the solver's (a verifier then gains from critiques the solver
  can use, not only from right verdicts: with a solver right most of the time, accepting every
  answer already earns most of a decision-counting credit).

Scripted policies (``scripted``): ``heuristic`` (verifier: computes the answer and accepts only
a right one, else ``reject: N is too high/low``; solver: right the first time half the time, a
near miss otherwise, and right when it revises), ``lenient`` (verifier: accepts everything, so a
solver with a lenient verifier scores as the solver alone: the baseline a verifier must beat;
solver: as heuristic) and ``random`` (verifier: accept or reject at random; solver: a number
near the answer every time).

``verifier_tools`` (default none) names tools the verifier may call before its verdict, e.g.
``("calculator",)``: checking an answer with a calculator is easier than finding it without one,
which is what can make a verifier worth having for a solver that has none. The keyword arguments
besides ``rounds``, ``verifier_credit``, ``max_critique_chars`` and ``verifier_tools`` are
``MathTaskConfig``'s.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.games.math import ANSWER_FORMAT, NO_ANSWER, check_tools, near_guess, right_answer, tool_sentence
from polytinker.envs.games.math_tasks import MathProblem, MathTaskConfig, generate, parse_answer, solve
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

SOLVER, VERIFIER = "solver", "verifier"
DECISIONS = ("accept", "reject")
CREDITS = ("mean", "sum", "correction", "team")
_CREDIT_SENTENCES = {
    "correction": "You score for accepting right answers and rejecting wrong ones with the right answer.",
    "team": "You score when the solver's final answer is right.",
}
_DECISION_RE = re.compile(r"(?<![A-Za-z])(accept|reject)(?:s|ed)?(?![A-Za-z])", re.IGNORECASE)


def _shown(answer: int | None) -> str:
    return NO_ANSWER if answer is None else str(answer)


class SolverVerifierHeuristic(ScriptedPolicy):
    """Verifier: accepts a right answer, rejects a wrong one with its direction. Solver: right the
    first time half the time (a near miss otherwise), right when it revises."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if view["role"] == VERIFIER:
            return self.verify(view)
        if view["critiques"] or self.rng.random() < 0.5:
            return right_answer(view)
        value = solve(view["expression"]) or 0
        return str(value + self.rng.choice((-3, -2, -1, 1, 2, 3)))

    @staticmethod
    def verify(view: dict[str, Any]) -> str:
        value, answer = solve(view["expression"]), parse_answer(view["answer"])
        if answer is None or value is None:
            return "reject: there is no answer" if answer is None else "accept"
        if answer == value:
            return "accept"
        return f"reject: {answer} is too {'high' if answer > value else 'low'}"


class SolverVerifierLenient(SolverVerifierHeuristic):
    """Verifier: accepts every answer. Solver: as the heuristic one."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        return "accept" if view["role"] == VERIFIER else super().act(agent, inp, view)


class SolverVerifierRandom(ScriptedPolicy):
    """Verifier: accept or reject at random. Solver: a number near the answer each time."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        if view["role"] == VERIFIER:
            return self.rng.choice(("accept", "reject: I doubt it"))
        return near_guess(view, self.rng)


class SolverVerifierEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {
        "name": "solver_verifier_v0",
        "render_modes": ["ansi"],
        "is_parallelizable": False,
    }
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {
        "random": SolverVerifierRandom,
        "heuristic": SolverVerifierHeuristic,
        "lenient": SolverVerifierLenient,
    }

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        rounds: int = 1,
        verifier_credit: Literal["mean", "sum", "correction", "team"] = "mean",
        max_critique_chars: int = 200,
        verifier_tools: tuple[str, ...] | list[str] = (),
        **task: Any,
    ) -> None:
        if not 0 <= rounds <= 5:
            raise ConfigError(f"solver_verifier: rounds (revisions after a reject) must be in 0..5, got {rounds}")
        if verifier_credit not in CREDITS:
            raise ConfigError(f"solver_verifier: verifier_credit must be one of {CREDITS}, got {verifier_credit!r}")
        if not 0 <= max_critique_chars <= 1000:
            raise ConfigError(f"solver_verifier: max_critique_chars must be in 0..1000, got {max_critique_chars}")
        self.possible_agents = [SOLVER, VERIFIER]
        super().__init__(config, render_mode)
        self.task = MathTaskConfig.from_kwargs(task)
        self.rounds, self.verifier_credit, self.max_critique_chars = rounds, verifier_credit, max_critique_chars
        self.verifier_tools = check_tools(verifier_tools)
        self.problem = MathProblem("", "", 0)
        self.answers: list[int | None] = []
        self.decisions: list[tuple[bool, str]] = []  # (accepted, critique) per verifier turn

    def instructions(self, agent: AgentID) -> str:
        revise = f"up to {self.rounds} time{'s' if self.rounds != 1 else ''}"
        if agent == SOLVER:
            return (
                f"You solve an arithmetic problem; a verifier checks your answer. {ANSWER_FORMAT.capitalize()}. "
                f"If the verifier rejects it, you see why and revise it ({revise}). Your final answer is scored."
            )
        return (
            "You check a solver's answer to an arithmetic problem. Reply accept if it is right, or "
            f"{self._reject_form} if it is wrong; after a reject the solver revises ({revise}). "
            + _CREDIT_SENTENCES.get(
                self.verifier_credit, "You score for accepting right answers and rejecting wrong ones."
            )
            + tool_sentence(self.verifier_tools, "check the answer")
        )

    @property
    def _reject_form(self) -> str:
        return "reject: <the right answer>" if self.verifier_credit == "correction" else "reject: <what is wrong>"

    def tools(self, agent: AgentID) -> tuple[str, ...]:
        return self.verifier_tools if agent == VERIFIER else ()

    def _new_game(self) -> None:
        self.problem = generate(self.task, self._rng)
        self.answers, self.decisions = [], []

    def _current_agent(self) -> AgentID:
        return SOLVER if len(self.answers) == len(self.decisions) else VERIFIER

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if agent != VERIFIER or self._is_over() or self._current_agent() != VERIFIER:
            return ()  # the solver answers in free form
        return DECISIONS

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        if agent == SOLVER:
            value = parse_answer(text)
            return InvalidAction(ANSWER_FORMAT) if value is None else value
        found = _DECISION_RE.search(text)
        if found is None:
            # A bare number is the verifier's own answer: the solver's accepted, any other rejected
            # with that number as the critique (what a verifier that computed the answer writes first).
            own = parse_answer(text)
            if own is None:
                return InvalidAction(f"reply accept, or {self._reject_form}")
            return (True, "") if self.answers and own == self.answers[-1] else (False, str(own))
        accepted = found.group(1).lower() == "accept"
        critique = "" if accepted else text[found.end() :].strip(" \t\n:;,.!-")[: self.max_critique_chars]
        return (accepted, critique)

    def fallback_move(self, agent: AgentID) -> Any:
        return None if agent == SOLVER else super().fallback_move(agent)

    def _right(self, answer: int | None) -> bool:
        return answer is not None and answer == self.problem.answer

    @property
    def final_correct(self) -> bool:
        """The team's score: whether the solver's latest answer is right."""
        return bool(self.answers) and self._right(self.answers[-1])

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        if agent == SOLVER:
            self.answers.append(move)
            return {}
        accepted, critique = move
        self.decisions.append((bool(accepted), str(critique)))
        rewards: dict[AgentID, float] = {}
        if self.verifier_credit == "sum":
            rewards[VERIFIER] = float(self._decision_right(len(self.decisions) - 1))
        if self._is_over():
            rewards[SOLVER] = float(self.final_correct)
            if self.verifier_credit in ("mean", "correction"):
                right = sum(self._decision_right(i) for i in range(len(self.decisions)))
                rewards[VERIFIER] = right / len(self.decisions)
            elif self.verifier_credit == "team":
                rewards[VERIFIER] = rewards[SOLVER]
        return rewards

    def _decision_right(self, i: int) -> bool:
        accepted, critique = self.decisions[i]
        answer_right = self._right(self.answers[i])
        if accepted or answer_right:
            return accepted == answer_right
        # A reject of a wrong answer: under correction credit only one that states the right answer.
        return self.verifier_credit != "correction" or self._right(parse_answer(critique))

    def _is_over(self) -> bool:
        if not self.decisions:
            return False
        return self.decisions[-1][0] or len(self.decisions) > self.rounds

    def _render(self, agent: AgentID) -> str:
        lines = [f"Problem: {self.problem.question}"]
        who = "Your answer" if agent == SOLVER else "The solver's answer"
        for i, (accepted, critique) in enumerate(self.decisions):
            verdict = "accepted" if accepted else f"rejected: {critique or '(no reason given)'}"
            lines.append(f"{who} {_shown(self.answers[i])} was {verdict}.")
        lines.append(self._status(agent))
        return "\n".join(line for line in lines if line)

    def _status(self, agent: AgentID) -> str:
        if self._is_over():
            return f"Final answer {_shown(self.answers[-1])} is {'right' if self.final_correct else 'wrong'}."
        if self._current_agent() == VERIFIER:
            shown = _shown(self.answers[-1])
            if agent == SOLVER:
                return f"Your answer {shown}: waiting for the verifier."
            # The expression last, right where the verifier's reply (often a calculator call) starts.
            return (
                f"The solver answers: {shown}. Reply accept if it is right, or {self._reject_form}. "
                f"Check: {self.problem.expression}"
            )
        if agent == VERIFIER:
            return "Waiting for the solver."
        return f"Revise your answer (revision {len(self.decisions)} of {self.rounds})." if self.decisions else ""

    def view(self, agent: AgentID) -> dict[str, Any]:
        view: dict[str, Any] = {"role": agent, "question": self.problem.question, "expression": self.problem.expression}
        view["answer"] = _shown(self.answers[-1]) if self.answers else ""
        view["answers"] = [_shown(a) for a in self.answers]
        view["critiques"] = [c for accepted, c in self.decisions if not accepted]
        if self._is_over():
            view["final_correct"] = self.final_correct
        return view


__all__ = [
    "SolverVerifierEnv",
    "SolverVerifierHeuristic",
    "SolverVerifierLenient",
    "SolverVerifierRandom",
]
