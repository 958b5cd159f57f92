"""Where in an env's own code an exception came from, for the messages of aborted episodes.

An env's failure passes through the coordinator, the text-env bases, PettingZoo's wrappers, the
env server and asyncio before anyone sees it; the frame an env author needs is the innermost one
in *their* code. ``env_location(exc)`` gives it as ``"mypkg/games.py:42 in _apply"``;
``env_traceback(exc)`` the traceback from the first frame of the env's code inwards;
``env_hook(exc)`` the hook polytinker called that led there (the outermost frame of the env's
code). A hook that *returned* something wrong raised nothing in the env's code:
``hook_location(env, "_render")`` gives where the game defines it (``"mypkg/games.py:40"``).
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
from pathlib import Path

from polytinker.errors import PolytinkerError

_ENVS = Path(__file__).resolve().parent
# The machinery around an env: frames here are never "the env's code". The games and the
# PettingZoo adapter are envs (their frames count), the bases and the drivers are not.
_OWN = tuple(
    str(p)
    for p in (
        _ENVS / "base.py",
        _ENVS / "coordinator.py",
        _ENVS / "checker.py",
        _ENVS / "play.py",
        _ENVS / "opponents.py",
        _ENVS / "registry.py",
        _ENVS / "source.py",
        _ENVS / "_trace.py",
        _ENVS / "remote",
        _ENVS.parent / "transport",
    )
)
_LIBRARIES = ("pettingzoo/utils/", "pettingzoo/test/", "gymnasium/", "numpy/")
_STDLIB = sysconfig.get_paths()["stdlib"]


def _is_machinery(filename: str) -> bool:
    path = str(Path(filename).resolve()) if filename and not filename.startswith("<") else filename
    if path.startswith(_OWN) or any(part in path.replace(os.sep, "/") for part in _LIBRARIES):
        return True
    return path.startswith(_STDLIB) and "site-packages" not in path


def _env_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(exc.__traceback__)
    first = next((i for i, f in enumerate(frames) if not _is_machinery(f.filename)), None)
    return [] if first is None else list(frames[first:])


def _shown_path(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith("..") else relative


def env_location(exc: BaseException) -> str:
    """``"FILE:LINE in FUNCTION"`` of the innermost frame of the env's own code, or ``""`` (an error
    polytinker raised itself, such as a remote server's answer, carries its own words)."""
    if isinstance(exc, PolytinkerError):
        return ""
    frames = [f for f in _env_frames(exc) if not _is_machinery(f.filename)]
    if not frames:
        return ""
    last = frames[-1]
    return f"{_shown_path(last.filename)}:{last.lineno} in {last.name}"


def env_hook(exc: BaseException) -> str:
    """The function of the outermost frame of the env's own code (the hook polytinker called, such
    as ``_apply``), or ``""``."""
    frames = [] if isinstance(exc, PolytinkerError) else _env_frames(exc)
    return frames[0].name if frames else ""


def hook_location(obj: object, name: str) -> str:
    """``"FILE:LINE"`` where ``obj``'s method ``name`` is defined (the ``def`` line), or ``""`` for
    one that has no Python source (a builtin, a C extension)."""
    function = getattr(getattr(obj, name, None), "__func__", None) or getattr(obj, name, None)
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    if code is None:
        return ""
    return f"{_shown_path(code.co_filename)}:{code.co_firstlineno}"


def describe_failure(exc: BaseException) -> str:
    """``"TYPE: MESSAGE (at FILE:LINE in FUNCTION)"``: how an aborted episode names its cause."""
    where = env_location(exc)
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} (at {where})" if where else text


def env_traceback(exc: BaseException, *, indent: str = "    ") -> str:
    """The traceback from the first frame of the env's code inwards (all of it when none is;
    none for an error polytinker raised itself outside the env's code, such as a remote
    server's answer: its message says where)."""
    frames = _env_frames(exc)
    if not frames and isinstance(exc, PolytinkerError):
        return ""
    frames = frames or list(traceback.extract_tb(exc.__traceback__))
    lines = traceback.format_list(frames[-12:])  # bounded: a deep recursion prints its end
    body = "".join(lines).rstrip("\n").splitlines()
    return "\n".join(f"{indent}{line}" for line in body)


__all__ = ["describe_failure", "env_hook", "env_location", "env_traceback", "hook_location"]
