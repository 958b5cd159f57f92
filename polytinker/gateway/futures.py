"""The futures the Tinker API hands out: a request id for each submitted call, polled until done.

Every training and sampling call of the Tinker API answers at once with a request id; the client
then polls ``retrieve_future`` with it. ``FutureTable`` keeps, per tenant, the running call's
``concurrent.futures.Future`` and how to render its result. A finished entry is dropped once it
was read, or ``ttl_s`` after it finished; a tenant can hold at most ``max_per_tenant``. A
``journal`` (the gateway's store) keeps each id from filing to dropping, so that a gateway started
again knows the calls its predecessor never answered (``GatewayStore.lost_request``).

The journal is written by a thread of its own (``JournalWriter``), never on the event loop: a
commit waits for the disk (milliseconds, tens of them while other processes write), and the loop
that waited would hold up every tenant's requests, a small sample's among them, behind it. What
queues up during one commit goes into the next, as one transaction. ``put`` still answers an id
only once it is written, so no client holds an id a restarted gateway would not know.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

from polytinker.errors import OverloadedError, TransportError

log = logging.getLogger("polytinker.http")


@dataclass
class Pending:
    """One submitted call: its future and the function that renders its result for the wire."""

    owner: str
    future: Future[Any]
    render: Callable[[Any], Any]
    created_s: float = field(default_factory=time.monotonic)
    done_s: float | None = None
    model_id: str | None = None  # the training run the call is for (its job's queue state answers try_again)


class RequestJournal(Protocol):
    def journal_requests(self, filed: list[tuple[str, str, str]], read: list[str]) -> None: ...


class JournalWriter:
    """Writes a ``RequestJournal`` on its own thread, in order, each batch in one transaction.

    ``file`` queues an id's row and returns a future that resolves once it is written; ``read``
    queues its deletion (nobody waits for that: an id left over only reads as lost to a restarted
    gateway that nobody asks about it). An id read before its row was written is never written.
    """

    def __init__(self, journal: RequestJournal) -> None:
        self._journal = journal
        self._cv = threading.Condition()
        self._filed: dict[str, tuple[str, str, Future[None]]] = {}  # request id -> (owner, kind, written)
        self._read: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="polytinker-http-journal", daemon=True)
        self._thread.start()

    def file(self, request_id: str, owner: str, kind: str) -> Future[None]:
        written: Future[None] = Future()
        with self._cv:
            if self._closed:  # the gateway stops: its store is about to close
                written.set_exception(TransportError("the gateway is stopping: send the call again"))
                return written
            self._filed[request_id] = (owner, kind, written)
            self._cv.notify()
        return written

    def read(self, request_id: str) -> None:
        with self._cv:
            if self._closed:
                return
            unwritten = self._filed.pop(request_id, None)
            if unwritten is None:
                self._read.append(request_id)
                self._cv.notify()
        if unwritten is not None:
            _settle(unwritten[2], None)  # nothing left to remember, nothing to wait for

    def close(self) -> None:
        """Write what is queued, then stop (before the journal's store closes)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(10.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._filed or self._read or self._closed):
                    self._cv.wait()
                filed, read, self._filed, self._read = self._filed, self._read, {}, []
                last = self._closed
            error: BaseException | None = None
            try:
                if filed or read:
                    self._journal.journal_requests([(r, o, k) for r, (o, k, _) in filed.items()], read)
            except Exception as exc:  # the callers waiting for it fail instead; the thread writes on
                log.error("the request journal could not be written: %r", exc)
                error = exc
            for _, _, written in filed.values():
                _settle(written, error)
            if last:
                return


def _settle(written: Future[None], error: BaseException | None) -> None:
    """Resolve ``written`` unless its waiter gave up (a cancelled request cancels it)."""
    try:
        if error is None:
            written.set_result(None)
        else:
            written.set_exception(error)
    except InvalidStateError:
        pass


class FutureTable:
    def __init__(
        self, *, ttl_s: float = 3600.0, max_per_tenant: int = 10_000, journal: RequestJournal | None = None
    ) -> None:
        self.ttl_s, self.max_per_tenant = ttl_s, max_per_tenant
        self._writer = JournalWriter(journal) if journal is not None else None
        # Set when the gateway stops: no result is answered from then on (a call cut off by the
        # stop would read as failed), so its id stays in the journal as lost.
        self.closing = threading.Event()
        self._entries: dict[str, Pending] = {}
        self._per_owner: dict[str, int] = {}
        self._lock = threading.Lock()

    async def put(
        self,
        owner: str,
        future: Future[Any],
        render: Callable[[Any], Any],
        kind: str = "train",
        model_id: str | None = None,
    ) -> str:
        """A new request id for ``future`` of tenant ``owner``, once the journal holds it; ``kind``
        ("sample" or "train") says what a restarted gateway does with it if it is lost (a sample
        is sent again); ``model_id``: the training run it is a call of, if any."""
        self._expire()
        with self._lock:
            if self._per_owner.get(owner, 0) >= self.max_per_tenant:
                raise OverloadedError(f"more than {self.max_per_tenant} unretrieved requests", 1.0)
            request_id = uuid.uuid4().hex
            entry = Pending(owner, future, render, model_id=model_id)
            self._entries[request_id] = entry
            self._per_owner[owner] = self._per_owner.get(owner, 0) + 1

        def finished(_: Future[Any]) -> None:
            entry.done_s = time.monotonic()

        future.add_done_callback(finished)
        if self._writer is not None:
            try:
                await asyncio.wrap_future(self._writer.file(request_id, owner, kind))
            except BaseException:
                self.drop(request_id)  # never answered: nobody will read it
                raise
        return request_id

    def get(self, owner: str, request_id: str) -> Pending | None:
        """The entry, when it exists and belongs to ``owner`` (another tenant's id reads as unknown)."""
        with self._lock:
            entry = self._entries.get(request_id)
        return entry if entry is not None and entry.owner == owner else None

    async def wait(self, entry: Pending, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the call; True when it is done (never once ``closing``)."""
        deadline = time.monotonic() + timeout_s
        if not entry.future.done():
            waiter = asyncio.wrap_future(entry.future)
            # The call's own error is retrieve_future's to report (from the future): marked seen
            # here, so that asyncio does not log it as never retrieved.
            waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
            while not waiter.done() and not self.closing.is_set() and (left := deadline - time.monotonic()) > 0:
                await asyncio.wait({waiter}, timeout=min(left, 0.5))  # wakes to see a closing gateway
        return entry.future.done() and not self.closing.is_set()

    def drop(self, request_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self._per_owner[entry.owner] -= 1
        if entry is not None and self._writer is not None:
            self._writer.read(request_id)

    def cancel(self, owner: str, request_id: str) -> bool:
        entry = self.get(owner, request_id)
        if entry is None:
            return False
        entry.future.cancel()  # a call already running finishes; its result is dropped
        self.drop(request_id)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [k for k, e in self._entries.items() if e.done_s is not None and now - e.done_s > self.ttl_s]
        for k in stale:
            self.drop(k)

    def close(self) -> None:
        """Write the journal's queued ids and stop its thread (before its store closes)."""
        if self._writer is not None:
            self._writer.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


__all__ = ["FutureTable", "JournalWriter", "Pending", "RequestJournal"]
