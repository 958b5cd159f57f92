"""The built-in tools (calculator, python sandbox), the call formats and run_tool_call."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polytinker.envs.tools import (
    FORMATS,
    TRUNCATED,
    Calculator,
    JsonFormat,
    PythonTool,
    TagFormat,
    Tool,
    ToolCall,
    ToolLimits,
    ToolResult,
    builtin_tools,
    make_tool,
    python_sandbox,
    run_tool_call,
    sandbox_report,
    tool_format,
)
from polytinker.errors import ConfigError

LIMITS = ToolLimits()
FAST = ToolLimits(timeout_s=1.0, memory_mb=64)


# --- calculator -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("12*7", "84"),
        ("12/4", "3"),
        ("7/2", "3.5"),
        ("1/3", "0.3333333333"),
        ("2**10", "1024"),
        ("2^10", "1024"),
        ("-3+5", "2"),
        ("--3", "3"),
        ("(1+2)*3", "9"),
        ("17//5", "3"),
        ("17%5", "2"),
        ("-7//2", "-4"),
        ("2**-1", "0.5"),
        ("0.1+0.2", "0.3"),
        ("1.5e3", "1500"),
        ("2**0.5*1e20", "1.414213562e+20"),
        ("sqrt(16)", "4"),
        ("abs(-3)", "3"),
        ("round(2.567, 2)", "2.57"),
        ("round(2.6)", "3"),
        ("min(3, 1, 2)", "1"),
        ("max(1.5, 2)", "2"),
        ("floor(2.7) + ceil(2.1)", "5"),
        ("2*pi", "6.283185307"),
        (" 12 * 7 = ", "84"),
        ("584 * 56 = 2508", "32704"),  # an equation: the value of its left side
        ("3×4÷2", "6"),
        ("-0.0", "0"),
        ("10**100", "1" + "0" * 100),
    ],
)
def test_calculator_computes(expression: str, expected: str) -> None:
    result = Calculator().run(expression, LIMITS)
    assert (result.text, result.ok) == (expected, True)


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("1/0", "error: division by zero"),
        ("1%0", "error: division by zero"),
        ("1//0.0", "error: division by zero"),
        ("0**-1", "error: division by zero"),
        ("2**1000", "too large"),
        ("9**9**9", "too large"),
        ("10**101", "too large"),
        ("(10**60)*(10**60)", "too large"),
        ("9" * 200, "too large"),
        ("2.0**10000", "too large"),
        ("1e999", "too large"),
        ("(-8)**0.5", "not a real number"),
        ("sqrt(-1)", "negative"),
        ("(" * 300 + "1" + ")" * 300, "nested"),
        ("-" * 1000 + "1", "nested"),
        ("+".join(["1"] * 500), "error: expression"),
        ("x", "unknown name 'x'"),
        ("x + 1", "unknown name"),
        ("(1).real", "Attribute is not allowed"),
        ("math.pi", "Attribute"),
        ("lambda: 1", "Lambda"),
        ("__import__('os')", "unknown function '__import__'"),
        ("().__class__", "not allowed"),
        ("open('/etc/passwd')", "unknown function 'open'"),
        ("'a' * 3", "only numbers"),
        ("f'{1}'", "not allowed"),
        ("b'1'", "only numbers"),
        ("[1, 2]", "List"),
        ("1, 2", "Tuple"),
        ("1 if 1 else 2", "IfExp"),
        ("1 < 2", "Compare"),
        ("True + 1", "only numbers"),
        ("1j", "only numbers"),
        ("1 & 2", "operator"),
        ("round(1.5, 100)", "round"),
        ("round(1.5, 0.5)", "round"),
        ("min()", "min takes"),
        ("max(a=1)", "max takes"),
        ("sqrt(1, 2)", "sqrt takes"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
        ("import os", "not an arithmetic expression"),
        ("\x00", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses(expression: str, says: str) -> None:
    result = Calculator().run(expression, LIMITS)
    assert not result.ok and says in result.text and result.text.startswith("error:"), result.text


def test_calculator_refuses_over_long_arguments_without_evaluating() -> None:
    result = Calculator().run("1+" * 2000 + "1", LIMITS)
    assert not result.ok and "limit is 2000" in result.text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789.+-*/%()^ eipqrtsxabcdln_,'[]=<>j")), max_size=60))
def test_calculator_never_raises(expression: str) -> None:
    result = Calculator().run(expression, LIMITS)
    assert isinstance(result, ToolResult) and len(result.text) <= LIMITS.max_result_chars


# --- python sandbox -----------------------------------------------------------------------------------
def run_python(code: str, limits: ToolLimits = FAST) -> ToolResult:
    result = PythonTool().run(code, limits)
    assert len(result.text) <= limits.max_result_chars
    return result


def test_python_prints() -> None:
    assert (run_python("print(2+2)").text, run_python("print(2+2)").ok) == ("4", True)


def test_python_runs_under_the_runtimes_umask() -> None:
    """The runtime's processes set umask 0o077 (their files are one user's): the child, another
    user when the runtime is root, must still read the code it is given."""
    old = os.umask(0o077)
    try:
        assert (run_python("print(6*7)").text, run_python("print(6*7)").ok) == ("42", True)
    finally:
        os.umask(old)


def test_python_shows_a_last_expression_and_says_when_nothing_printed() -> None:
    assert run_python("x = 6\nx * 7").text == "42"
    assert run_python("x = 1").text == python_sandbox.NO_OUTPUT
    assert run_python("```python\nprint(3)\n```").text == "3"  # a Markdown fence is dropped


def test_python_error_shows_stdout_and_the_last_traceback_line() -> None:
    result = run_python("print('hi')\n1/0")
    assert not result.ok and result.text == "hi\nZeroDivisionError: division by zero"
    assert run_python("def f(:\n  pass").text.startswith("SyntaxError")
    assert run_python("import sys; sys.exit(3)").text == "error: exit status 3"
    assert run_python("import sys; sys.exit(0)").ok


def test_python_time_limit_kills_the_code() -> None:
    start = time.monotonic()
    result = run_python("while True: pass")
    assert not result.ok and result.text == "error: timed out after 1 s"
    assert time.monotonic() - start < 3.0


def test_python_partial_output_before_a_timeout_is_kept() -> None:
    result = run_python("print('started', flush=True)\nwhile True: pass")
    assert result.text == "started\nerror: timed out after 1 s"


def test_python_memory_bomb_is_refused() -> None:
    result = run_python("x = bytearray(10**9)\nprint('allocated')")
    assert not result.ok and result.text == "MemoryError"


def test_python_fork_bomb_does_not_start_a_process() -> None:
    if not sandbox_report().forks_refused:
        pytest.skip(f"RLIMIT_NPROC does not hold here: {sandbox_report()}")
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()")
    assert not result.ok and result.text.startswith("BlockingIOError"), result.text
    assert time.monotonic() - start < 3.0


def test_python_cannot_write_outside_its_directory(tmp_path: Path) -> None:
    if not sandbox_report().user_dropped:
        pytest.skip("the runtime is not root: the code runs as the runtime's user and writes where it may")
    target = tmp_path / "outside.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not result.ok and result.text.startswith("PermissionError") and not target.exists()


def test_python_file_size_is_limited() -> None:
    result = run_python(f"open('big', 'w').write('x' * {2 * python_sandbox.MAX_FILE_BYTES})")
    assert not result.ok and "File too large" in result.text


def test_python_working_directory_is_removed_afterwards() -> None:
    result = run_python("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    assert result.ok and Path(result.text).name.startswith("polytinker-python-"), result.text
    assert not Path(result.text).exists()
    timed_out = run_python("import os\nprint(os.getcwd(), flush=True)\nwhile True: pass")
    assert not Path(timed_out.text.splitlines()[0]).exists()


def test_python_sees_none_of_the_parents_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYTINKER_TOOL_TEST_SECRET", "hunter2")
    code = (
        "import os, sys\nprint(os.environ.get('POLYTINKER_TOOL_TEST_SECRET'), sorted(os.environ), sys.flags.isolated)"
    )
    # LC_CTYPE: the interpreter's own coercion of the C locale to UTF-8 (PEP 538), nothing inherited
    assert run_python(code).text == "None ['LC_CTYPE'] 1"


def test_python_network_is_blocked() -> None:
    report = sandbox_report()
    if not report.network_isolated:
        pytest.skip(f"the kernel refuses a network namespace here ({report.notes}); the fallback test covers it")
    code = (
        "import socket\nprint(socket.if_nameindex())\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 53))"
    )
    result = run_python(code)
    assert not result.ok and result.text == "[(1, 'lo')]\nOSError: [Errno 101] Network is unreachable"


def with_child_config(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    """Change what the parent tells the sandboxed child, as a kernel that refuses a step would."""
    original = python_sandbox._config

    def config(limits: ToolLimits, report: python_sandbox.SandboxReport) -> dict[str, Any]:
        return {**original(limits, report), **changes}

    monkeypatch.setattr(python_sandbox, "_config", config)


def test_python_fails_closed_when_a_probed_step_fails_later(monkeypatch: pytest.MonkeyPatch) -> None:
    # "net": False makes the child skip the namespace, as when unshare fails after the probe said it works.
    with_child_config(monkeypatch, net=False, require=["net"])
    result = run_python("print('ran')")
    assert not result.ok and "could not be set up" in result.text and "ran" not in result.text


def test_python_best_effort_without_a_network_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    with_child_config(monkeypatch, net=False, require=[])
    result = run_python("import socket, os\nprint(len(socket.if_nameindex()) >= 1, os.getuid())")
    assert result.ok and result.text.startswith("True")


def test_python_network_namespace_through_a_user_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of a runtime that is not root: a user namespace, and the network namespace in it."""
    if not sandbox_report().network_isolated:
        pytest.skip("no network namespace here")
    with_child_config(monkeypatch, direct_netns=False)
    result = run_python("import socket, os\nprint(socket.if_nameindex(), os.getuid() != 0)")
    assert result.ok and result.text == "[(1, 'lo')] True", result.text


def test_python_output_flood_is_capped_and_stopped() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    print('x' * 1000)", LIMITS)
    assert result.ok and result.text.endswith(TRUNCATED) and len(result.text) == LIMITS.max_result_chars
    assert time.monotonic() - start < LIMITS.timeout_s / 2  # stopped at the cap, not at the timeout
    big = run_python("print('é' * 5000)")
    assert len(big.text) == FAST.max_result_chars and big.text.startswith("éé")


def test_python_is_deterministic_and_runs_calls_at_once() -> None:
    code = "import random\nprint(random.random())"
    assert run_python(code).text == run_python(code).text
    results: dict[int, str] = {}

    def call(i: int) -> None:
        results[i] = run_python(f"print({i} * 11)").text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: str(i * 11) for i in range(4)}


def test_python_hostile_arguments_never_raise() -> None:
    assert not run_python("\x00").ok
    assert not run_python("x" * 3000).ok and "limit is 2000" in run_python("x" * 3000).text
    assert run_python("import os; os.close(1); os.close(2)\nwhile True: pass").text == "error: timed out after 1 s"
    assert run_python("print('\\udcff')").ok  # a lone surrogate goes out replaced
    assert run_python("print('\udcff')").ok  # ... and in the source too
    assert not Calculator().run("1+\udcff", LIMITS).ok


# --- formats ------------------------------------------------------------------------------------------
TOOLS = ("calculator", "python")


def test_tags_parse_the_first_call_only_of_known_tools() -> None:
    fmt = tool_format("tags")
    text = "Let me see. <calculator> 12*7 </calculator> and <python>print(1)</python>"
    assert fmt.parse(text, TOOLS) == ToolCall("calculator", "12*7")
    assert fmt.parse("<python>print(1)</python><calculator>1</calculator>", TOOLS) == ToolCall("python", "print(1)")
    assert fmt.parse("<search>cats</search>", TOOLS) is None
    assert fmt.parse("The answer is 84.", TOOLS) is None
    assert fmt.parse("<calculator>1+1</calculator>", ()) is None
    assert fmt.parse("so <calculator>12*7", TOOLS) == ToolCall("calculator", "12*7")  # cut at the stop string


def test_json_parses_calls_and_argument_objects() -> None:
    fmt = tool_format("json")
    assert fmt.parse('<tool_call>{"name": "calculator", "arguments": "1+2"}</tool_call>', TOOLS) == ToolCall(
        "calculator", "1+2"
    )
    obj = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*3"}}\n</tool_call>'
    assert fmt.parse(obj, TOOLS) == ToolCall("calculator", "3*3")
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}}</tool_call>'  # a stray brace
    assert fmt.parse(code, TOOLS) == ToolCall("python", "print(1)")
    assert fmt.parse('<tool_call>{"name": "search", "arguments": "x"}', TOOLS) == ToolCall("search", "x")
    assert fmt.parse('<tool_call>{"name": "calculator"}</tool_call>', TOOLS) == ToolCall("calculator", "")


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{name: calculator}</tool_call>",
        '<tool_call>{"name": "calculator", "arguments": "1+</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": "1"}</tool_call>',
        '<tool_call>{"name": 3, "arguments": "1"}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
        "<tool_call>" + "[" * 100_000,
        "<tool_call>",
    ],
)
def test_json_malformed_calls_are_not_calls(text: str) -> None:
    assert JsonFormat().parse(text, TOOLS) is None


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize(("tool", "arguments"), [("calculator", "12*7"), ("python", 'print("a</b>")\nx = {1: 2}')])
def test_example_round_trips_with_and_without_the_stop_string(name: str, tool: str, arguments: str) -> None:
    fmt = tool_format(name)
    example = fmt.example(tool, arguments)
    stops = [s for s in fmt.stop_strings(TOOLS) if s in example]
    assert stops, f"{name}: sampling would not stop after {example!r}"
    assert fmt.parse(example, TOOLS) == ToolCall(tool, arguments)
    stop = min(stops, key=example.index)
    assert example.endswith(stop)
    assert fmt.parse(example[: example.index(stop)], TOOLS) == ToolCall(tool, arguments)  # as a sampler returns it


def test_stop_strings() -> None:
    assert TagFormat().stop_strings(TOOLS) == ("</calculator>", "</python>")
    assert JsonFormat().stop_strings(TOOLS) == ("</tool_call>",)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":, calculatorpython_tool\\n1')), max_size=80))
def test_formats_never_raise(text: str) -> None:
    for fmt in FORMATS.values():
        call = fmt.parse(text, TOOLS)
        assert call is None or isinstance(call.arguments, str)


def test_describe_lists_the_tools_and_the_syntax() -> None:
    tools = [make_tool(name) for name in builtin_tools()]
    text = tool_format("tags").describe(tools, LIMITS)
    assert "<calculator>12*7</calculator>" in text and "<python>" in text and "At most 3 calls" in text
    assert '"name": "calculator"' in tool_format("json").describe(tools)
    assert tool_format("tags").describe([]) == ""


def test_unknown_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="tags, json"):
        tool_format("xml")
    with pytest.raises(ConfigError, match="calculator, python"):
        make_tool("search")
    assert builtin_tools() == ("calculator", "python")


# --- run_tool_call and limits ---------------------------------------------------------------------------
class Raising(Tool):
    name: ClassVar[str] = "raising"
    description: ClassVar[str] = "Raises."
    example_arguments: ClassVar[str] = ""

    def call(self, arguments: str, limits: ToolLimits) -> ToolResult:
        if arguments == "long":
            return ToolResult("z" * 10_000, True, 0.0)
        raise RuntimeError("broken")


def test_run_tool_call() -> None:
    tools = {"calculator": Calculator(), "raising": Raising()}
    unknown = run_tool_call(ToolCall("search", "cats"), tools, LIMITS)
    assert not unknown.ok and unknown.text == "error: unknown tool 'search'; the tools are: calculator, raising"
    product = run_tool_call(ToolCall("calculator", "6*7"), tools, LIMITS)
    assert (product.text, product.ok) == ("42", True) and 0 <= product.wall_s < 1
    long_args = run_tool_call(ToolCall("calculator", "1" * 2001), tools, LIMITS)
    assert not long_args.ok and "limit is 2000" in long_args.text
    broken = run_tool_call(ToolCall("raising", ""), tools, LIMITS)
    assert not broken.ok and "RuntimeError" in broken.text
    long = run_tool_call(ToolCall("raising", "long"), tools, LIMITS)
    assert len(long.text) == LIMITS.max_result_chars and long.text.endswith(TRUNCATED)
    assert not run_tool_call(ToolCall("x", ""), {}, LIMITS).ok


@pytest.mark.parametrize(
    "field",
    [
        {"max_calls_per_turn": -1},
        {"max_result_chars": 10},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"memory_mb": 8},
        {"max_argument_chars": 0},
    ],
)
def test_limits_are_checked(field: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="ToolLimits"):
        ToolLimits(**field)
