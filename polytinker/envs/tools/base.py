"""The vocabulary of tools an agent calls during a turn.

- ``ToolCall``: a call as the model wrote it (a tool's name and its raw argument text).
- ``ToolResult``: what the tool answered (the text the model is shown, whether it worked, its wall time).
- ``ToolLimits``: the bounds every call runs under (calls per turn, result size, time, memory, argument size).
- ``Tool``: the base of a tool; ``run`` never raises and honours the limits.
- ``run_tool_call``: runs one call against the tools an agent has, whatever the call holds.
- ``truncate``: cuts a text to a size, ending in ``TRUNCATED``.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from polytinker.errors import ConfigError

TRUNCATED = "... [truncated]"
"""The end of a result that was cut at ``ToolLimits.max_result_chars``."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model wrote it."""

    name: str
    """The tool's name."""
    arguments: str
    """The raw argument text the model wrote (an expression, Python source)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool answered; ``text`` is what the model is shown."""

    text: str
    """Never longer than the call's ``ToolLimits.max_result_chars``."""
    ok: bool
    """False: the tool failed or refused the call, and ``text`` says why ("error: division by zero")."""
    wall_s: float
    """Wall time of the call."""

    @classmethod
    def error(cls, message: str, wall_s: float = 0.0) -> ToolResult:
        """A failed call; ``message`` goes after "error: "."""
        return cls(text=f"error: {message}", ok=False, wall_s=wall_s)


@dataclass(frozen=True)
class ToolLimits:
    """The bounds of tool calls; the defaults suit a small model on a CPU."""

    max_calls_per_turn: int = 3
    """Calls one agent may make in a turn before it must answer (0: none)."""
    max_result_chars: int = 512
    """Longer results are cut, ending in "... [truncated]"."""
    timeout_s: float = 5.0
    """Wall time of one call."""
    memory_mb: int = 256
    """The python tool's address-space limit (RLIMIT_AS) for the sandboxed interpreter."""
    max_argument_chars: int = 2000
    """Longer arguments are refused (ok=False), not run."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_calls_per_turn <= 100:
            raise ConfigError(f"ToolLimits.max_calls_per_turn must be in 0..100, got {self.max_calls_per_turn}")
        if self.max_result_chars < 2 * len(TRUNCATED):
            raise ConfigError(
                f"ToolLimits.max_result_chars must be at least {2 * len(TRUNCATED)} (room for a result and the "
                f"truncation mark), got {self.max_result_chars}"
            )
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 600):
            raise ConfigError(f"ToolLimits.timeout_s must be in (0, 600] seconds, got {self.timeout_s}")
        if not 32 <= self.memory_mb <= 1 << 20:
            raise ConfigError(
                f"ToolLimits.memory_mb must be at least 32 (a Python interpreter needs about 20 MB of address "
                f"space) and at most {1 << 20}, got {self.memory_mb}"
            )
        if self.max_argument_chars < 1:
            raise ConfigError(f"ToolLimits.max_argument_chars must be at least 1, got {self.max_argument_chars}")


class Tool(abc.ABC):
    """A tool: a name, one sentence for the system prompt, and ``run``.

    ``run`` is synchronous (the caller runs it in a thread), never raises (a failure is a result
    with ``ok=False``), honours ``limits`` and is deterministic where it can be."""

    name: ClassVar[str]
    description: ClassVar[str]
    """One sentence for the system prompt: what the tool does and what argument it takes."""
    example_arguments: ClassVar[str]
    """Arguments of a typical call, for the prompt's example."""

    def run(self, arguments: str, limits: ToolLimits) -> ToolResult:
        """Refuse over-long arguments, else ``call`` the tool."""
        refused = refusal(arguments, limits)
        return refused if refused is not None else self.call(arguments, limits)

    @abc.abstractmethod
    def call(self, arguments: str, limits: ToolLimits) -> ToolResult:
        """What a tool does with arguments within the size limit (the rest of ``run``'s contract:
        synchronous, never raises, honours ``limits``)."""


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, ending in ``TRUNCATED`` when cut."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - len(TRUNCATED))] + TRUNCATED


def refusal(arguments: str, limits: ToolLimits) -> ToolResult | None:
    """The result that refuses over-long arguments, or None when they may run."""
    if len(arguments) > limits.max_argument_chars:
        return ToolResult.error(
            f"the arguments are {len(arguments)} characters long; the limit is {limits.max_argument_chars}"
        )
    return None


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool], limits: ToolLimits) -> ToolResult:
    """Run ``call`` with the agent's ``tools``; never raises.

    An unknown name, over-long arguments or a tool that breaks its contract (raises, answers
    something else than a ``ToolResult``) give a result with ``ok=False`` saying so; the text is
    cut at ``limits.max_result_chars`` whatever the tool returned."""
    tool = tools.get(call.name)
    if tool is None:
        names = ", ".join(sorted(tools)) or "none"
        return ToolResult.error(truncate(f"unknown tool {call.name[:64]!r}; the tools are: {names}", 400))
    refused = refusal(call.arguments, limits)
    if refused is not None:
        return refused
    start = time.monotonic()
    try:
        result = tool.run(call.arguments, limits)
    except Exception as exc:  # a third-party tool broke its contract; the episode goes on
        return ToolResult.error(f"the tool {call.name} failed ({type(exc).__name__})", time.monotonic() - start)
    if not isinstance(result, ToolResult):
        return ToolResult.error(f"the tool {call.name} returned no result", time.monotonic() - start)
    if len(result.text) > limits.max_result_chars:
        result = ToolResult(truncate(result.text, limits.max_result_chars), result.ok, result.wall_s)
    return result


__all__ = [
    "TRUNCATED",
    "Tool",
    "ToolCall",
    "ToolLimits",
    "ToolResult",
    "refusal",
    "run_tool_call",
    "truncate",
]
