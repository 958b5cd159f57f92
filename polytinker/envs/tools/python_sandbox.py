"""The ``python`` tool: the model's Python source in a sandboxed child interpreter.

Each call gets a fresh interpreter (``_sandbox_child.py``: ``python -I -S -X utf8 -u``) in a
throwaway working directory that is removed afterwards, with an empty environment (no variable
of the runtime reaches it), stdin closed, in a new session whose whole process group is killed
at ``ToolLimits.timeout_s``. Inside, before the code runs: a new network namespace (only a
loopback that is down), root dropped to ``SANDBOX_UID``, no-new-privileges, and resource limits
(RLIMIT_AS = ``memory_mb``, RLIMIT_CPU, RLIMIT_FSIZE = ``MAX_FILE_BYTES``, RLIMIT_NOFILE =
``MAX_OPEN_FILES``, RLIMIT_NPROC = 1: no fork, no threads, no core dumps). Output is read with a
cap: a flood is cut (and the code stopped) instead of read into memory. docs/tools.md says
exactly what this isolates and what it does not.

``sandbox_report()`` runs a probe once per process and caches which of those steps this kernel
and user allow; later calls require the steps the probe found working (fail closed) and go on
without the others (best effort, logged once).

The result: stdout (the value of a last bare expression is printed too, as in a REPL); on an
error also the last line of the traceback (``ok=False``); ``(no output)`` when nothing printed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from polytinker.envs.tools._sandbox_child import SETUP_FAILED, SETUP_MARK
from polytinker.envs.tools.base import Tool, ToolLimits, ToolResult, truncate

SANDBOX_UID = 65534
"""The uid (and gid) the code runs as when the runtime runs as root: ``nobody`` on Linux."""
MAX_FILE_BYTES = 1 << 20
"""RLIMIT_FSIZE: the largest file the code may write."""
MAX_OPEN_FILES = 32
"""RLIMIT_NOFILE: descriptors the code may hold open."""
NO_OUTPUT = "(no output)"
_STDERR_TAIL_BYTES = 4096
_CHILD = Path(__file__).with_name("_sandbox_child.py")
_PROBE_TIMEOUT_S = 20.0
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxReport:
    """What the sandbox achieves on this machine, measured once from inside a probe child."""

    network_isolated: bool
    """A new network namespace: only ``lo``, so no socket reaches any host."""
    user_dropped: bool
    """The runtime runs as root and the code runs as ``SANDBOX_UID``."""
    forks_refused: bool
    """RLIMIT_NPROC holds: the code cannot start processes or threads."""
    uid: int
    """The uid the code runs as."""
    notes: tuple[str, ...] = ()
    """Why a step did not work, one line each."""
    required: tuple[str, ...] = ()
    """The setup steps every later call requires (those that worked at the probe)."""


_report: SandboxReport | None = None
_report_lock = threading.Lock()


def sandbox_report() -> SandboxReport:
    """The sandbox's abilities here (probed on the first call, then cached for the process)."""
    global _report
    with _report_lock:
        if _report is None:
            _report = _probe()
            if not _report.network_isolated:
                _log.warning(
                    "python tool: no network namespace here (%s); sandboxed code can open sockets",
                    "; ".join(_report.notes) or "unknown reason",
                )
        return _report


def _probe() -> SandboxReport:
    config = {"probe": True, "cpu_s": 10, "memory_mb": 256, "fsize_bytes": MAX_FILE_BYTES, "nofile": MAX_OPEN_FILES}
    try:
        done = subprocess.run(
            _command(config), env={}, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S
        )
        found: dict[str, Any] = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        steps: dict[str, str] = found["steps"]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError) as exc:
        return SandboxReport(False, False, False, os.getuid(), notes=(f"the probe failed: {exc}",))
    network = steps.get("net") == "" and found.get("interfaces") == ["lo"]
    notes = tuple(f"{step}: {error}" for step, error in steps.items() if error)
    required = tuple(step for step in ("net", "drop_uid", "rlimits") if steps.get(step) == "")
    return SandboxReport(
        network_isolated=network,
        user_dropped=steps.get("drop_uid") == "",
        forks_refused=bool(found.get("fork_refused")),
        uid=int(found.get("uid", -1)),
        notes=notes,
        required=required,
    )


def _command(config: dict[str, Any]) -> list[str]:
    return [sys.executable or "python3", "-I", "-S", "-X", "utf8", "-u", str(_CHILD), json.dumps(config)]


def _source(arguments: str) -> str:
    """The code to run: a Markdown fence around it (small models write one) is dropped, and a
    common indent removed."""
    lines = arguments.strip().splitlines()
    if lines and lines[0].startswith("```"):
        lines = lines[1:]
        if lines and lines[-1].strip() == "```":
            lines = lines[:-1]
    return textwrap.dedent("\n".join(lines))


@dataclass
class _Output:
    stdout: bytearray
    stderr_tail: bytearray
    flooded: bool = False
    timed_out: bool = False


def _read(proc: subprocess.Popen[bytes], deadline: float, stdout_cap: int) -> _Output:
    """Read both pipes until they close, the deadline passes or stdout passes ``stdout_cap``
    bytes; of stderr only the tail is kept."""
    out = _Output(bytearray(), bytearray())
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "out")
        selector.register(proc.stderr, selectors.EVENT_READ, "err")
        while selector.get_map() and not out.flooded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                out.timed_out = True
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.data == "out":
                    out.stdout += chunk
                    out.flooded = len(out.stdout) > stdout_cap
                else:
                    out.stderr_tail += chunk
                    del out.stderr_tail[:-_STDERR_TAIL_BYTES]
    return out


def _exited_by(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Whether the child exits by the deadline. It is left unreaped (a zombie keeps its process
    group id), so the group killed after it is still the child's."""
    if not hasattr(os, "waitid"):  # not Linux: reap now; killing the group after is best effort
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _error_line(returncode: int, out: _Output, timeout_s: float) -> str:
    """What went wrong, one line ('' for nothing)."""
    if out.timed_out:
        return f"error: timed out after {timeout_s:g} s"
    if out.flooded or returncode == 0:
        return ""
    tail = out.stderr_tail.decode("utf-8", "replace").strip().splitlines()
    last = tail[-1].strip() if tail else ""
    if returncode == SETUP_FAILED and last.startswith(SETUP_MARK):
        _log.error("python tool: the sandbox could not be set up: %s", last)
        return "error: the sandbox could not be set up; the code did not run"
    if returncode == -signal.SIGXCPU:
        return "error: CPU time limit exceeded"
    if returncode < 0:
        return f"error: the interpreter was killed ({_signal_name(-returncode)})"
    return last or f"error: exit status {returncode}"


def _compose(stdout: str, error: str, max_chars: int) -> str:
    """stdout then the error line, within ``max_chars``; the error line is kept whole where it fits."""
    stdout = stdout.rstrip("\n")
    if not error:
        return truncate(stdout, max_chars) if stdout else NO_OUTPUT
    error = truncate(error, max_chars // 2)
    if not stdout:
        return error
    return f"{truncate(stdout, max_chars - len(error) - 1)}\n{error}"


def _config(limits: ToolLimits, report: SandboxReport) -> dict[str, Any]:
    return {
        "cpu_s": math.ceil(limits.timeout_s) + 1,
        "memory_mb": limits.memory_mb,
        "fsize_bytes": MAX_FILE_BYTES,
        "nofile": MAX_OPEN_FILES,
        "uid": SANDBOX_UID,
        "require": list(report.required),
    }


def run_sandboxed(source: str, limits: ToolLimits) -> ToolResult:
    """Run ``source`` in the sandbox; never raises."""
    report = sandbox_report()
    start = time.monotonic()
    workdir = ""
    try:
        workdir = tempfile.mkdtemp(prefix="polytinker-python-")
        main = Path(workdir, "main.py")
        main.write_text(source, encoding="utf-8", errors="replace")
        if report.user_dropped:
            # The child's own, whatever the umask (the runtime's processes run with 0o077): a
            # main.py left to root at 0600 would be unreadable after the switch to the sandbox user.
            for path in (workdir, main):
                os.chown(path, SANDBOX_UID, SANDBOX_UID)
        text, ok = _run_child(workdir, limits, report, start + limits.timeout_s)
    except OSError as exc:
        text, ok = f"error: could not start the interpreter ({exc.strerror or exc})", False
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return ToolResult(text, ok, time.monotonic() - start)


def _run_child(workdir: str, limits: ToolLimits, report: SandboxReport, deadline: float) -> tuple[str, bool]:
    with subprocess.Popen(
        _command(_config(limits, report)),
        cwd=workdir,
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, killed whole below
        close_fds=True,
    ) as proc:
        try:
            out = _read(proc, deadline, stdout_cap=4 * limits.max_result_chars + 64)
            if not (out.flooded or out.timed_out):
                out.timed_out = not _exited_by(proc, deadline)
        finally:
            _kill_group(proc.pid)  # whatever is left of the group; the leader is not reaped yet
            returncode = proc.wait()
    error = _error_line(returncode, out, limits.timeout_s)
    ok = not error
    return _compose(out.stdout.decode("utf-8", "replace"), error, limits.max_result_chars), ok


class PythonTool(Tool):
    name: ClassVar[str] = "python"
    description: ClassVar[str] = (
        "Runs Python source (standard library, no network, no files kept, a few seconds) and returns what it "
        "prints; the value of a last bare expression is printed too."
    )
    example_arguments: ClassVar[str] = "print(sum(range(1, 11)))"

    def call(self, arguments: str, limits: ToolLimits) -> ToolResult:
        try:
            return run_sandboxed(_source(arguments), limits)
        except Exception as exc:  # never raise into the rollout loop
            _log.exception("python tool failed")
            return ToolResult.error(f"the python tool failed ({type(exc).__name__})")


__all__ = [
    "MAX_FILE_BYTES",
    "MAX_OPEN_FILES",
    "NO_OUTPUT",
    "SANDBOX_UID",
    "PythonTool",
    "SandboxReport",
    "run_sandboxed",
    "sandbox_report",
]
