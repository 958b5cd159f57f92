"""The rows the scheduler's state hands out (``StateStore``, ``state.py``), and how each is read
back from its SQLite row.

- ``JobRow``: one row of the ``jobs`` table, what a tenant's job is (``JobRow.public`` is what the
  tenant sees of it); ``job_from_row`` reads one, and raises (``ValueError``, ``TypeError``,
  ``OverflowError``, ``KeyError``) on a row no request can store any more: one an older version or
  a hand wrote. The store then quarantines that row (the ``quarantined_jobs`` table) instead of
  failing a tenant's list or the scheduler's start.
- ``AdapterRow``: one row of the ``adapters`` table, an adapter's current version, checkpoint and
  export; ``adapter_from_row`` reads one.

Kinds and states are stored as their string values and read back as ``JobKind`` and ``JobState``;
a job's LoRA shape as a JSON object.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from polytinker.scheduler.types import JobKind, JobState


@dataclass(frozen=True)
class JobRow:
    job_id: str
    tenant: str
    kind: JobKind  # stored as its string value, as is ``state``
    base_model: str
    agent: str
    lora: dict[str, Any]
    state: JobState
    priority: int
    steps: int
    reason: str
    created_s: float
    updated_s: float
    max_staleness: int = 0  # RL jobs: how many steps the client's sampling may run ahead of training
    request_key: str = ""  # the create_job call's key, with a digest of its fields (request_keys.py)
    request_digest: str = ""

    def lora_shape(self) -> dict[str, Any] | None:
        """A LoRA job's adapter shape (rank, alpha, target_modules, seed): what a new job resuming
        one of its checkpoints needs; None for the other kinds."""
        return dict(self.lora) if self.kind in (JobKind.LORA_RL, JobKind.SFT) else None

    def public(self) -> dict[str, Any]:
        """What a tenant sees of its job."""
        return {
            "job_id": self.job_id,
            "kind": str(self.kind),  # plain strings, whichever transport carries the map
            "base_model": self.base_model,
            "agent": self.agent,
            "state": str(self.state),
            "priority": self.priority,
            "steps": self.steps,
            "max_staleness": self.max_staleness,
            "reason": self.reason,
            "created_s": self.created_s,
            "updated_s": self.updated_s,
        }


@dataclass(frozen=True)
class AdapterRow:
    adapter_key: str
    tenant: str
    job_id: str
    agent: str
    version: int
    checkpoint: str  # "" until the first optimizer step
    export_dir: str  # "" until the first export


def job_from_row(r: sqlite3.Row) -> JobRow:
    """The job a ``jobs`` row holds; raises if the row cannot be read (see the module docstring)."""
    lora = json.loads(r["lora"])
    if not isinstance(lora, dict) or not isinstance(r["job_id"], str) or not isinstance(r["tenant"], str):
        raise TypeError("job_id and tenant must be text, lora a JSON object")
    return JobRow(
        job_id=r["job_id"],
        tenant=r["tenant"],
        kind=JobKind(r["kind"]),
        base_model=r["base_model"],
        agent=r["agent"],
        lora=lora,
        state=JobState(r["state"]),
        priority=int(r["priority"]),
        steps=int(r["steps"]),
        reason=r["reason"],
        created_s=float(r["created_s"]),
        updated_s=float(r["updated_s"]),
        max_staleness=int(r["max_staleness"]),
        request_key=str(r["request_key"]),
        request_digest=str(r["request_digest"]),
    )


def adapter_from_row(r: sqlite3.Row) -> AdapterRow:
    """The adapter an ``adapters`` row holds."""
    return AdapterRow(
        r["adapter_key"], r["tenant"], r["job_id"], r["agent"], int(r["version"]), r["checkpoint"], r["export_dir"]
    )


__all__ = ["AdapterRow", "JobRow", "adapter_from_row", "job_from_row"]
