"""Where a worker keeps a job's weights: paths made from ids, under the worker's own state root.

No message names a filesystem path. The scheduler names stored weights by ids (``WeightsRef`` in
``messages``: the adapter key ``TENANT/JOB/AGENT``, a version, a kind and an optional name), and
each worker turns them into a path under the state root it was started with (the runtime's
``state_dir`` for local workers; ``polytinker worker --state-dir`` on another machine):

    checkpoints/TENANT/JOB/AGENT/v<N>                a step's learner state (weights + optimizer)
    checkpoints/TENANT/JOB/AGENT/named/<NAME>        a save_state checkpoint
    adapters/TENANT/JOB/AGENT/v<N>                   a step's peft export (what engines load)
    adapters/TENANT/JOB/AGENT/v<N>-loaded-<NAME>     the export made after load_state of <NAME>
    state-id                                         the runtime's state: written once by its scheduler

``state-id`` lets a worker started elsewhere (another node, ``polytinker worker --state-dir``)
tell the scheduler whether it sees the same state root (``Register.state_id``): a learner that
does not keeps its checkpoints where no other learner finds them.

Every part is checked against ``NAME_PATTERN`` (letters, digits, ``_ - .``, not starting with a
dot), so no id can name ``..`` or a separator and no path leaves the root. The relative path is
also the text the scheduler stores in its database for a version's checkpoint and export.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from polytinker.errors import ConfigError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
KINDS = ("checkpoint", "export")
_TOP = {"checkpoint": "checkpoints", "export": "adapters"}
STATE_ID = "state-id"
_LEAF = re.compile(rf"v(\d+)(?:-loaded-({NAME_PATTERN.pattern}))?|named/({NAME_PATTERN.pattern})")


def check_name(what: str, value: object) -> str:
    """``value`` if it is a name that is safe as one path component; ConfigError otherwise."""
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise ConfigError(f"{what} {value!r}: use 1-128 letters, digits, '_', '-' or '.', not starting with '.'")
    return value


def check_adapter_key(value: object) -> str:
    """An adapter key ``TENANT/JOB/AGENT`` whose three parts are names (see ``check_name``)."""
    parts = value.split("/") if isinstance(value, str) else []
    if len(parts) != 3 or any(NAME_PATTERN.fullmatch(p) is None for p in parts):
        raise ConfigError(f"adapter {value!r}: need TENANT/JOB/AGENT, each part a name (letters, digits, '_-.')")
    return str(value)


def relative_path(adapter: str, version: int, kind: str, name: str = "") -> str:
    """The path of a version's weights relative to a state root (the module docstring's table)."""
    top = f"{_TOP[kind]}/{check_adapter_key(adapter)}"
    if not name:
        return f"{top}/v{version}"
    check_name("weights name", name)
    return f"{top}/named/{name}" if kind == "checkpoint" else f"{top}/v{version}-loaded-{name}"


def parse_relative(text: str) -> tuple[str, str, int | None, str]:
    """(adapter key, kind, version or None for a named checkpoint, name) of ``relative_path``'s text."""
    parts = text.split("/")
    kind = next((k for k, top in _TOP.items() if parts[0] == top), None)
    leaf = _LEAF.fullmatch("/".join(parts[4:])) if len(parts) >= 5 else None
    if kind is None or leaf is None:
        raise ConfigError(f"stored weights {text!r} are not a path this runtime makes")
    adapter = check_adapter_key("/".join(parts[1:4]))
    if leaf.group(3) is not None:
        if kind != "checkpoint":
            raise ConfigError(f"stored weights {text!r}: only checkpoints are named")
        return adapter, kind, None, leaf.group(3)
    if leaf.group(2) is not None and kind != "export":
        raise ConfigError(f"stored weights {text!r}: only exports are made after a load")
    return adapter, kind, int(leaf.group(1)), leaf.group(2) or ""


def under(root: Path, relative: str) -> Path:
    """``root / relative``, refused unless every part of ``relative`` is a name (no ``..``, no
    absolute path): what a worker writes or reads stays inside its root."""
    if any(NAME_PATTERN.fullmatch(p) is None for p in relative.split("/")):
        raise ConfigError(f"weights path {relative!r} is not a path under the state root")
    return root.expanduser() / relative


def read_state_id(root: str | os.PathLike[str]) -> str:
    """The id of the runtime state at ``root`` ('' where there is none: not this runtime's, or
    a directory not shared with its scheduler)."""
    try:
        text = (Path(root).expanduser() / STATE_ID).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return text if re.fullmatch(r"[0-9a-f]{32}", text) else ""


def ensure_state_id(root: str | os.PathLike[str]) -> str:
    """The id of the runtime state at ``root``, made the first time ('' where ``root`` does not
    exist yet)."""
    root = Path(root).expanduser()
    if (known := read_state_id(root)) or not root.is_dir():
        return known
    tmp = root / f".{STATE_ID}.{os.getpid()}"
    tmp.write_text(secrets.token_hex(16), encoding="ascii")
    os.replace(tmp, root / STATE_ID)
    return read_state_id(root)


__all__ = [
    "KINDS",
    "NAME_PATTERN",
    "STATE_ID",
    "check_adapter_key",
    "check_name",
    "ensure_state_id",
    "parse_relative",
    "read_state_id",
    "relative_path",
    "under",
]
