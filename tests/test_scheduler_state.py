"""The scheduler service's SQLite state (``StateStore``) and its tenants (``Tenants``): a WAL
database whose adapter versions survive a reopen, tenants stored by key hash only and
authenticated by API key or Curve key, and an older database migrated to the newer columns."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest
from _scheduler_helpers import KEY_A, KEY_B

from polytinker.errors import ConfigError
from polytinker.scheduler.service import AuthError, StateStore, TenantConfig
from polytinker.scheduler.service.tenants import Tenants, hash_key


def test_state_is_wal_and_durable_across_reopen(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    store = StateStore(db)
    store.ensure_adapter("alice/j1/a", "alice", "j1", "a")
    store.record_version("alice/j1/a", 1, "/c/v1", "/e/v1")
    store.record_version("alice/j1/a", 2, "/c/v2", "/e/v2")
    assert store.drop_versions_below("alice/j1/a", 2) == [("/c/v1", "/e/v1")]
    store.close()
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    again = StateStore(db)
    row = again.adapter("alice/j1/a")
    assert row is not None and (row.version, row.checkpoint, row.export_dir) == (2, "/c/v2", "/e/v2")
    assert again.version_row("alice/j1/a", 1) is None and again.version_row("alice/j1/a", 2) == ("/c/v2", "/e/v2")


def test_tenants_store_only_key_hashes(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.sqlite3")
    tenants = Tenants(store)
    tenants.add(TenantConfig("alice", api_key=KEY_A))
    assert tenants.authenticate(KEY_A) == "alice"
    for bad in ("", "nope-nope-nope-nope", None, 42):
        with pytest.raises(AuthError):
            tenants.authenticate(bad)
    tenants.add(TenantConfig("carol", curve_public_key="c" * 40))
    assert tenants.authenticate("", "c" * 40) == "carol"  # no API key: the admitted Curve key decides
    assert tenants.authenticate(KEY_A, "c" * 40) == "alice"  # an API key takes precedence
    with pytest.raises(AuthError):
        tenants.authenticate("", "d" * 40)
    with pytest.raises(ConfigError, match="exactly one"):
        TenantConfig("dave", api_key=KEY_B, curve_public_key="c" * 40)
    dump = "\n".join(store._db.iterdump())
    assert KEY_A not in dump and hash_key(KEY_A) in dump


def test_a_database_without_the_newer_columns_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """CREATE TABLE jobs (job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL,
        base_model TEXT NOT NULL, agent TEXT NOT NULL, lora TEXT NOT NULL, state TEXT NOT NULL,
        priority INTEGER NOT NULL, steps INTEGER NOT NULL, reason TEXT NOT NULL DEFAULT '',
        created_s REAL NOT NULL, updated_s REAL NOT NULL);
        INSERT INTO jobs VALUES ('j1', 'alice', 'lora_rl', 'tiny-random', 'a', '{}', 'running', 0, 5, '', 1.0, 2.0);
        CREATE TABLE checkpoints (job_id TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
        version INTEGER NOT NULL, created_s REAL NOT NULL, PRIMARY KEY (job_id, name));
        INSERT INTO checkpoints VALUES ('j1', 'kept', 'checkpoints/x', 3, 1.0);"""
    )
    db.commit()
    db.close()
    store = StateStore(path)
    try:
        row = store.job("j1")
        assert row is not None and row.max_staleness == 0 and row.steps == 5
        assert row.request_key == "" and store.job_for_request("alice", "") is None  # made with no key
        store.insert_job(dataclasses.replace(row, job_id="j2", request_key="k1", request_digest="d"))
        found = store.job_for_request("alice", "k1")
        assert found is not None and found.job_id == "j2" and store.job_for_request("bob", "k1") is None
        assert [c["expires_s"] for c in store.checkpoints("j1")] == [None]  # an old checkpoint never expires
        assert store.set_checkpoint_expiry("j1", "kept", 5.0) and store.expired_checkpoints(6.0) == [("j1", "kept")]
    finally:
        store.close()
