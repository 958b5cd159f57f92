"""polytinker.envs.tools: tools an agent calls during a turn, before it answers.

- ``ToolCall``, ``ToolResult``, ``ToolLimits``, ``Tool``: the vocabulary (``base``).
- ``calculator`` (``Calculator``): arithmetic from a parsed tree of allowed nodes, no ``eval``.
- ``python`` (``PythonTool``): Python source in a sandboxed child interpreter;
  ``sandbox_report()`` says what the sandbox isolates on this machine.
- ``ToolFormat``, ``FORMATS``, ``tool_format``: how a call is written in the model's text
  (``tags``, the default, and ``json``).
- ``make_tool``, ``builtin_tools``: the built-ins by name; ``run_tool_call``: one call, never raises.

An env names the tools an agent may call in ``tools(agent)``; docs/tools.md has the details.
"""

from polytinker.envs.tools.base import TRUNCATED, Tool, ToolCall, ToolLimits, ToolResult, run_tool_call, truncate
from polytinker.envs.tools.builtins import builtin_tools, make_tool
from polytinker.envs.tools.calculator import Calculator
from polytinker.envs.tools.formats import DEFAULT_FORMAT, FORMATS, JsonFormat, TagFormat, ToolFormat, tool_format
from polytinker.envs.tools.python_sandbox import PythonTool, SandboxReport, sandbox_report

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "TRUNCATED",
    "Calculator",
    "JsonFormat",
    "PythonTool",
    "SandboxReport",
    "TagFormat",
    "Tool",
    "ToolCall",
    "ToolFormat",
    "ToolLimits",
    "ToolResult",
    "builtin_tools",
    "make_tool",
    "run_tool_call",
    "sandbox_report",
    "tool_format",
    "truncate",
]
