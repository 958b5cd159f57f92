"""How a tool call is written in the model's text, and how it is read back.

- ``tags`` (the default): ``<calculator>12*7</calculator>``, the tool's name as the tag. The
  most compact form, and the one a 135M model copies best. Only the names of the agent's tools
  are tags: any other markup is text.
- ``json``: ``<tool_call>{"name": "calculator", "arguments": "12*7"}</tool_call>`` (the Hermes /
  Qwen convention, as the OpenAI-compatible endpoint renders tools). ``arguments`` may also be an
  object such as ``{"expression": "12*7"}`` or ``{"code": "..."}``. A name that is not one of the
  agent's tools is still a call (``run_tool_call`` answers with the list of tools); JSON that does
  not parse is not a call.

Sampling stops after a call (``stop_strings``); samplers usually leave the stop string out of
the text, so ``parse`` also reads a call whose closing tag is missing at the end of the text.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from polytinker.envs.tools.base import Tool, ToolCall, ToolLimits
from polytinker.errors import ConfigError

_OBJECT_KEYS = ("expression", "code", "input", "arguments", "query")


class ToolFormat(abc.ABC):
    """How a call is written in the model's text."""

    name: ClassVar[str]

    @abc.abstractmethod
    def parse(self, text: str, tools: Collection[str]) -> ToolCall | None:
        """The first call in ``text``, or None when it holds none."""

    @abc.abstractmethod
    def stop_strings(self, tools: Collection[str]) -> tuple[str, ...]:
        """Strings that end a call: sampling stops after one, so the tool can run."""

    @abc.abstractmethod
    def example(self, tool: str, arguments: str) -> str:
        """A call of ``tool`` with ``arguments``, written as the model should write it."""

    def describe(self, tools: Sequence[Tool], limits: ToolLimits | None = None) -> str:
        """System-prompt text: the tools, how to call one and how the result comes back."""
        if not tools:
            return ""
        lines = [
            "You can use tools before you answer. To use one, write the call and stop; its result comes back "
            "in a tool message, then you go on. Tools:"
        ]
        lines += [
            f"- {tool.name}: {tool.description} Call: {self.example(tool.name, tool.example_arguments)}"
            for tool in tools
        ]
        if limits is not None:
            lines.append(f"At most {limits.max_calls_per_turn} calls per turn; then give your answer without a call.")
        return "\n".join(lines)


class TagFormat(ToolFormat):
    """``<name>arguments</name>``."""

    name: ClassVar[str] = "tags"

    def parse(self, text: str, tools: Collection[str]) -> ToolCall | None:
        names = sorted((t for t in tools if t), key=len, reverse=True)  # longest first: "py" vs "python"
        if not names:
            return None
        opening = re.search("<(" + "|".join(re.escape(n) for n in names) + ")>", text)
        if opening is None:
            return None
        tool = opening.group(1)
        end = text.find(f"</{tool}>", opening.end())
        body = text[opening.end() :] if end < 0 else text[opening.end() : end]
        return ToolCall(tool, body.strip())

    def stop_strings(self, tools: Collection[str]) -> tuple[str, ...]:
        return tuple(f"</{tool}>" for tool in tools)

    def example(self, tool: str, arguments: str) -> str:
        return f"<{tool}>{arguments}</{tool}>"


def _arguments(value: Any) -> str | None:
    """The argument text of a JSON call's ``arguments``, or None when it has no usable shape."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, dict):
        for key in _OBJECT_KEYS:
            if isinstance(value.get(key), str):
                return str(value[key])
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
        return json.dumps(value)  # the tool reads it and says what is wrong
    return None


class JsonFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``."""

    name: ClassVar[str] = "json"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"

    def parse(self, text: str, tools: Collection[str]) -> ToolCall | None:
        start = text.find(self.OPEN)
        if start < 0:
            return None
        start += len(self.OPEN)
        end = text.find(self.CLOSE, start)
        body = (text[start:] if end < 0 else text[start:end]).strip()
        try:
            # raw_decode: one object, ignoring what follows it (a stray brace, a newline)
            call, _ = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = _arguments(call.get("arguments", call.get("parameters")))
        return None if arguments is None else ToolCall(call["name"], arguments)

    def stop_strings(self, tools: Collection[str]) -> tuple[str, ...]:
        return (self.CLOSE,)

    def example(self, tool: str, arguments: str) -> str:
        return f"{self.OPEN}{json.dumps({'name': tool, 'arguments': arguments})}{self.CLOSE}"


FORMATS: Mapping[str, ToolFormat] = MappingProxyType({f.name: f for f in (TagFormat(), JsonFormat())})
"""The call formats by name; ``tags`` is the default."""
DEFAULT_FORMAT = "tags"


def tool_format(name: str) -> ToolFormat:
    """The format called ``name``."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown tool call format {name!r}; the formats are: {', '.join(FORMATS)}") from None


__all__ = ["DEFAULT_FORMAT", "FORMATS", "JsonFormat", "TagFormat", "ToolFormat", "tool_format"]
