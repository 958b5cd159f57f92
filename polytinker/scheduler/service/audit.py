"""The audit log: who did what to which saved weights, and when (``sched.audit_log``).

Each act on a tenant's saved weights is one row of the scheduler's ``audit`` table, written in the
same process that did it, right after it succeeded:

- ``checkpoint_create``: ``save_state``, a named ``save_weights_for_sampler``, a ``copy_checkpoint``;
- ``checkpoint_read``: ``load_state`` (and so ``create_training_client_from_state``), an export
  (``checkpoints export``, the Tinker API's downloads), the source of a copy, and sampling or
  scoring a saved version: once per reader, version and UTC day, since one row per call would
  bury the rest; ``details["purpose"]`` says which;
- ``checkpoint_delete``, ``checkpoint_expire`` (its TTL ran out), ``checkpoint_publish``,
  ``checkpoint_unpublish`` and ``checkpoint_ttl_set``.

A tenant's log holds the rows it acted in and the rows about weights it owns: the owner of a
published checkpoint sees every other tenant's reads of it. Event names follow Tinker's
``<resource>_<action>``, so the Tinker API serves this log to its admin client as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

from polytinker.model_path import SAMPLER_NAME_PREFIX, CheckpointPath, ModelPath
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.state_rows import JobRow

MAX_ENTRIES = 10_000  # rows in one answer: a day with more says so (truncated)
EXPIRY_ACTOR = "scheduler"  # who acts when a TTL runs out
_PREFIX = {"all": "", "checkpoints": "checkpoint_"}  # other event types: none here


def saved_path(job: JobRow, name: str, version: int) -> str:
    """The path a tenant names a job's checkpoint ``name`` by: a named sampler save's version
    (``polytinker://``), or a ``save_state`` checkpoint (``polytinker-ckpt://``)."""
    if name.startswith(SAMPLER_NAME_PREFIX):
        return str(ModelPath(job.job_id, job.agent, version))
    return str(CheckpointPath(job.job_id, name))


class AuditLog:
    def __init__(self, store: StateStore, tenant: Callable[[str], str]) -> None:
        self.store = store
        self._tenant = tenant  # the tenant of an API key (AuthError for none)
        self._lock = threading.Lock()
        self._sampled: set[tuple[str, str, str]] = set()  # (UTC day, reader, path) logged today
        self._sampled_day = ""

    def record(self, event: str, actor: str, job: JobRow, path: str, **details: Any) -> None:
        """One row: ``actor`` did ``event`` to the weights at ``path``, saved by ``job``."""
        self.store.add_audit(event, actor, job.tenant, job.job_id, path, details)

    def checkpoint(self, event: str, actor: str, job: JobRow, name: str, version: int, **details: Any) -> None:
        """``record`` for a job's named checkpoint."""
        self.record(event, actor, job, saved_path(job, name, version), name=name, version=version, **details)

    def sampled(self, actor: str, model_path: str) -> None:
        """A sample or score of a saved version (a path the caller resolved): a ``checkpoint_read``
        the first time this reader reads it this UTC day (a set in memory: a restart logs it again)."""
        parsed = ModelPath.parse(model_path)
        path, day = str(parsed), datetime.now(UTC).date().isoformat()
        with self._lock:
            if day != self._sampled_day:
                self._sampled, self._sampled_day = set(), day
            if (day, actor, path) in self._sampled:
                return
            self._sampled.add((day, actor, path))
        job = self.store.job(parsed.job_id)
        if job is not None:
            self.record("checkpoint_read", actor, job, path, version=parsed.version, purpose="sample")

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {m.AuditLog: self.audit_log}

    def audit_log(self, msg: m.AuditLog) -> r.AuditLogReply:
        tenant = self._tenant(msg.api_key)
        day = date.fromisoformat(msg.day) if msg.day else datetime.now(UTC).date()  # checked at the edge
        prefix = _PREFIX.get(msg.event_type)
        if prefix is None:
            return r.AuditLogReply([], False)
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        end = start + timedelta(days=1)
        rows = self.store.audit(tenant, start.timestamp(), end.timestamp(), prefix, MAX_ENTRIES + 1)
        fields = ("time_s", "event", "actor", "owner", "job_id", "path", "details")
        entries = [r.AuditEntry(*(row[f] for f in fields)) for row in rows[:MAX_ENTRIES]]
        return r.AuditLogReply(entries, len(rows) > MAX_ENTRIES)


__all__ = ["EXPIRY_ACTOR", "MAX_ENTRIES", "AuditLog", "saved_path"]
