"""The sandboxed interpreter of the ``python`` tool (run as a script, never imported by the package).

``python -I -S -X utf8 _sandbox_child.py CONFIG_JSON`` in a fresh working directory that holds
``main.py``, with an empty environment, stdin closed, in its own session. In this order it
imports the preloaded modules (the model's code may use them even where the interpreter's
files are not readable by the sandbox user), leaves the network (a new network namespace: as
root directly, else inside a new user namespace), drops root to the sandbox user, sets
no-new-privileges and the resource limits, then runs ``main.py`` like a REPL cell: the value of
a last bare expression is printed. A setup step the parent found working at its probe is
required: if it fails now, the child exits with ``SETUP_FAILED`` before running any code.

With ``{"probe": true}`` it runs no code and prints, as JSON, what the setup achieved,
measured from inside (network interfaces, uid, whether a fork is refused).

Standard library only: this file runs under ``-S`` (no site-packages) and ``-I``.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import random
import resource
import socket
import sys
import traceback
from typing import Any

SETUP_FAILED = 121
SETUP_MARK = "polytinker-sandbox-setup:"
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
# Imported before the setup, for the model's code (see the module docstring); about 20 ms in all.
_PRELOADED = (
    "array",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "itertools",
    "math",
    "operator",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "time",
    "unicodedata",
)


def _unshare(flags: int) -> str:
    if not hasattr(_libc, "unshare") or _libc.unshare(flags) != 0:
        return os.strerror(ctypes.get_errno()) or "unshare not available"
    return ""


def _prctl(option: int, value: int) -> bool:
    return hasattr(_libc, "prctl") and _libc.prctl(option, value, 0, 0, 0) == 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _user_netns() -> str:
    """A new user namespace that maps the current ids onto themselves, and a network namespace
    inside it: what an unprivileged process may do where the kernel allows it."""
    uid, gid = os.getuid(), os.getgid()
    _prctl(_PR_SET_DUMPABLE, 1)  # after setuid, /proc/self is root's until this
    error = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if not error:
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as exc:
            error = f"id maps: {exc}"
    _prctl(_PR_SET_DUMPABLE, 0)  # other sandboxes of the same user may not ptrace this one
    return error


def _setup(config: dict[str, Any]) -> dict[str, str]:
    """The isolation steps; returns {step: error text ('' when it worked)}."""
    steps: dict[str, str] = {}
    want_net = config.get("net", True)
    if want_net and os.geteuid() == 0 and config.get("direct_netns", True):
        steps["net"] = _unshare(_CLONE_NEWNET)
    if os.geteuid() == 0:
        uid = gid = int(config.get("uid", 65534))
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            steps["drop_uid"] = ""
        except OSError as exc:
            steps["drop_uid"] = str(exc)
    if want_net and steps.get("net", "not tried"):
        steps["net"] = _user_netns()
    steps["no_new_privs"] = "" if _prctl(_PR_SET_NO_NEW_PRIVS, 1) else "prctl refused"
    steps["rlimits"] = _limits(config)
    return steps


def _limits(config: dict[str, Any]) -> str:
    cpu_s = int(config["cpu_s"])
    memory = int(config["memory_mb"]) << 20
    limits = [
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_FSIZE, (int(config["fsize_bytes"]),) * 2),
        (resource.RLIMIT_NOFILE, (int(config["nofile"]),) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (1, 1)),  # this process only: no fork, no threads
    ]
    errors = []
    for which, value in limits:
        try:
            resource.setrlimit(which, value)
        except (OSError, ValueError) as exc:
            errors.append(f"{which}: {exc}")
    return "; ".join(errors)


def _probe(steps: dict[str, str]) -> None:
    report: dict[str, Any] = {
        "steps": steps,
        "uid": os.getuid(),
        "interfaces": [name for _, name in socket.if_nameindex()],
    }
    try:
        pid = os.fork()
    except OSError:
        report["fork_refused"] = True
    else:
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        report["fork_refused"] = False
    print(json.dumps(report))


def _run(source: str) -> None:
    """Run ``source`` as ``__main__``; a last bare expression's value is printed (REPL style)."""
    scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(source, filename="<python>")
        last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        if last is not None:
            tree.body.pop()
        exec(compile(tree, "<python>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<python>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:
        sys.stdout.flush()
        lines = traceback.format_exception_only(type(exc), exc)
        sys.stderr.write(lines[-1] if lines else type(exc).__name__ + "\n")
        sys.exit(1)


def main() -> None:
    config = json.loads(sys.argv[1])
    for name in _PRELOADED:
        __import__(name)
    steps = _setup(config)
    if config.get("probe"):
        _probe(steps)
        return
    failed = {step: steps.get(step, "not tried") for step in config.get("require", ()) if steps.get(step, "not tried")}
    if failed:
        sys.stderr.write(f"{SETUP_MARK} {json.dumps(failed)}\n")
        sys.exit(SETUP_FAILED)
    with open("main.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    sys.argv = ["<python>"]
    random.seed(0)  # the same code gives the same numbers (str hashes stay randomised: -I ignores PYTHONHASHSEED)
    _run(source)


__all__ = ["SETUP_FAILED", "SETUP_MARK", "main"]

if __name__ == "__main__":
    main()
