"""Where a local runtime keeps its state, and which process holds it.

A state directory is one runtime's at a time. ``LocalRuntime.start`` takes an exclusive lock on
``STATE/runtime.lock`` (``flock``: the kernel lets go of it when the process dies, however it
dies) and, once up, writes ``STATE/runtime.json`` (0600, in the 0700 directory): its pid, the
address this machine's processes reach its scheduler at, and the API key of its generated
``local`` tenant when it has one. A second runtime on the same directory is refused with
``StateDirInUse``, which names the holder.

``ServiceClient()`` with no address and no runtime config keeps its state in
``default_state_dir(model)`` (``$POLYTINKER_STATE_DIR/<model>``, else
``<cache>/runtime/<model>``, the cache being ``$POLYTINKER_CACHE`` or ``~/.cache/polytinker``),
and attaches to the runtime that holds it when one runs: so the paths one script saved are
sampled by another while the first runs, and by the next runtime on that directory after it.
Every state directory is kept 0700 (``private_state_dir``): it holds every tenant's weights.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from polytinker.engine.models import ModelConfig
from polytinker.errors import StateDirInUse

log = logging.getLogger("polytinker.scheduler.state")

STATE_ENV = "POLYTINKER_STATE_DIR"
_LOCK = "runtime.lock"
_HOLDER = "runtime.json"


@dataclass(frozen=True)
class Holder:
    """The runtime that holds a state directory: what a client needs to reach it."""

    pid: int
    address: str
    api_key: str  # of its generated tenant; "" when its tenants were configured


def default_state_dir(model: str) -> Path:
    """The persistent state directory of the default runtime of ``model``."""
    env = os.environ.get(STATE_ENV)
    root = Path(env).expanduser() if env else ModelConfig().cache_dir / "runtime"
    return root / (re.sub(r"[^A-Za-z0-9_.-]", "_", model).lstrip(".")[:100] or "model")


class StateLock:
    """The exclusive hold of one runtime on its state directory (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Hold the directory, or raise StateDirInUse when a live runtime does."""
        fd = os.open(self.state_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(self.state_dir)
            who = f"the runtime of process {holder.pid} at {holder.address}" if holder else "a runtime starting up"
            raise StateDirInUse(
                f"state dir {self.state_dir} is in use by {who}: connect to it, or give this runtime another state_dir"
            ) from None
        self._fd = fd

    def publish(self, holder: Holder) -> None:
        """Say where the runtime that holds the directory is (once it is up)."""
        tmp = self.state_dir / f".{_HOLDER}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": holder.pid, "address": holder.address, "api_key": holder.api_key}, f)
        os.replace(tmp, self.state_dir / _HOLDER)

    def release(self) -> None:
        if self._fd is None:
            return
        (self.state_dir / _HOLDER).unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def read_holder(state_dir: Path) -> Holder | None:
    try:
        data = json.loads((Path(state_dir) / _HOLDER).read_text())
        return Holder(int(data["pid"]), str(data["address"]), str(data.get("api_key", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running_holder(state_dir: Path, wait_s: float = 300.0) -> Holder | None:
    """The live runtime that holds ``state_dir``, or None when none does. A runtime still starting
    (the lock held, ``runtime.json`` not yet written) is waited for, up to ``wait_s``."""
    lock = Path(state_dir) / _LOCK
    if not lock.exists():
        return None
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(state_dir)
            if holder is not None:
                return holder
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None  # nobody holds it
        finally:
            os.close(fd)
        if time.monotonic() > deadline:
            raise StateDirInUse(f"state dir {state_dir} is held by a runtime that did not come up in {wait_s:.0f} s")
        time.sleep(0.2)


def private_state_dir(path: str | Path) -> Path:
    """Create ``path`` (mode 0700), or make an existing one 0700: any user who could read it
    would read every tenant's adapters and checkpoints. A looser mode is tightened with a warning."""
    path = Path(path).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("state dir %s had mode %04o (other users could read it): changed to 0700", path, mode)
        path.chmod(0o700)
    return path


__all__ = [
    "STATE_ENV",
    "Holder",
    "StateDirInUse",
    "StateLock",
    "default_state_dir",
    "private_state_dir",
    "read_holder",
    "running_holder",
]
