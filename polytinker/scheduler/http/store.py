"""What the HTTP gateway remembers across restarts: Tinker sessions, models and sampling sessions.

The Tinker SDK names a training run by a model id it can derive itself
(``SESSION:train:SEQ``) and a sampler by a session id the server chose, and a script keeps both
for as long as it runs, or writes them down (``tinker://`` paths). polytinker's own names are its
job ids and ``polytinker://`` paths; this table maps the former to the latter, per tenant (by the
hash of the API key), in ``gateway.sqlite`` under the runtime's state directory (mode 0600).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    last_heartbeat REAL NOT NULL);
CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, owner TEXT NOT NULL, job_id TEXT NOT NULL,
    base_model TEXT NOT NULL, lora_rank INTEGER NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS models_by_job ON models (job_id);
CREATE TABLE IF NOT EXISTS samplers (sampler_id TEXT PRIMARY KEY, owner TEXT NOT NULL, base_model TEXT NOT NULL,
    model_path TEXT NOT NULL, created REAL NOT NULL);
"""


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    owner: str
    job_id: str
    base_model: str
    lora_rank: int  # 0: full parameters


@dataclass(frozen=True)
class SamplerRow:
    sampler_id: str
    owner: str
    base_model: str
    model_path: str  # a polytinker:// path; "" samples the base model


class GatewayStore:
    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add_session(self, session_id: str, owner: str) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?)", (session_id, owner, now, now))

    def session_owner(self, session_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT owner FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else str(row[0])

    def heartbeat(self, session_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?", (time.time(), session_id))

    def add_model(self, row: ModelRow) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?)",
                (row.model_id, row.owner, row.job_id, row.base_model, row.lora_rank, time.time()),
            )

    def model(self, owner: str, model_id: str) -> ModelRow | None:
        """The model ``model_id`` of ``owner``; a model id or job id of another tenant reads as none."""
        with self._lock:
            row = self._db.execute(
                "SELECT model_id, owner, job_id, base_model, lora_rank FROM models"
                " WHERE (model_id = ? OR job_id = ?) AND owner = ?",
                (model_id, model_id, owner),
            ).fetchone()
        return None if row is None else ModelRow(*row)

    def models(self, owner: str) -> list[ModelRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT model_id, owner, job_id, base_model, lora_rank FROM models WHERE owner = ? ORDER BY created",
                (owner,),
            ).fetchall()
        return [ModelRow(*r) for r in rows]

    def add_sampler(self, row: SamplerRow) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO samplers VALUES (?, ?, ?, ?, ?)",
                (row.sampler_id, row.owner, row.base_model, row.model_path, time.time()),
            )

    def sampler(self, owner: str, sampler_id: str) -> SamplerRow | None:
        with self._lock:
            row = self._db.execute(
                "SELECT sampler_id, owner, base_model, model_path FROM samplers WHERE sampler_id = ? AND owner = ?",
                (sampler_id, owner),
            ).fetchone()
        return None if row is None else SamplerRow(*row)


__all__ = ["GatewayStore", "ModelRow", "SamplerRow"]
