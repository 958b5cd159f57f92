"""The gateway's table of pending calls (``FutureTable``) and its request journal, on the real
SQLite store (no scheduler, no HTTP): an id is answered only once the journal holds it, a read id
leaves it, and the journal's commits run on a thread of their own, so that a commit that waits
for the disk holds up no other tenant's request on the event loop; what queued up meanwhile goes
into the next commit, as one transaction."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from polytinker.errors import TransportError
from polytinker.gateway.futures import FutureTable
from polytinker.gateway.store import GatewayStore


class StallingJournal:
    """The real store, whose commits wait while ``stalled`` (a disk busy with other writes); each
    commit's ids are recorded."""

    def __init__(self, store: GatewayStore) -> None:
        self.store = store
        self.batches: list[tuple[list[str], list[str]]] = []
        self.entered = threading.Event()  # a commit started while stalled
        self._go = threading.Event()
        self._go.set()

    def stall(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def journal_requests(self, filed: list[tuple[str, str, str]], read: list[str]) -> None:
        if not self._go.is_set():
            self.entered.set()
            assert self._go.wait(30.0)
        self.batches.append(([f[0] for f in filed], list(read)))
        self.store.journal_requests(filed, read)


def _rows(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {r[0] for r in conn.execute("SELECT request_id FROM requests")}


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def test_an_id_is_journaled_before_it_is_answered_and_leaves_once_read(tmp_path: Path) -> None:
    db = tmp_path / "gateway.sqlite"
    table = FutureTable(journal=GatewayStore(db))

    async def calls() -> tuple[str, str]:
        read = await table.put("alice", _done(1), str, kind="sample")
        assert read in _rows(db)  # answered: a restarted gateway would know it
        lost = await table.put("alice", Future(), str, kind="sample")
        entry = table.get("alice", read)
        assert entry is not None and await table.wait(entry, 1.0)
        table.drop(read)
        return read, lost

    read, lost = asyncio.run(calls())
    table.close()  # writes what is queued
    assert _rows(db) == {lost}
    restarted = GatewayStore(db)
    assert restarted.lost_request("bob", lost) is None  # another tenant's id reads as unknown
    assert restarted.lost_request("alice", lost) == "sample"
    assert restarted.lost_request("alice", read) is None


def test_a_stalled_journal_commit_holds_up_no_other_request(tmp_path: Path) -> None:
    db = tmp_path / "gateway.sqlite"
    journal = StallingJournal(GatewayStore(db))
    table = FutureTable(journal=journal)

    async def calls() -> tuple[str, str, str]:
        finished = await table.put("alice", _done("alice's result"), str)
        journal.stall()
        bob = asyncio.create_task(table.put("bob", Future(), str, kind="sample"))
        assert await asyncio.to_thread(journal.entered.wait, 30.0)  # bob's row is being written
        # Meanwhile the loop serves: alice reads her finished call, carol files one.
        entry = table.get("alice", finished)
        assert entry is not None and await table.wait(entry, 1.0)
        assert entry.render(entry.future.result()) == "alice's result"
        table.drop(finished)
        carol = asyncio.create_task(table.put("carol", Future(), str))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not bob.done() and not carol.done()  # neither id is answered before it is written
        journal.release()
        return finished, await bob, await carol

    finished, bob, carol = asyncio.run(calls())
    table.close()
    # One commit each for alice's and bob's; carol's filing and alice's read queued up during
    # bob's and went in together.
    assert journal.batches == [([finished], []), ([bob], []), ([carol], [finished])]
    assert _rows(db) == {bob, carol}


def test_a_closed_table_files_no_call(tmp_path: Path) -> None:
    table = FutureTable(journal=GatewayStore(tmp_path / "gateway.sqlite"))
    table.close()
    with pytest.raises(TransportError, match="the gateway is stopping"):
        asyncio.run(table.put("alice", Future(), str))
    assert len(table) == 0  # the refused call left nothing to read
