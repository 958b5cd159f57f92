"""The built-in tools by name: ``make_tool`` and ``builtin_tools``."""

from __future__ import annotations

from polytinker.envs.tools.base import Tool
from polytinker.envs.tools.calculator import Calculator
from polytinker.envs.tools.python_sandbox import PythonTool
from polytinker.errors import ConfigError

_BUILTIN: dict[str, type[Tool]] = {tool.name: tool for tool in (Calculator, PythonTool)}


def builtin_tools() -> tuple[str, ...]:
    """The names of the built-in tools."""
    return tuple(_BUILTIN)


def make_tool(name: str) -> Tool:
    """A new instance of the built-in tool called ``name``."""
    try:
        return _BUILTIN[name]()
    except KeyError:
        raise ConfigError(f"unknown tool {name!r}; the built-in tools are: {', '.join(_BUILTIN)}") from None


__all__ = ["builtin_tools", "make_tool"]
