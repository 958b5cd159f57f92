"""Job activity: when each job was last called, and its calls in flight and served.

Every call that names a job (training calls, and sampling: a base-model sampler names its
inference job, an adapter's model path names its training job) marks the job active while it
runs and when it ends: a handler call runs inside ``JobActivity.calls``, and the jobs it names
(``JobManager.running``, ``JobManager.touch``, after checking the caller's tenant) are busy until
it ends, so a long call never looks idle. ``JobManager`` reads this to apply the idle rules
(``idle.py``) and to pick the jobs whose resources it reclaims; ``list_jobs`` shows it
(``JobActivity.stats``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator

_calls = threading.local()  # the jobs the current handler thread's call named (see JobActivity.calls)


class JobActivity:
    """The activity of the jobs a ``JobManager`` knows; its state is guarded by the manager's lock
    (``lock``), which its idle rules read it under: the methods that take no lock are called with
    it held."""

    def __init__(self, clock: Callable[[], float], lock: threading.RLock) -> None:
        self._clock = clock  # the manager's: seconds, monotonic
        self._lock = lock
        self._touched: dict[str, float] = {}  # clock time of each job's last call
        self._busy: Counter[str] = Counter()  # calls in flight per job
        self._served: Counter[str] = Counter()  # calls completed per live job since this process started

    def restart(self, job_id: str) -> None:
        """The job's idle time counts from now (submitted, started, or recovered idle-paused)."""
        self._touched[job_id] = self._clock()

    def idle(self, job_id: str, now: float) -> tuple[float, int]:
        """(seconds from the job's last call to ``now``, 0 for a job with none; its calls in flight)."""
        return now - self._touched.get(job_id, now), self._busy[job_id]

    def last_call(self, job_id: str) -> float | None:
        """The clock time of the job's last call (or submission); None for a job it does not know."""
        return self._touched.get(job_id)

    def mark(self, job_id: str) -> None:
        """The job is active now; inside ``calls`` it also counts as busy until the call ends."""
        self._touched[job_id] = self._clock()
        named = getattr(_calls, "jobs", None)
        if named is not None and job_id not in named:
            named.append(job_id)
            self._busy[job_id] += 1

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around one handler call: the jobs it names (``mark``) are busy while it runs, so a long
        call never looks idle, and their idle time restarts when it ends. The handler names them
        after checking the caller's tenant, hence the thread-local list."""
        _calls.jobs = []
        ok = False
        try:
            yield
            ok = True
        finally:
            named, _calls.jobs = _calls.jobs, None
            if named:
                self._end_calls(named, ok)

    def _end_calls(self, named: list[str], ok: bool) -> None:
        with self._lock:
            now = self._clock()
            for job_id in named:
                self._busy[job_id] -= 1
                if self._busy[job_id] <= 0:
                    del self._busy[job_id]
                if job_id in self._touched:  # not finished meanwhile
                    self._touched[job_id] = now
                    self._served[job_id] += ok

    def stats(self) -> dict[str, dict[str, float]]:
        """Per job known to this process: calls served, calls in flight, seconds since its last call."""
        now = self._clock()
        with self._lock:
            return {
                job_id: {"calls": self._served[job_id], "in_flight": self._busy[job_id], "idle_s": now - t}
                for job_id, t in self._touched.items()
            }

    def forget(self, job_id: str) -> None:
        """A finished job's activity (bounded memory under many short-lived jobs)."""
        self._touched.pop(job_id, None)
        self._served.pop(job_id, None)


__all__ = ["JobActivity"]
