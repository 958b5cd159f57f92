"""Queues of waiting jobs, bounded, with cheap ordered access for a scheduling pass.

- ``TenantQueue``: one tenant's jobs in two heaps, by rank (priority, then size or arrival) and by
  arrival; removal is lazy. ``ranked()`` yields jobs in rank order without sorting the whole queue
  (it walks the heap as a tree), so a pass that looks at k jobs costs O(k log k), not O(n).
- ``FifoQueue``: arrival order only, for the baseline policy.
- ``RetryEstimator``: how long an Overloaded submitter should wait, from the recent completion rate.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from polytinker.scheduler.types import JobID

# One heap entry: (-priority, size key, sequence number, job id). Lower sorts first.
_Rank = tuple[int, float, int, JobID]


def iter_heap(heap: list[_Rank]) -> Iterator[_Rank]:
    """The entries of a binary heap in sorted order, lazily: O(log k) per entry taken."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    while frontier:
        entry, i = heapq.heappop(frontier)
        yield entry
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


class TenantQueue:
    def __init__(self) -> None:
        self._by_rank: list[_Rank] = []
        self._by_age: list[tuple[int, JobID]] = []
        self._live: dict[JobID, _Rank] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, job_id: JobID) -> bool:
        return job_id in self._live

    def push(self, job_id: JobID, priority: int, size: float, seq: int) -> None:
        entry = (-priority, size, seq, job_id)
        self._live[job_id] = entry
        heapq.heappush(self._by_rank, entry)
        heapq.heappush(self._by_age, (seq, job_id))

    def remove(self, job_id: JobID) -> None:
        del self._live[job_id]
        # Stale heap entries are skipped when met; rebuild once they outnumber the live ones.
        if len(self._by_rank) > 2 * len(self._live) + 32:
            self._by_rank = list(self._live.values())
            heapq.heapify(self._by_rank)
            self._by_age = [(e[2], j) for j, e in self._live.items()]
            heapq.heapify(self._by_age)

    def _is_live(self, entry: _Rank) -> bool:
        return self._live.get(entry[3]) == entry

    def ranked(self) -> Iterator[_Rank]:
        """Live entries in rank order. Removing while iterating is fine; pushing is not."""
        self.head()  # drop the stale entries on top (the jobs started last), so a pass does not walk them
        return (e for e in iter_heap(self._by_rank) if self._is_live(e))

    def head(self) -> _Rank | None:
        while self._by_rank and not self._is_live(self._by_rank[0]):
            heapq.heappop(self._by_rank)
        return self._by_rank[0] if self._by_rank else None

    def oldest(self) -> tuple[int, JobID] | None:
        while self._by_age and self._live.get(self._by_age[0][1], (0, 0.0, -1, ""))[2] != self._by_age[0][0]:
            heapq.heappop(self._by_age)
        return self._by_age[0] if self._by_age else None


class FifoQueue:
    """Arrival order; removal (cancel) is lazy."""

    def __init__(self) -> None:
        self._order: deque[tuple[int, JobID]] = deque()
        self._live: dict[JobID, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def push(self, job_id: JobID, seq: int) -> None:
        self._live[job_id] = seq
        self._order.append((seq, job_id))

    def remove(self, job_id: JobID) -> None:
        del self._live[job_id]

    def head(self) -> JobID | None:
        while self._order and self._live.get(self._order[0][1]) != self._order[0][0]:
            self._order.popleft()
        return self._order[0][1] if self._order else None


class RetryEstimator:
    """Estimates when a slot in a full queue frees, from an exponentially weighted mean of the time
    between job completions; clamped to [min_s, max_s] so a quiet scheduler still answers sensibly."""

    def __init__(self, min_s: float, max_s: float, smoothing: float = 0.1) -> None:
        self._min_s, self._max_s, self._alpha = min_s, max_s, smoothing
        self._interval_s: float | None = None
        self._last_s: float | None = None

    def observe_completion(self, now_s: float) -> None:
        if self._last_s is not None:
            gap = max(0.0, now_s - self._last_s)
            self._interval_s = (
                gap if self._interval_s is None else (1 - self._alpha) * self._interval_s + self._alpha * gap
            )
        self._last_s = now_s

    def retry_after_s(self, excess: int) -> float:
        """Wait for ``excess`` completions (how far past its bound the queue is, at least 1)."""
        # Nothing completed yet: no rate to go by, so a modest multiple of the floor.
        guess = 10 * self._min_s if self._interval_s is None else self._interval_s * max(1, excess)
        return min(self._max_s, max(self._min_s, guess))


__all__ = ["FifoQueue", "RetryEstimator", "TenantQueue", "iter_heap"]
