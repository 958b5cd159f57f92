"""The ``calculator`` tool: arithmetic on numbers, evaluated from a parsed tree of allowed nodes.

The expression is parsed with ``ast`` and walked by an evaluator that knows only numbers
(ints and floats), ``+ - * / // % **``, unary ``+``/``-``, parentheses, the names ``pi`` and
``e`` and the functions ``sqrt abs round min max floor ceil``. Anything else (a name, an attribute,
a string, a lambda, a comprehension, ``__import__``) is refused with a message, never run; no
``eval``. ``^`` is read as a power and ``×``/``÷`` as ``*``/``/``, as on a pocket calculator.

Bounds: integers up to 10**100 in magnitude (a power is checked before it is computed), float
results finite and real, expressions at most ``MAX_DEPTH`` deep and ``MAX_NODES`` nodes.

Output rule: an integer prints exactly (``84``); a float prints with up to 10 significant digits
in ``%g`` style, so a whole float prints without ``.0`` (``12/4`` gives ``3``, ``1/3`` gives
``0.3333333333``, ``2**0.5*1e20`` gives ``1.414213562e+20``).
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable
from typing import ClassVar

from polytinker.envs.tools.base import Tool, ToolLimits, ToolResult, truncate

MAX_INT = 10**100
"""The largest integer magnitude of an operand or result."""
MAX_DEPTH = 40
"""How deeply operations may nest."""
MAX_NODES = 400
"""How many syntax nodes an expression may have."""
_MAX_ROUND_DIGITS = 20

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


class CalcError(Exception):
    """A refused or failed expression; the message is what the model is shown after "error: "."""


def _round(*args: Number) -> Number:
    if len(args) == 2:
        if not isinstance(args[1], int) or abs(args[1]) > _MAX_ROUND_DIGITS:
            raise CalcError(f"round's second argument must be a whole number of at most {_MAX_ROUND_DIGITS}")
        return round(args[0], args[1])
    return round(args[0])


def _sqrt(x: Number) -> float:
    if x < 0:
        raise CalcError("sqrt of a negative number")
    return math.sqrt(x)


# name -> (function, fewest arguments, most arguments)
_FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (_sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (min, 1, 20),
    "max": (max, 1, 20),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}
_NAMES = ", ".join([*_CONSTANTS, *_FUNCTIONS])


def _checked(value: Number) -> Number:
    """``value`` if it is within the bounds, else a CalcError saying which bound."""
    if isinstance(value, bool):  # True/False are ints in Python; not numbers here
        raise CalcError("booleans are not numbers here")
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise CalcError("result too large (the limit is 10**100)")
        return value
    if isinstance(value, float):
        if math.isnan(value):
            raise CalcError("result is not a number")
        if math.isinf(value):
            raise CalcError("result too large")
        return value
    raise CalcError("result is not a real number")


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused before it is computed when the result would be too large."""
    whole = isinstance(base, int) and isinstance(exponent, int)
    if whole and exponent > 0 and abs(base) > 1 and exponent * math.log10(abs(base)) > 100.5:
        raise CalcError("result too large (the limit is 10**100)")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    return operator.pow(base, exponent)


class _Evaluator:
    def __init__(self) -> None:
        self.nodes = 0

    def eval(self, node: ast.AST, depth: int) -> Number:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise CalcError(f"expression too long (more than {MAX_NODES} parts)")
        if depth > MAX_DEPTH:
            raise CalcError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise CalcError(f"only numbers are allowed, not {type(node.value).__name__}")
            return _checked(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = self.eval(node.operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else +value
        if isinstance(node, ast.BinOp):
            left, right = self.eval(node.left, depth + 1), self.eval(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                return _checked(_power(left, right))
            func = _BINARY.get(type(node.op))
            if func is None:
                raise CalcError(f"operator {type(node.op).__name__} is not allowed (use + - * / // % **)")
            return _checked(func(left, right))
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise CalcError(f"unknown name {node.id[:40]!r} (allowed: {_NAMES})")
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        raise CalcError(f"{type(node).__name__} is not allowed: write arithmetic on numbers")

    def call(self, node: ast.Call, depth: int) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            what = node.func.id[:40] if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise CalcError(f"unknown function {what!r} (allowed: {', '.join(_FUNCTIONS)})")
        func, fewest, most = _FUNCTIONS[node.func.id]
        if node.keywords or not fewest <= len(node.args) <= most:
            raise CalcError(f"{node.func.id} takes {fewest}..{most} numbers as arguments")
        args = [self.eval(arg, depth + 1) for arg in node.args]
        return _checked(func(*args))


def _normalise(expression: str) -> str:
    text = expression.strip().rstrip("=").strip()
    return text.replace("^", "**").replace("×", "*").replace("÷", "/")


def _parse(text: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        # An equation, "584 * 56 = 2508" (models write the value they want checked): its left side.
        left = text.split("=", 1)[0].strip()
        if left != text and left:
            return _parse(left)
        raise CalcError(f"not an arithmetic expression ({exc.msg})") from None


def evaluate(expression: str) -> Number:
    """The value of ``expression``; raises CalcError (or ZeroDivisionError) for what it refuses."""
    text = _normalise(expression)
    if not text:
        raise CalcError("empty expression: write one, e.g. 12*7")
    return _Evaluator().eval(_parse(text), 0)


def format_number(value: Number) -> str:
    """The module's output rule: ints exactly, floats with up to 10 significant digits (%g)."""
    if isinstance(value, int):
        return str(value)
    text = f"{value:.10g}"
    return "0" if text == "-0" else text


class Calculator(Tool):
    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = (
        "Evaluates an arithmetic expression on numbers (+ - * / // % ** and parentheses; sqrt, abs, round, "
        "min, max, floor, ceil; pi, e) and returns its value (of the left side, given an equation)."
    )
    example_arguments: ClassVar[str] = "12*7"

    def call(self, arguments: str, limits: ToolLimits) -> ToolResult:
        start = time.monotonic()
        try:
            text, ok = format_number(evaluate(arguments)), True
        except ZeroDivisionError:
            text, ok = "error: division by zero", False
        except CalcError as exc:
            text, ok = f"error: {exc}", False
        except OverflowError:  # float powers and int-to-float conversions
            text, ok = "error: result too large", False
        except (ArithmeticError, ValueError, TypeError) as exc:  # math domain errors, int/float overflow
            text, ok = f"error: {exc}", False
        except (RecursionError, MemoryError):  # the parser on pathological nesting
            text, ok = "error: expression nested too deeply", False
        return ToolResult(truncate(text, limits.max_result_chars), ok, time.monotonic() - start)


__all__ = ["MAX_DEPTH", "MAX_INT", "MAX_NODES", "CalcError", "Calculator", "evaluate", "format_number"]
