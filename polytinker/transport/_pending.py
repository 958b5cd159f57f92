"""What a client's I/O thread tracks: the calls in flight, their deadlines, the requests the socket
could not take yet, and when the server was last heard from."""

from __future__ import annotations

import collections
import heapq
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

from polytinker.errors import RequestTimeout
from polytinker.transport.config import TransportConfig

SLOW_PEER_FACTOR = 4.0


class Pending:
    __slots__ = ("future", "kind", "timeout_s")

    def __init__(self, future: Future[Any], kind: str, timeout_s: float | None) -> None:
        self.future = future
        self.kind = kind
        self.timeout_s = timeout_s


class PendingCalls:
    """Pending calls by request id, a heap of their deadlines, the backlog and heartbeat times.
    Touched by the I/O thread only."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self.pending: dict[int, Pending] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.backlog: collections.deque[tuple[Any, ...]] = collections.deque()
        now = time.monotonic()
        self.last_recv = now
        self.next_ping = now
        self.alive = False
        self.awaiting_pong = False
        self.ping_sent = now
        self.next_due = now  # the earliest a ping, a deadline or the silence limit is due
        self.slowest_pong_s = 0.0  # the longest the server took to answer a ping, for the silence limit
        self._silence_s = cfg.dead_after_s  # silence_limit_s(), kept: the I/O loop asks every turn

    def pinged(self, now: float) -> None:
        if not self.awaiting_pong:  # an unanswered ping's wait counts from the first one
            self.ping_sent = now
            self.awaiting_pong = True

    def heard_from(self) -> None:
        now = time.monotonic()
        if self.awaiting_pong:
            self.slowest_pong_s = max(self.slowest_pong_s, now - self.ping_sent)
            self._silence_s = max(self.cfg.dead_after_s, SLOW_PEER_FACTOR * self.slowest_pong_s)
        self.last_recv = now
        self.alive = True
        self.awaiting_pong = False

    def silence_limit_s(self) -> float:
        """Silence after which the server counts as gone: the configured liveness, or four times
        its slowest answer to a ping so far (a peer that was slow once may be slow again)."""
        return self._silence_s

    def has(self, rid: int) -> bool:
        return rid in self.pending

    def pop(self, rid: int) -> Pending | None:
        return self.pending.pop(rid, None)

    def add(self, rid: int, p: Pending) -> None:
        self.pending[rid] = p
        if p.timeout_s is not None:
            heapq.heappush(self.deadlines, (time.monotonic() + p.timeout_s, rid))
            if len(self.deadlines) > 2 * len(self.pending) + 1024:  # drop deadlines of answered calls
                self.deadlines = [d for d in self.deadlines if d[1] in self.pending]
                heapq.heapify(self.deadlines)

    def poll_timeout_ms(self) -> int:
        wake_at = min(self.next_ping, self.last_recv + self.silence_limit_s())
        if self.deadlines:
            wake_at = min(wake_at, self.deadlines[0][0])
        self.next_due = wake_at
        if self.backlog:
            wake_at = min(wake_at, time.monotonic() + 0.01)  # retry the requests that found no peer
        return max(0, int((wake_at - time.monotonic()) * 1000) + 1)

    def expire(self, now: float) -> list[tuple[int, str]]:
        """Fail the calls whose deadline passed; their (request id, kind), to cancel."""
        dl = self.deadlines
        out = []
        while dl and dl[0][0] <= now:
            _, rid = heapq.heappop(dl)
            p = self.pending.pop(rid, None)
            if p is not None:
                settle(p.future, exc=RequestTimeout(f"{p.kind!r} got no reply within {p.timeout_s} s"))
                out.append((rid, p.kind))
        return out

    def fail_all(self, exc: Exception) -> None:
        pending, self.pending, self.deadlines = self.pending, {}, []
        self.backlog.clear()
        for p in pending.values():
            settle(p.future, exc=exc)


def settle(fut: Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    """Resolve a call's future (or waiter) unless its caller cancelled it meanwhile."""
    try:  # on every answer's path: suppress() costs a context manager
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass


__all__ = ["Pending", "PendingCalls", "settle"]
