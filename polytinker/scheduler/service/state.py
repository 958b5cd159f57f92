"""The scheduler's durable state: one SQLite database in WAL mode.

Tables:

- ``tenants``: name, SHA-256 of the API key, fair-share weight;
- ``jobs``: one row per job (tenant, kind, base model, agent, LoRA shape, state, priority, reason,
  the create call's request key: ``request_keys.py``);
  finished inference jobs are deleted with their events after a while (``JobManager.prune_finished``);
- ``adapters``: one row per adapter (tenant/job/agent): its latest version, checkpoint and export;
- ``adapter_versions``: every version's checkpoint and peft export (the ones kept on disk);
- ``checkpoints``: named ``save_state`` checkpoints per job;
- ``events``: the decision log (what the policy decided and why);
- ``usage``: per tenant, hour, kind, base model and job, the tokens (or saves) it used (``UsageMeter``);
- ``audit``: who did what to which saved weights (``AuditLog``): each row belongs to the tenant that
  acted and to the tenant that owns the weights;
- ``quarantined_jobs``: job rows that could not be read back (a value no request can store any
  more, written by an older version or by hand): moved here whole, with the reason, so the
  scheduler serves every other job instead of failing to start.

The rows it hands out (``JobRow``, ``AdapterRow``) and how each is read back: ``state_rows.py``.

Privacy: the state directory holds every tenant's weights and the job table, so
``home.private_state_dir`` keeps it 0700 (tightening a looser one, with a warning) and the database
file is created 0600 (SQLite gives its -wal and -shm files the database file's mode).

Every write is one transaction with ``synchronous=FULL``, so a row the scheduler acknowledged
survives a SIGKILL of the scheduler (and of the machine). The connection is shared by the handler
threads behind one lock: SQLite serialises writers anyway, and the statements are small.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from polytinker.scheduler.service.state_rows import AdapterRow, JobRow, adapter_from_row, job_from_row
from polytinker.scheduler.types import JobKind, JobState

log = logging.getLogger("polytinker.scheduler.state")

HISTORY_RETENTION_S = 90 * 86400.0  # how long audit rows and usage counts are kept (prune_history)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, weight REAL NOT NULL, created_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL, base_model TEXT NOT NULL,
    agent TEXT NOT NULL, lora TEXT NOT NULL, state TEXT NOT NULL, priority INTEGER NOT NULL,
    steps INTEGER NOT NULL, reason TEXT NOT NULL DEFAULT '', created_s REAL NOT NULL, updated_s REAL NOT NULL,
    max_staleness INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_s);
CREATE INDEX IF NOT EXISTS jobs_by_kind ON jobs (kind, state);
CREATE TABLE IF NOT EXISTS adapters (
    adapter_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, job_id TEXT NOT NULL, agent TEXT NOT NULL,
    version INTEGER NOT NULL, checkpoint TEXT NOT NULL, export_dir TEXT NOT NULL, updated_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS adapter_versions (
    adapter_key TEXT NOT NULL, version INTEGER NOT NULL, checkpoint TEXT NOT NULL, export_dir TEXT NOT NULL,
    created_s REAL NOT NULL, PRIMARY KEY (adapter_key, version));
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL, version INTEGER NOT NULL,
    created_s REAL NOT NULL, expires_s REAL, public INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, name));
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL NOT NULL, job_id TEXT NOT NULL, kind TEXT NOT NULL,
    reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL NOT NULL, event TEXT NOT NULL, actor TEXT NOT NULL,
    owner TEXT NOT NULL, job_id TEXT NOT NULL, path TEXT NOT NULL, details TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_actor ON audit (actor, time_s);
CREATE INDEX IF NOT EXISTS audit_by_owner ON audit (owner, time_s);
CREATE TABLE IF NOT EXISTS quarantined_jobs (
    job_id TEXT NOT NULL, row TEXT NOT NULL, reason TEXT NOT NULL, time_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, bucket_s REAL NOT NULL, kind TEXT NOT NULL, base_model TEXT NOT NULL, job_id TEXT NOT NULL,
    count INTEGER NOT NULL, PRIMARY KEY (tenant, bucket_s, kind, base_model, job_id));
"""
# (table, column, declaration) of the columns added since the first release, in the order added.
_ADDED_COLUMNS = (
    ("jobs", "max_staleness", "INTEGER NOT NULL DEFAULT 0"),
    ("checkpoints", "expires_s", "REAL"),
    ("checkpoints", "public", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "request_key", "TEXT NOT NULL DEFAULT ''"),
    ("jobs", "request_digest", "TEXT NOT NULL DEFAULT ''"),
)


class StateStore:
    """The SQLite database at ``path`` (created if missing, mode 0600)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Created 0600 before SQLite opens it (sqlite3 would make it 0644 under a usual umask);
        # one made by an older version is tightened.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self.path, 0o600)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring a database an older version wrote up to this schema (columns added since)."""
        for table, column, declaration in _ADDED_COLUMNS:
            if column not in {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
        # After the columns (an older database has none to index): one job per tenant and key.
        self._db.execute(
            "CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_request ON jobs (tenant, request_key) WHERE request_key != ''"
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, args))

    # --- tenants -------------------------------------------------------------------------------
    def upsert_tenant(self, name: str, key_hash: str, weight: float) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM tenants WHERE key_hash = ? AND name != ?", (key_hash, name))
            db.execute(
                "INSERT INTO tenants VALUES (?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET key_hash=excluded.key_hash, "
                "weight=excluded.weight",
                (name, key_hash, weight, time.time()),
            )

    def tenant_by_key_hash(self, key_hash: str) -> str | None:
        rows = self._query("SELECT name FROM tenants WHERE key_hash = ?", (key_hash,))
        return str(rows[0]["name"]) if rows else None

    def tenants(self) -> list[tuple[str, float]]:
        return [(str(r["name"]), float(r["weight"])) for r in self._query("SELECT name, weight FROM tenants")]

    # --- jobs ----------------------------------------------------------------------------------
    def insert_job(self, row: JobRow) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *(row.job_id, row.tenant, row.kind, row.base_model, row.agent, json.dumps(row.lora)),
                    *(row.state, row.priority, row.steps, row.reason, row.created_s, row.updated_s, row.max_staleness),
                    *(row.request_key, row.request_digest),
                ),
            )

    def set_job_state(self, job_id: str, state: JobState, reason: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, updated_s = ? WHERE job_id = ?",
                (state, reason, time.time(), job_id),
            )

    def job(self, job_id: str) -> JobRow | None:
        rows = self._readable(self._query("SELECT * FROM jobs WHERE job_id = ?", (job_id,)))
        return rows[0] if rows else None

    def jobs(self, tenant: str | None = None) -> list[JobRow]:
        if tenant is None:
            return self._readable(self._query("SELECT * FROM jobs ORDER BY created_s"))
        return self._readable(self._query("SELECT * FROM jobs WHERE tenant = ? ORDER BY created_s", (tenant,)))

    def job_for_request(self, tenant: str, request_key: str) -> JobRow | None:
        """The tenant's job that a create_job with ``request_key`` made, if any ("" names none)."""
        rows = self._query("SELECT * FROM jobs WHERE tenant = ? AND request_key = ?", (tenant, request_key or None))
        return next(iter(self._readable(rows)), None)

    def jobs_of(self, kind: JobKind, states: tuple[JobState, ...]) -> list[JobRow]:
        marks = ", ".join("?" * len(states))
        rows = self._query(f"SELECT * FROM jobs WHERE kind = ? AND state IN ({marks})", (kind, *states))
        return self._readable(rows)

    def _readable(self, rows: list[sqlite3.Row]) -> list[JobRow]:
        """The rows as JobRows; one that cannot be read is quarantined (see the module docstring)
        and left out, so one bad row never makes a tenant's list, or the scheduler's start, fail."""
        out = []
        for r in rows:
            try:
                out.append(job_from_row(r))
            except (ValueError, TypeError, OverflowError, KeyError) as exc:
                self._quarantine(r, f"{type(exc).__name__}: {exc}")
        return out

    def _quarantine(self, r: sqlite3.Row, reason: str) -> None:
        job_id = str(r["job_id"])
        with self._tx() as db:
            db.execute(
                "INSERT INTO quarantined_jobs VALUES (?, ?, ?, ?)",
                (job_id, json.dumps(dict(r), default=repr), reason[:2000], time.time()),
            )
            db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        log.warning("job %s cannot be read (%s): moved to quarantined_jobs; the other jobs are served", job_id, reason)

    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantined job rows: job id, the row as JSON, why, when."""
        return [dict(r) for r in self._query("SELECT * FROM quarantined_jobs ORDER BY time_s")]

    def delete_jobs(self, job_ids: list[str]) -> None:
        """Forget jobs and their events (finished inference jobs: nothing else refers to them)."""
        with self._tx() as db:
            db.executemany("DELETE FROM events WHERE job_id = ?", [(j,) for j in job_ids])
            db.executemany("DELETE FROM jobs WHERE job_id = ?", [(j,) for j in job_ids])

    # --- adapters ------------------------------------------------------------------------------
    def ensure_adapter(self, key: str, tenant: str, job_id: str, agent: str) -> AdapterRow:
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO adapters VALUES (?, ?, ?, ?, 0, '', '', ?)",
                (key, tenant, job_id, agent, time.time()),
            )
        row = self.adapter(key)
        assert row is not None
        return row

    def adapter(self, key: str) -> AdapterRow | None:
        rows = self._query("SELECT * FROM adapters WHERE adapter_key = ?", (key,))
        if not rows:
            return None
        return adapter_from_row(rows[0])

    def adapters(self, tenant: str) -> list[AdapterRow]:
        rows = self._query("SELECT adapter_key FROM adapters WHERE tenant = ? ORDER BY adapter_key", (tenant,))
        return [a for a in (self.adapter(r["adapter_key"]) for r in rows) if a is not None]

    def record_version(self, key: str, version: int, checkpoint: str, export_dir: str) -> None:
        """A new version is durable on disk: make it the adapter's current one, in one transaction."""
        now = time.time()
        with self._tx() as db:
            db.execute(
                "UPDATE adapters SET version = ?, checkpoint = ?, export_dir = ?, updated_s = ? WHERE adapter_key = ?",
                (version, checkpoint, export_dir, now, key),
            )
            db.execute(
                "INSERT OR REPLACE INTO adapter_versions VALUES (?, ?, ?, ?, ?)",
                (key, version, checkpoint, export_dir, now),
            )

    def set_export(self, key: str, version: int, export_dir: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE adapters SET export_dir = ? WHERE adapter_key = ? AND version = ?", (export_dir, key, version)
            )
            db.execute(
                "UPDATE adapter_versions SET export_dir = ? WHERE adapter_key = ? AND version = ?",
                (export_dir, key, version),
            )

    def version_row(self, key: str, version: int) -> tuple[str, str] | None:
        """(checkpoint, export_dir) of one kept version."""
        rows = self._query(
            "SELECT checkpoint, export_dir FROM adapter_versions WHERE adapter_key = ? AND version = ?", (key, version)
        )
        return (str(rows[0]["checkpoint"]), str(rows[0]["export_dir"])) if rows else None

    def version_checkpoints(self, key: str) -> list[str]:
        """The checkpoint path of each kept version of an adapter."""
        rows = self._query("SELECT checkpoint FROM adapter_versions WHERE adapter_key = ?", (key,))
        return [str(r["checkpoint"]) for r in rows]

    def drop_versions_below(self, key: str, version: int, keep: Collection[str] = ()) -> list[tuple[str, str]]:
        """Forget versions older than ``version``, but those whose export is in ``keep`` (a named
        sampler's: it stays sampleable); returns the forgotten ones' (checkpoint, export_dir)."""
        with self._tx() as db:
            rows = list(
                db.execute(
                    "SELECT version, checkpoint, export_dir FROM adapter_versions"
                    " WHERE adapter_key = ? AND version < ?",
                    (key, version),
                )
            )
            doomed = [r for r in rows if str(r["export_dir"]) not in keep]
            db.executemany(
                "DELETE FROM adapter_versions WHERE adapter_key = ? AND version = ?",
                [(key, r["version"]) for r in doomed],
            )
        return [(str(r["checkpoint"]), str(r["export_dir"])) for r in doomed]

    # --- checkpoints and events ------------------------------------------------------------------
    def add_checkpoint(self, job_id: str, name: str, path: str, version: int, expires_s: float | None = None) -> None:
        """A named checkpoint; ``expires_s`` (a Unix time) deletes it then, None keeps it."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, name, path, version, created_s, expires_s)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, name, path, version, time.time(), expires_s),
            )

    def set_checkpoint_expiry(self, job_id: str, name: str, expires_s: float | None) -> bool:
        """Whether the job has checkpoint ``name`` (whose expiry is then set)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE checkpoints SET expires_s = ? WHERE job_id = ? AND name = ?", (expires_s, job_id, name)
            )
            return cur.rowcount > 0

    def set_checkpoint_public(self, job_id: str, name: str, public: bool) -> bool:
        """Whether the job has checkpoint ``name`` (which every tenant may then read, or only its own)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE checkpoints SET public = ? WHERE job_id = ? AND name = ?", (int(public), job_id, name)
            )
            return cur.rowcount > 0

    def checkpoint_public(self, job_id: str, name: str) -> bool:
        rows = self._query("SELECT public FROM checkpoints WHERE job_id = ? AND name = ?", (job_id, name))
        return bool(rows and rows[0]["public"])

    def version_public(self, job_id: str, version: int, sampler_prefix: str) -> bool:
        """Whether a published named sampler save (a name starting with ``sampler_prefix``) of the
        job stands on ``version``: that version is then sampleable by every tenant."""
        rows = self._query(
            "SELECT 1 FROM checkpoints WHERE job_id = ? AND version = ? AND public = 1 AND substr(name, 1, ?) = ?",
            (job_id, version, len(sampler_prefix), sampler_prefix),
        )
        return bool(rows)

    def expired_checkpoints(self, now: float) -> list[tuple[str, str]]:
        """(job id, name) of the checkpoints whose expiry has passed."""
        rows = self._query(
            "SELECT job_id, name FROM checkpoints WHERE expires_s IS NOT NULL AND expires_s <= ?", (now,)
        )
        return [(str(r["job_id"]), str(r["name"])) for r in rows]

    def checkpoint(self, job_id: str, name: str) -> tuple[str, int] | None:
        rows = self._query("SELECT path, version FROM checkpoints WHERE job_id = ? AND name = ?", (job_id, name))
        return (str(rows[0]["path"]), int(rows[0]["version"])) if rows else None

    def delete_checkpoint(self, job_id: str, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE job_id = ? AND name = ?", (job_id, name))

    def checkpoint_in_use(self, path: str) -> bool:
        """Whether an adapter's kept version was loaded from (or is) the checkpoint at ``path``."""
        rows = self._query(
            "SELECT 1 FROM adapter_versions WHERE checkpoint = ? UNION SELECT 1 FROM adapters WHERE checkpoint = ?",
            (path, path),
        )
        return bool(rows)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT name, path, version, created_s, expires_s, public FROM checkpoints WHERE job_id = ?", (job_id,)
        )
        return [dict(r) for r in rows]

    def log_event(self, job_id: str, kind: str, reason: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO events (time_s, job_id, kind, reason) VALUES (?, ?, ?, ?)",
                (time.time(), job_id, kind, reason),
            )

    def events(self, job_id: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT time_s, kind, reason FROM events WHERE job_id = ? ORDER BY id DESC LIMIT ?", (job_id, limit)
        )
        return [dict(r) for r in reversed(rows)]

    def add_audit(self, event: str, actor: str, owner: str, job_id: str, path: str, details: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO audit (time_s, event, actor, owner, job_id, path, details) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), event, actor, owner, job_id, path, json.dumps(details, sort_keys=True)),
            )

    def audit(self, tenant: str, start_s: float, end_s: float, prefix: str, limit: int) -> list[dict[str, Any]]:
        """The audit rows ``tenant`` acted in or owns, in [start_s, end_s), whose event starts with
        ``prefix``; oldest first, at most ``limit``."""
        rows = self._query(
            "SELECT time_s, event, actor, owner, job_id, path, details FROM audit"
            " WHERE (actor = ? OR owner = ?) AND time_s >= ? AND time_s < ? AND substr(event, 1, ?) = ?"
            " ORDER BY id LIMIT ?",
            (tenant, tenant, start_s, end_s, len(prefix), prefix, limit),
        )
        return [{**dict(r), "details": json.loads(r["details"])} for r in rows]

    def prune_history(self, before_s: float) -> int:
        """Delete the audit rows and usage counts older than ``before_s``; how many."""
        with self._tx() as db:
            n = db.execute("DELETE FROM audit WHERE time_s < ?", (before_s,)).rowcount
            return int(n + db.execute("DELETE FROM usage WHERE bucket_s < ?", (before_s,)).rowcount)

    def add_usage(self, rows: list[tuple[str, float, str, str, str, int]]) -> None:
        """Add (tenant, bucket_s, kind, base_model, job_id, count) rows to the counts kept."""
        with self._tx() as db:
            db.executemany(
                "INSERT INTO usage (tenant, bucket_s, kind, base_model, job_id, count) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT DO UPDATE SET count = count + excluded.count",
                rows,
            )

    def usage(self, tenant: str, start_s: float, end_s: float) -> list[dict[str, Any]]:
        rows = self._query(
            "SELECT bucket_s, kind, base_model, job_id, count FROM usage WHERE tenant = ? AND bucket_s >= ?"
            " AND bucket_s < ? ORDER BY bucket_s, kind, job_id",
            (tenant, start_s, end_s),
        )
        return [dict(r) for r in rows]


__all__ = ["HISTORY_RETENTION_S", "StateStore"]
