"""What the HTTP gateway remembers across restarts: Tinker sessions (their last heartbeat, how
they finished, and those finished whose runs and holds are not yet let go: ``sessions.py``),
models and sampling sessions, the user metadata the SDK attached to them, the checkpoints saved
through it (a named sampler save's version too), and the request ids of calls not yet read back
(so that a restarted gateway can say which calls it lost).

The Tinker SDK names a training run by a model id it can derive itself
(``SESSION:train:SEQ``) and a sampler by a session id the server chose, and a script keeps both
for as long as it runs, or writes them down (``tinker://`` paths). polytinker's own names are its
job ids and ``polytinker://`` paths; this table maps the former to the latter, per tenant (by the
hash of the API key), in ``gateway.sqlite`` under the runtime's state directory (mode 0600).
"""

from __future__ import annotations

import json
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
CREATE TABLE IF NOT EXISTS user_metadata (id TEXT PRIMARY KEY, metadata TEXT NOT NULL, display_name TEXT);
CREATE TABLE IF NOT EXISTS sampler_sessions (sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS finished_sessions (session_id TEXT PRIMARY KEY, status TEXT NOT NULL,
    detail TEXT, finished REAL NOT NULL);
CREATE TABLE IF NOT EXISTS saved (job_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    tinker_path TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (job_id, kind, name));
CREATE TABLE IF NOT EXISTS external_recipients (job_id TEXT NOT NULL, name TEXT NOT NULL,
    recipients TEXT NOT NULL, PRIMARY KEY (job_id, name));
CREATE TABLE IF NOT EXISTS ending_sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sampler_names (job_id TEXT NOT NULL, name TEXT NOT NULL, model_path TEXT NOT NULL,
    PRIMARY KEY (job_id, name));
CREATE TABLE IF NOT EXISTS requests (request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL,
    created REAL NOT NULL);
"""


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    owner: str
    job_id: str
    base_model: str
    lora_rank: int  # 0: full parameters


@dataclass(frozen=True)
class SavedRow:
    """A checkpoint saved through the gateway: ``kind`` "training" (save_state), "sampler"
    (save_weights_for_sampler with a name) or "external" (save_weights_external), its name, its
    ``tinker://`` path (an external save's: the sampler path of its version) and when."""

    job_id: str
    kind: str
    name: str
    tinker_path: str
    created: float


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

    # --- request ids -------------------------------------------------------------------------------
    # A request id is written when a call is filed and deleted when its result is read (or dropped),
    # so the ids left in the table at a gateway's start are the calls an earlier process lost.
    def journal_requests(self, filed: list[tuple[str, str, str]], read: list[str]) -> None:
        """One transaction (one wait for the disk, however many ids): the ``filed`` calls'
        ``(request_id, owner, kind)`` added, the ``read`` ones' ids deleted."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT INTO requests VALUES (?, ?, ?, ?)", [(*f, now) for f in filed])
                self._db.executemany("DELETE FROM requests WHERE request_id = ?", [(r,) for r in read])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def lost_request(self, owner: str, request_id: str) -> str | None:
        """The kind of a call of ``owner``'s that an earlier gateway process filed and never
        answered (it is forgotten now: each is reported once); None for any other id."""
        with self._lock:
            row = self._db.execute(
                "DELETE FROM requests WHERE request_id = ? AND owner = ? RETURNING kind", (request_id, owner)
            ).fetchone()
        return None if row is None else str(row[0])

    def forget_requests_before(self, when: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM requests WHERE created < ?", (when,))

    def add_session(self, session_id: str, owner: str) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?)", (session_id, owner, now, now))

    def session_owner(self, session_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT owner FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else str(row[0])

    def finish_session(self, session_id: str, status: str, detail: str | None) -> bool:
        """The first finish of a session stands (Tinker's: first wins); whether this was it. A
        first finish also files the session as ending (``endings``) in the same transaction: what
        ending it does is done, or done again after a restart, until ``ended``."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO finished_sessions VALUES (?, ?, ?, ?)",
                    (session_id, status, detail, time.time()),
                )
                first = cur.rowcount > 0
                if first:
                    self._db.execute(
                        "INSERT OR IGNORE INTO ending_sessions SELECT session_id, owner FROM sessions"
                        " WHERE session_id = ?",
                        (session_id,),
                    )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return first

    def endings(self) -> list[tuple[str, str]]:
        """(session id, owner) of the finished sessions whose runs and holds are not yet let go."""
        with self._lock:
            rows = self._db.execute("SELECT session_id, owner FROM ending_sessions").fetchall()
        return [(str(r[0]), str(r[1])) for r in rows]

    def ended(self, session_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM ending_sessions WHERE session_id = ?", (session_id,))

    def silent_sessions(self, before: float) -> list[str]:
        """Open sessions whose last heartbeat (or start) was before ``before``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE last_heartbeat < ?"
                " AND session_id NOT IN (SELECT session_id FROM finished_sessions)",
                (before,),
            ).fetchall()
        return [str(r[0]) for r in rows]

    def refresh_heartbeats(self) -> int:
        """Count every open session as heard from now (a restarted gateway heard nothing while it
        was down); how many there are."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE sessions SET last_heartbeat = ?"
                " WHERE session_id NOT IN (SELECT session_id FROM finished_sessions)",
                (time.time(),),
            )
        return int(cur.rowcount)

    def session_finished(self, session_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT 1 FROM finished_sessions WHERE session_id = ?", (session_id,)).fetchone()
        return row is not None

    def heartbeat(self, session_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?", (time.time(), session_id))

    def last_heartbeat(self, session_id: str) -> float | None:
        with self._lock:
            row = self._db.execute("SELECT last_heartbeat FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else float(row[0])

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

    def model_created(self, model_id: str) -> float:
        with self._lock:
            row = self._db.execute("SELECT created FROM models WHERE model_id = ?", (model_id,)).fetchone()
        return 0.0 if row is None else float(row[0])

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

    def add_sampler_session(self, sampler_id: str, session_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sampler_sessions VALUES (?, ?)", (sampler_id, session_id))

    def session_samplers(self, session_id: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT s.sampler_id FROM sampler_sessions s JOIN samplers USING (sampler_id)"
                " WHERE s.session_id = ? ORDER BY samplers.created",
                (session_id,),
            ).fetchall()
        return [str(r[0]) for r in rows]

    def sessions(self, owner: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id FROM sessions WHERE owner = ? ORDER BY created", (owner,)
            ).fetchall()
        return [str(r[0]) for r in rows]

    def set_metadata(self, id_: str, metadata: dict[str, str], display_name: str | None = None) -> None:
        """A session's or a model's user metadata (and a session's display name), as the SDK sent them."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO user_metadata VALUES (?, ?, ?)", (id_, json.dumps(metadata), display_name)
            )

    def metadata(self, id_: str) -> tuple[dict[str, str] | None, str | None]:
        with self._lock:
            row = self._db.execute("SELECT metadata, display_name FROM user_metadata WHERE id = ?", (id_,)).fetchone()
        return (None, None) if row is None else (json.loads(row[0]), row[1])

    def add_saved(self, row: SavedRow) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO saved VALUES (?, ?, ?, ?, ?)",
                (row.job_id, row.kind, row.name, row.tinker_path, row.created),
            )

    def add_sampler_name(self, job_id: str, name: str, model_path: str) -> None:
        """``save_weights_for_sampler(name)`` of the job saved the version at ``model_path``."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sampler_names VALUES (?, ?, ?)", (job_id, name, model_path))

    def sampler_name(self, job_id: str, name: str) -> str | None:
        """The ``polytinker://`` path of the job's named sampler save ``name``; None if none."""
        with self._lock:
            row = self._db.execute(
                "SELECT model_path FROM sampler_names WHERE job_id = ? AND name = ?", (job_id, name)
            ).fetchone()
        return None if row is None else str(row[0])

    def delete_saved(self, job_id: str, kind: str, name: str) -> None:
        with self._lock:
            # A deleted sampler save's path keeps naming its version, which samples while it is kept
            # (as a version's own path does): sampler_names keeps its row.
            self._db.execute("DELETE FROM saved WHERE job_id = ? AND kind = ? AND name = ?", (job_id, kind, name))
            if kind == "external":
                self._db.execute("DELETE FROM external_recipients WHERE job_id = ? AND name = ?", (job_id, name))

    def set_recipients(self, job_id: str, name: str, recipients: list[str]) -> None:
        """The age recipients an external save's files are encrypted to (none: plain files)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO external_recipients VALUES (?, ?, ?)", (job_id, name, json.dumps(recipients))
            )

    def recipients(self, job_id: str, name: str) -> list[str]:
        with self._lock:
            row = self._db.execute(
                "SELECT recipients FROM external_recipients WHERE job_id = ? AND name = ?", (job_id, name)
            ).fetchone()
        return [] if row is None else [str(r) for r in json.loads(row[0])]

    def saved(self, job_id: str) -> list[SavedRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, kind, name, tinker_path, created FROM saved WHERE job_id = ? ORDER BY created",
                (job_id,),
            ).fetchall()
        return [SavedRow(*r) for r in rows]

    def sampler(self, owner: str, sampler_id: str) -> SamplerRow | None:
        with self._lock:
            row = self._db.execute(
                "SELECT sampler_id, owner, base_model, model_path FROM samplers WHERE sampler_id = ? AND owner = ?",
                (sampler_id, owner),
            ).fetchone()
        return None if row is None else SamplerRow(*row)


__all__ = ["GatewayStore", "ModelRow", "SamplerRow", "SavedRow"]
