"""A resent sample joins the first send's run instead of running again.

A client gives each sample call a request key, the same on every resend of that call. When the
scheduler dies while an engine runs the call, the engine goes on with it (nothing tells it its
caller is gone), and the client sends the call again to the restarted scheduler, which forwards
it here. The resend then waits for the run already going (or just done), so its answer comes
when the first run ends, not after a second run of the same length, and the engine does the
work once.

A resend is the same call only when its tenant, request key and everything it asks for (the
adapter's version, the prompt, the count and the sampling parameters) match: a key reused for
another request runs as a new one. The tenant is the scheduler's tag, never the client's word, so
one tenant's keys cannot reach another's runs. Runs are kept until ``keep_s`` after they end (a
resend comes within a scheduler restart, seconds), at most ``max_runs`` of them (the oldest go
first): what is kept is bounded by what the engine answers in ``keep_s``, whatever the callers
send. A run that failed is not reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class _Run:
    request: Any  # what the call asked for, compared with ``==`` against a resend's
    future: Future[Any]
    ended: float | None = None  # monotonic time the run ended; None while it runs


class Resends:
    def __init__(self, keep_s: float = 10.0, max_runs: int = 4096) -> None:
        self._keep_s = keep_s
        self._max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: OrderedDict[Hashable, _Run] = OrderedDict()
        self.joined = 0  # resends answered by a run already going or done

    def run(self, key: Hashable | None, request: Any, start: Callable[[], Future[Any]]) -> Future[Any]:
        """The future of ``request``: the run of an earlier send with the same ``key`` and an equal
        request, if one is going or ended well within ``keep_s``; else ``start()``'s."""
        if key is None:
            return start()
        with self._lock:
            self._prune(time.monotonic())
            earlier = self._runs.get(key)
            if earlier is not None and earlier.request == request and not _failed(earlier.future):
                self.joined += 1
                return earlier.future
            run = _Run(request, start())
            self._runs[key] = run
            self._runs.move_to_end(key)
        run.future.add_done_callback(lambda _f: self._ended(run))
        return run.future

    def _ended(self, run: _Run) -> None:
        with self._lock:
            run.ended = time.monotonic()

    def _prune(self, now: float) -> None:
        """Drop the oldest runs past the bound, then those at the front that ended ``keep_s`` ago
        (the front is the oldest started: one look per call, not a walk over every run)."""
        while len(self._runs) >= self._max_runs:
            self._runs.popitem(last=False)
        while self._runs:
            oldest = next(iter(self._runs.values()))
            if oldest.ended is None or now - oldest.ended <= self._keep_s:
                return
            self._runs.popitem(last=False)


def _failed(future: Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


__all__ = ["Resends"]
