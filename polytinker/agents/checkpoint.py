"""Checkpoints of a run and ``--resume``.

``state.json`` in the run directory records, after each checkpoint: the next step, each trainable
agent's checkpoint path (``polytinker-ckpt://JOB/NAME``, from ``save_state``) and version, the
algorithms' own state (REINFORCE baselines), the league pool, and the sampler paths the pool
needs. The local runtime keeps its state (job table, checkpoints) under ``<run>/runtime`` with a
tenant key in ``<run>/runtime/tenant.key``, so a new runtime started by ``--resume`` finds them.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polytinker.errors import ConfigError

STATE_FILE = "state.json"


@dataclass
class RunState:
    step: int = 0
    # The first step still to run.
    checkpoints: dict[str, str] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    algorithms: dict[str, dict[str, Any]] = field(default_factory=dict)
    pool: dict[str, list[int]] = field(default_factory=dict)
    pool_paths: dict[str, str] = field(default_factory=dict)  # "agent@version" -> sampler path

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, run_dir / STATE_FILE)  # atomic: a crash leaves the old state whole

    @classmethod
    def load(cls, run_dir: Path) -> RunState:
        path = run_dir / STATE_FILE
        if not path.exists():
            raise ConfigError(f"nothing to resume in {run_dir}: no {STATE_FILE} (the run never reached a checkpoint)")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ConfigError(f"{path} is not a run state: {exc}") from exc


def tenant_key(runtime_dir: Path) -> str:
    """The local runtime's tenant key, made once per run (private to the user)."""
    path = runtime_dir / "tenant.key"
    if path.exists():
        return path.read_text().strip()
    # 0700 from the start: the runtime keeps its state here and would warn about (and tighten) a
    # directory that other users can read, which a fresh run must not see about its own directory.
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


__all__ = ["STATE_FILE", "RunState", "tenant_key"]
