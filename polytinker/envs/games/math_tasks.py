"""Arithmetic problems with exact integer answers, drawn from a seeded generator.

- ``MathTaskConfig``: the difficulty knobs (operand digits, number of operations, operators,
  whether results may be negative) or another source of problems (``reasoning_gym:<task>``).
- ``MathProblem``: one problem: the text shown, the expression and the integer answer.
- ``generate(config, rng)``: a problem drawn from a numpy generator (the env's ``self._rng``).
- ``evaluate(expression)``: the exact value of an arithmetic expression (what scripted policies
  compute from the text they see; the generator's answers come from it too).
- ``parse_answer(text)``: the last whole number in a free-form answer, or None.

Expressions use ``+ - * /`` with the usual precedence, left to right. A division always comes
out even: the dividend of a division (the first operand of its product) is multiplied by the
divisor, so ``a / b`` is shown as ``c / b`` with ``c = a * b``. The built-in generator needs nothing beyond
numpy; ``reasoning_gym:<task>`` (for example ``reasoning_gym:chain_sum``) draws problems from the
``reasoning-gym`` package (the ``reasoning-gym`` extra) and keeps those with integer answers.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

import numpy as np

from polytinker.errors import ConfigError

OPERATORS = ("+", "-", "*", "/")
MAX_EXPRESSION_CHARS = 256
_RG_PREFIX = "reasoning_gym:"
_NEGATIVE_TRIES = 1000  # draws before a negative result is kept anyway (the knobs rarely allow one)
_RG_TRIES = 32  # reasoning-gym draws before a task is declared to have no integer answers

# The last number of a text: an optional minus sign that does not follow a digit ("10-7" is 7),
# digits with optional thousands commas, an optional decimal part.
_NUMBER_RE = re.compile(
    r"(?<![0-9A-Za-z_.,])(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.([0-9]+))?(?![0-9A-Za-z_])", re.ASCII
)
_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|(.))", re.ASCII | re.DOTALL)


@dataclass(frozen=True)
class MathTaskConfig:
    """Which problems a math env poses."""

    digits: int | tuple[int, ...] = 1
    """Digits of each operand (1: 1..9, 2: 10..99, ...), or one count per operand."""
    operations: int = 1
    """Operators per problem (operands = operations + 1)."""
    ops: tuple[str, ...] = ("+", "-")
    """Operators to draw from: any of ``+ - * /``."""
    allow_negative: bool = False
    """False: problems whose result is negative are drawn again."""
    source: str = "builtin"
    """``builtin`` (the knobs above) or ``reasoning_gym:<task>`` (its own knobs in source_kwargs)."""
    source_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``reasoning_gym.create_dataset`` (for example min_terms, max_digits)."""

    def __post_init__(self) -> None:
        if not 1 <= self.operations <= 8:
            raise ConfigError(f"math: operations must be in 1..8, got {self.operations}")
        digits = (self.digits,) * (self.operations + 1) if isinstance(self.digits, int) else tuple(self.digits)
        if len(digits) != self.operations + 1:
            raise ConfigError(
                f"math: digits lists one digit count per operand: {self.operations + 1} for "
                f"operations = {self.operations}, got {list(digits)} (or give one number for all)"
            )
        if not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
            raise ConfigError(f"math: each operand has 1..9 digits, got {list(digits)}")
        object.__setattr__(self, "digits", digits)
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        if not ops or not set(ops) <= set(OPERATORS):
            raise ConfigError(f"math: ops must be some of {list(OPERATORS)}, got {list(ops)}")
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "source_kwargs", dict(self.source_kwargs))
        if self.source != "builtin" and not self.source.startswith(_RG_PREFIX):
            raise ConfigError(f"math: source must be 'builtin' or 'reasoning_gym:<task>', got {self.source!r}")
        if self.source.startswith(_RG_PREFIX) and importlib.util.find_spec("reasoning_gym") is None:
            raise ConfigError(
                f"math: source {self.source!r} needs the reasoning-gym package: "
                "pip install 'polytinker[reasoning-gym]' (or use source = 'builtin')"
            )

    @property
    def operand_digits(self) -> tuple[int, ...]:
        return self.digits if isinstance(self.digits, tuple) else (self.digits,)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> MathTaskConfig:
        """Build from an env's keyword arguments; unknown ones are errors that list the known."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"math: unknown keyword arguments {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class MathProblem:
    """One problem."""

    question: str
    """The text shown to the agent."""
    expression: str
    """The arithmetic expression ("" when the source gives none): what scripted policies compute."""
    answer: int


def evaluate(expression: str) -> Fraction:
    """The exact value of ``+ - * /`` over integers with parentheses and unary signs.

    Raises ValueError on anything else (and on texts over MAX_EXPRESSION_CHARS characters)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens: list[str] = []
    for number, other in _TOKEN_RE.findall(expression.strip()):
        tokens.append(number or other)
    value, end = _sum(tokens, 0)
    if end != len(tokens):
        raise ValueError(f"unexpected {tokens[end]!r} in {expression!r}")
    return value


def _sum(tokens: list[str], i: int) -> tuple[Fraction, int]:
    value, i = _product(tokens, i)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        right, j = _product(tokens, i + 1)
        value, i = (value + right if tokens[i] == "+" else value - right), j
    return value, i


def _product(tokens: list[str], i: int) -> tuple[Fraction, int]:
    value, i = _factor(tokens, i)
    while i < len(tokens) and tokens[i] in ("*", "/"):
        right, j = _factor(tokens, i + 1)
        if tokens[i] == "/" and right == 0:
            raise ValueError("division by zero")
        value, i = (value * right if tokens[i] == "*" else value / right), j
    return value, i


def _factor(tokens: list[str], i: int) -> tuple[Fraction, int]:
    if i >= len(tokens):
        raise ValueError("the expression ends too early")
    token = tokens[i]
    if token in ("+", "-"):
        value, j = _factor(tokens, i + 1)
        return (value if token == "+" else -value), j
    if token == "(":
        value, j = _sum(tokens, i + 1)
        if j >= len(tokens) or tokens[j] != ")":
            raise ValueError("unbalanced parentheses")
        return value, j + 1
    if token.isdigit():
        return Fraction(int(token)), i + 1
    raise ValueError(f"unexpected {token!r}")


def parse_answer(text: str) -> int | None:
    """The last number in ``text`` as an int ("so 12 + 7 = 19." is 19; "1,234" is 1234; "19.0" is
    19), or None when there is none or it is not whole ("7.5")."""
    matches = list(_NUMBER_RE.finditer(text))
    if not matches:
        return None
    sign, digits, decimals = matches[-1].groups()
    if decimals and decimals.strip("0"):
        return None
    value = int(digits.replace(",", ""))
    return -value if sign else value


def generate(config: MathTaskConfig, rng: np.random.Generator) -> MathProblem:
    """A problem drawn from ``rng`` (the same generator state gives the same problem)."""
    if config.source.startswith(_RG_PREFIX):
        return _reasoning_gym_problem(config, rng)
    problem = _draw(config, rng)
    for _ in range(_NEGATIVE_TRIES):
        if config.allow_negative or problem.answer >= 0:
            break
        problem = _draw(config, rng)
    return problem


def _operand(digits: int, rng: np.random.Generator) -> int:
    low = 1 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


def _draw(config: MathTaskConfig, rng: np.random.Generator) -> MathProblem:
    operands = [_operand(d, rng) for d in config.operand_digits]
    ops = [config.ops[int(rng.integers(len(config.ops)))] for _ in range(config.operations)]
    start = 0  # the first operand of the product being built
    for i, op in enumerate(ops):
        if op in ("+", "-"):
            start = i + 1
        elif op == "/":
            operands[start] *= operands[i + 1]  # the division comes out even
    parts = [str(operands[0])]
    for op, operand in zip(ops, operands[1:], strict=True):
        parts += [op, str(operand)]
    expression = " ".join(parts)
    value = evaluate(expression)
    return MathProblem(question=f"{expression} = ?", expression=expression, answer=int(value))


def _reasoning_gym_problem(config: MathTaskConfig, rng: np.random.Generator) -> MathProblem:
    import reasoning_gym

    task = config.source.removeprefix(_RG_PREFIX)
    for _ in range(_RG_TRIES):
        seed = int(rng.integers(2**31))
        try:
            entry = reasoning_gym.create_dataset(task, size=1, seed=seed, **config.source_kwargs)[0]
        except Exception as exc:  # an unknown task or argument: the package's own message says which
            raise ConfigError(f"math: reasoning_gym task {task!r} with {dict(config.source_kwargs)}: {exc}") from exc
        answer = _whole(str(entry["answer"]))
        if answer is not None:
            expression = str(entry.get("metadata", {}).get("expression", ""))
            return MathProblem(str(entry["question"])[:1000], expression[:MAX_EXPRESSION_CHARS], answer)
    raise ConfigError(f"math: reasoning_gym task {task!r} gave no integer answer in {_RG_TRIES} draws; pick another")


def _whole(text: str) -> int | None:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None
    return int(value) if value.denominator == 1 else None


def solve(expression: str) -> int | None:
    """The integer value of an expression, or None when it has none (for scripted policies)."""
    try:
        value = evaluate(expression)
    except (ValueError, ZeroDivisionError):
        return None
    return int(value) if value.denominator == 1 else None


__all__ = [
    "MAX_EXPRESSION_CHARS",
    "OPERATORS",
    "MathProblem",
    "MathTaskConfig",
    "evaluate",
    "generate",
    "parse_answer",
    "solve",
]
