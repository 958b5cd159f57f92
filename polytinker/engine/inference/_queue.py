"""The engine's queue: one lane per tenant, batches filled round-robin across tenants.

A tenant's work waits in its own lane in arrival order. A batch is filled in rounds: in each
round every tenant with waiting work adds its oldest request that still fits (sequences and
adapter slots), the tenant served longest ago first. So a tenant with one small request waits
for at most the batch in progress, however many chunks another tenant has queued, and a tenant
with many requests gets one more turn per round, not the whole batch.

A job (``compute_logprobs``, ``pin``) runs alone, between batches or between two decode steps of
a batch in progress, when its tenant's turn comes with the job at the head of its lane; a
tenant's requests queued after its job wait for it, so each tenant's work keeps its order.
Callers that name no tenant share the lane ``""``, which keeps the plain arrival order with a job
as a barrier.

Not thread-safe: the engine holds its condition's lock around every call.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from polytinker.engine.types import AdapterRef, SampleRequest

# Tenants whose last turn is remembered: one that comes back after more tenants than this were
# served is treated as never served (first in line), which is what it would get anyway.
MAX_REMEMBERED_TENANTS = 4096


@dataclass
class Pending:
    """A queued request or chunk of one (``request`` set), or a job to run alone on the worker thread."""

    future: Future[Any]
    arrived_s: float
    request: SampleRequest | None = None
    job: Callable[[], Any] | None = None
    refs: tuple[AdapterRef | None, ...] = ()  # versions held until it completes
    tenant: str = ""  # whose work it is: batches take turns across tenants

    @property
    def rows(self) -> int:
        return self.request.num_samples if self.request is not None else 0

    @property
    def tokens(self) -> int:
        """The most tokens it draws: its work in a decode loop."""
        return self.rows * self.request.params.max_tokens if self.request is not None else 0


@dataclass(frozen=True)
class Joining:
    """Requests are to join a batch in progress, so each must fit beside it (rows and slots).

    ``strict``: the first tenant in line comes first. If its oldest request does not fit yet,
    nothing else is taken: the batch drains until it does, so a big request is never passed over
    for good by a stream of small ones. ``exclude``: tenants not to take from (those that already
    have work in the batch, when only newcomers may run beside a full one); then a request that
    does not fit is passed over."""

    strict: bool = True
    exclude: frozenset[str] = frozenset()
    tokens_below: int | None = None  # the requests taken draw fewer tokens than this in all


class FairQueue:
    """Lanes of :class:`Pending` per tenant; :meth:`take` makes the next batch (or job)."""

    def __init__(self) -> None:
        self._lanes: dict[str, deque[Pending]] = {}
        self._served: dict[str, int] = {}  # tenant -> turn number of its last batch, oldest first
        self._turn = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, items: Sequence[Pending]) -> None:
        for item in items:
            self._lanes.setdefault(item.tenant, deque()).append(item)
        self._size += len(items)

    def _requests(self, tenant: str) -> Iterator[Pending]:
        """A lane's requests up to its first job."""
        return itertools.takewhile(lambda p: p.request is not None, self._lanes[tenant])

    def waiting_rows(self) -> int:
        """Sequences a batch could take now."""
        return sum(p.rows for tenant in self._lanes for p in self._requests(tenant))

    def oldest_s(self) -> float:
        return min(lane[0].arrived_s for lane in self._lanes.values())

    def _order(self) -> list[str]:
        """Tenants with waiting work, the one served longest ago (or never) first."""
        return sorted(self._lanes, key=lambda t: (self._served.get(t, -1), self._lanes[t][0].arrived_s))

    def take(
        self, max_rows: int, fits: Callable[[set[AdapterRef]], bool], *, joining: Joining | None = None
    ) -> list[Pending]:
        """The next batch: a job alone when the first tenant in line has one at its head, else
        requests in rounds across tenants while they fit (the first always does, unless
        ``joining``: then every one must, and the batch may be empty)."""
        order = self._order()
        if joining is not None:
            order = [t for t in order if t not in joining.exclude]
        if not order:
            return []
        head = self._lanes[order[0]][0]
        if head.job is not None:
            self._remove({id(head)})
            self._mark([order[0]])
            return [head]
        batch: list[Pending] = []
        rows, refs = 0, set[AdapterRef]()
        tokens_left = joining.tokens_below if joining is not None else None
        candidates = {t: self._requests(t) for t in order}
        served: list[str] = []
        while candidates and rows < max_rows:
            for tenant in list(candidates):
                item = self._fitting(candidates[tenant], batch, rows, refs, max_rows, fits, joining, tokens_left)
                if item is None:
                    if joining is not None and joining.strict and not batch and tenant == order[0]:
                        return []  # the first in line waits for room, and the others behind it
                    del candidates[tenant]  # nothing later in its lane fits either
                    continue
                batch.append(item)
                ref = item.request.adapter if item.request is not None else None
                if not item.future.cancelled():  # dropped by the engine: it takes no room
                    rows += item.rows
                    tokens_left = None if tokens_left is None else tokens_left - item.tokens
                    refs |= {ref} if ref is not None else set()
                if tenant not in served:
                    served.append(tenant)
        if batch:
            self._remove({id(p) for p in batch})
            self._mark(served)
        return batch

    @staticmethod
    def _fitting(
        lane: Iterator[Pending],
        batch: list[Pending],
        rows: int,
        refs: set[AdapterRef],
        max_rows: int,
        fits: Callable[[set[AdapterRef]], bool],
        joining: Joining | None,
        tokens_left: int | None,
    ) -> Pending | None:
        """The next request of a lane that fits beside ``batch`` (the first of a batch is taken as
        it is, unless joining). One that does not fit now never will (rows and adapters only
        grow), so the lane's iterator moves past it for good; a strict join looks no further than
        the head of a lane, so that a tenant's requests keep their order."""
        for item in lane:
            assert item.request is not None
            ref = item.request.adapter
            new_refs = refs | ({ref} if ref is not None else set())
            if (joining is None and not batch) or item.future.cancelled():
                return item
            small = tokens_left is None or item.tokens < tokens_left
            if rows + item.rows <= max_rows and small and fits(new_refs):
                return item
            if joining is not None and joining.strict:
                return None
        return None

    def _remove(self, ids: set[int]) -> None:
        for tenant in list(self._lanes):
            lane = self._lanes[tenant]
            kept = deque(p for p in lane if id(p) not in ids)
            self._size -= len(lane) - len(kept)
            if kept:
                self._lanes[tenant] = kept
            else:
                del self._lanes[tenant]

    def _mark(self, tenants: list[str]) -> None:
        for tenant in tenants:
            self._served.pop(tenant, None)  # re-inserted last: the dict stays oldest first
            self._served[tenant] = next(self._turn)
        while len(self._served) > MAX_REMEMBERED_TENANTS:
            del self._served[next(iter(self._served))]


__all__ = ["MAX_REMEMBERED_TENANTS", "FairQueue", "Joining", "Pending"]
