"""Holds on saved versions: a version some client may still sample is not pruned.

A per-step version goes when training moves ``keep_checkpoints`` past it (``WeightsCatalog.prune``),
unless a name stands on it or a client holds it. A hold is (tenant, holder, adapter, version):
``holder`` is the client's name for what holds it (the HTTP gateway holds each version a Tinker
session's samplers sample, under the session's id), and the tenant's ``release`` of a holder drops
all of its holds at once (the gateway's, when the session ends). Holds live in the scheduler's
database, so they outlive a restart of the scheduler; they are per tenant (one tenant cannot
release another's), and a hold on a published version of another tenant's keeps it as well.

A holder holds at most ``max_held_versions`` versions (``RuntimeConfig``): a Tinker RL loop makes
a sampler per step for as long as its session lives, and without a bound each would keep its
version on disk. Past the bound the holder's oldest hold goes (a version held again counts as new),
and that version is kept only as any other is (``keep_checkpoints``, ``sampler_keep_s``, a name).

A version handed out for sampling (``save_weights``) is kept ``sampler_keep_s`` from then: its
hand-out is a row of the same table under the holder ``HANDED_OUT`` (a name no client can hold
under), so a restarted scheduler counts the window from the hand-out, not from its own start, and
``forget_handouts`` drops the rows whose window has passed.
"""

from __future__ import annotations

import time

from polytinker.scheduler.service.state import StateStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS weight_holds (
    tenant TEXT NOT NULL, holder TEXT NOT NULL, adapter_key TEXT NOT NULL, version INTEGER NOT NULL,
    created_s REAL NOT NULL, PRIMARY KEY (tenant, holder, adapter_key, version));
CREATE INDEX IF NOT EXISTS weight_holds_by_adapter ON weight_holds (adapter_key, version);
"""


HANDED_OUT = ""  # the holder of hand-out rows: check_name refuses "" to every client


class WeightHolds:
    """The ``weight_holds`` table, in the scheduler's database (it shares the store's connection
    and lock, so its writes are transactions like the store's own)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        with store._tx() as db:
            for statement in _SCHEMA.strip().split(";"):
                if statement.strip():
                    db.execute(statement)

    def hold(self, tenant: str, holder: str, adapter_key: str, version: int, limit: int = 0) -> list[tuple[str, int]]:
        """The holder holds the version (again: as its newest hold). With ``limit``, its holds past
        the newest ``limit`` go; returns the (adapter key, version) they were on."""
        with self.store._tx() as db:
            db.execute(
                "INSERT INTO weight_holds VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO UPDATE SET created_s = excluded.created_s",
                (tenant, holder, adapter_key, version, time.time()),
            )
            if limit <= 0:
                return []
            released = db.execute(
                "DELETE FROM weight_holds WHERE rowid IN (SELECT rowid FROM weight_holds"
                " WHERE tenant = ? AND holder = ? ORDER BY created_s DESC, rowid DESC LIMIT -1 OFFSET ?)"
                " RETURNING adapter_key, version",
                (tenant, holder, limit),
            )
            return [(str(r[0]), int(r[1])) for r in released]

    def release(self, tenant: str, holder: str) -> list[str]:
        """Drop every hold of the tenant's ``holder``; the adapters they were on (to prune again)."""
        with self.store._tx() as db:
            rows = list(
                db.execute(
                    "DELETE FROM weight_holds WHERE tenant = ? AND holder = ? RETURNING adapter_key", (tenant, holder)
                )
            )
        return sorted({str(r[0]) for r in rows})

    def held(self, adapter_key: str, handed_out_since: float = 0.0) -> set[int]:
        """The adapter's versions some holder holds, or that were handed out since ``handed_out_since``
        (a Unix time)."""
        rows = self.store._query(
            "SELECT DISTINCT version FROM weight_holds WHERE adapter_key = ? AND (holder != ? OR created_s >= ?)",
            (adapter_key, HANDED_OUT, handed_out_since),
        )
        return {int(r[0]) for r in rows}

    def handed_out(self, tenant: str, adapter_key: str, version: int) -> None:
        """The tenant's version was handed out for sampling now (again: its window starts again)."""
        self.hold(tenant, HANDED_OUT, adapter_key, version)

    def forget_handouts(self, adapter_key: str, before_s: float) -> None:
        """Drop the adapter's hand-outs older than ``before_s`` (a Unix time): their window has passed."""
        with self.store._tx() as db:
            db.execute(
                "DELETE FROM weight_holds WHERE adapter_key = ? AND holder = ? AND created_s < ?",
                (adapter_key, HANDED_OUT, before_s),
            )

    def count(self, tenant: str, holder: str) -> int:
        rows = self.store._query("SELECT COUNT(*) FROM weight_holds WHERE tenant = ? AND holder = ?", (tenant, holder))
        return int(rows[0][0])


__all__ = ["HANDED_OUT", "WeightHolds"]
