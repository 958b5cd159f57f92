"""Arithmetic with a verifiable answer, for one agent (``player_0``): ``math-v0`` and, with
harder problems and a calculator, ``math_tool-v0``.

The agent sees a problem (``12 + 7 = ?``) and answers in free text; the env reads the last whole
number of the answer (``polytinker.envs.games.math_tasks.parse_answer``). There are no legal
moves to list. An answer without a number is an invalid action (penalty, retry). Reward: 1 for
the right number on the first attempt. With ``attempts = N > 1`` a wrong answer is followed by
"wrong, try again" and a right one on attempt ``k`` earns ``(N - k + 1) / N``; after ``N`` wrong
answers the episode ends with 0.

``tools`` names the tools the agent may call before it answers (``("calculator",)`` in
``math_tool-v0``, ``MathToolEnv``); the runtime runs them (``polytinker.envs.tools``), the env only declares them
and says so in its instructions. The other keyword arguments are ``MathTaskConfig``'s.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.games.math_tasks import MathProblem, MathTaskConfig, generate, parse_answer, solve
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

NO_ANSWER = "(no answer)"
ANSWER_FORMAT = "answer with the result as a whole number, for example: 42"


def near_guess(view: dict[str, Any], rng: Any) -> str:
    """The right answer moved by -3..3 (so right one time in seven): a plausible wrong answer."""
    value = solve(view.get("expression", ""))
    if value is None:
        return str(rng.randint(0, 100))
    return str(value + rng.randint(-3, 3))


def right_answer(view: dict[str, Any]) -> str:
    """What the problem text computes to (``0`` for a problem without an arithmetic expression)."""
    value = solve(view.get("expression", ""))
    return "0" if value is None else str(value)


class MathRandom(ScriptedPolicy):
    """A number near the answer (right one time in seven)."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        return near_guess(view, self.rng)


class MathHeuristic(ScriptedPolicy):
    """Computes the expression it sees: always right on the built-in problems."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        return f"The answer is {right_answer(view)}"


def tool_sentence(tools: tuple[str, ...], purpose: str = "work it out") -> str:
    """The instructions' mention of the tools (how to call them is the runtime's to say)."""
    if not tools:
        return ""
    names = " and ".join(f"the {name} tool" for name in tools)
    return f" You may use {names} to {purpose}."


def check_tools(tools: Any) -> tuple[str, ...]:
    names = (tools,) if isinstance(tools, str) else tuple(tools)
    if not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ConfigError(f"math: tools must be tool names such as 'calculator' or 'python', got {list(names)}")
    return names


class MathEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "math_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": MathRandom, "heuristic": MathHeuristic}

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        attempts: int = 1,
        tools: tuple[str, ...] | list[str] = (),
        **task: Any,
    ) -> None:
        if not 1 <= attempts <= 10:
            raise ConfigError(f"math: attempts must be in 1..10, got {attempts}")
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self.task = MathTaskConfig.from_kwargs(task)
        self.attempts = attempts
        self._tools = check_tools(tools)
        self.problem = MathProblem("", "", 0)
        self.answers: list[int | None] = []

    def instructions(self, agent: AgentID) -> str:
        tries = f" You have {self.attempts} attempts; a wrong answer may be corrected." if self.attempts > 1 else ""
        return f"Solve the arithmetic problem; {ANSWER_FORMAT}.{tries}{tool_sentence(self._tools)}"

    def tools(self, agent: AgentID) -> tuple[str, ...]:
        return self._tools

    def _new_game(self) -> None:
        self.problem = generate(self.task, self._rng)
        self.answers = []

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return ()  # free-form: the last whole number of the text is the answer

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        value = parse_answer(text)
        return InvalidAction(ANSWER_FORMAT) if value is None else value

    def fallback_move(self, agent: AgentID) -> Any:
        return None  # no answer: a wrong attempt

    @property
    def solved(self) -> bool:
        return bool(self.answers) and self.answers[-1] == self.problem.answer

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.answers.append(move)
        if not self.solved:
            return {}
        return {agent: (self.attempts - len(self.answers) + 1) / self.attempts}

    def _is_over(self) -> bool:
        return self.solved or len(self.answers) >= self.attempts

    def _render(self, agent: AgentID) -> str:
        lines = [f"Problem: {self.problem.question}"]
        for i, answer in enumerate(self.answers, 1):
            shown = NO_ANSWER if answer is None else str(answer)
            lines.append(f"Attempt {i}: {shown} is {'right' if answer == self.problem.answer else 'wrong'}.")
        if self.solved:
            lines.append("Correct!")
        elif self._is_over():
            lines.append(f"The answer was {self.problem.answer}.")
        elif self.answers:
            left = self.attempts - len(self.answers)
            lines.append(f"Try again ({left} attempt{'s' if left > 1 else ''} left).")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        # Numbers as text: an answer may be longer than msgpack's 64-bit integers.
        answers = [NO_ANSWER if a is None else str(a) for a in self.answers]
        return {"question": self.problem.question, "expression": self.problem.expression, "answers": answers}


class MathToolEnv(MathEnv):
    """``math_tool-v0``: problems too hard to do in the head (3-digit x 2-digit products by
    default) and a calculator (``tools=("python",)`` for the sandboxed Python tool instead)."""

    metadata: ClassVar[dict[str, Any]] = {**MathEnv.metadata, "name": "math_tool_v0"}

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        attempts: int = 1,
        tools: tuple[str, ...] | list[str] = ("calculator",),
        **task: Any,
    ) -> None:
        super().__init__(config, render_mode, attempts, tools, **{"digits": (3, 2), "ops": ("*",), **task})


__all__ = ["MathEnv", "MathHeuristic", "MathRandom", "MathToolEnv", "near_guess", "right_answer", "tool_sentence"]
