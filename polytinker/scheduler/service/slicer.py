"""``LearnerSlicer``: whose turn it is on one learner group.

Many jobs share a learner group; a job holds it from its first ``forward_backward`` to its
``optim_step`` (a step boundary) and then hands it to the waiting job that ``next_learner_job``
(the decision core) picks: highest priority, then longest waiting. LoRA jobs hold it together
(their calls that meet run as one batched pass, ``fb_batcher.py``); a full-parameter job holds it
alone. The broker keeps one per learner group.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from polytinker.scheduler.placement import next_learner_job


class LearnerSlicer:
    """Time-slices one learner group between jobs at step boundaries (see the module docstring).

    LoRA jobs (``shared``) hold the group together: their adapters live side by side, and their
    ``forward_backward`` calls that meet are batched into one pass (``FbBatcher``). A
    full-parameter job holds it alone. A shared job joins the holders only while no waiting job
    has a higher priority and no exclusive job waits (so a full-parameter job is not starved).
    """

    def __init__(self, idle_s: float) -> None:
        self._cv = threading.Condition()
        self._idle_s = idle_s
        self._holders: dict[str, bool] = {}  # job -> shared
        self._busy: dict[str, int] = {}  # calls in progress per holder
        self._last_use: dict[str, float] = {}
        self._waiting: dict[str, tuple[int, bool]] = {}  # job -> (priority, shared)
        self._last_run: dict[str, float] = {}
        self._last_joined: str | None = None
        self.switches = 0

    def _expire(self, now: float) -> None:
        for job in [j for j in self._holders if not self._busy.get(j) and now - self._last_use[j] > self._idle_s]:
            del self._holders[job]

    def _may_run(self, job_id: str, shared: bool, now: float) -> bool:
        if job_id in self._holders:
            return True
        self._expire(now)
        if self._holders:
            priority = self._waiting[job_id][0]
            return (
                shared
                and all(self._holders.values())
                and not any(p > priority or not sh for j, (p, sh) in self._waiting.items() if j != job_id)
            )
        ready = [(j, p, self._last_run.get(j, 0.0)) for j, (p, _) in self._waiting.items()]
        return next_learner_job(ready) == job_id

    @contextlib.contextmanager
    def turn(self, job_id: str, priority: int, *, ends_step: bool = False, shared: bool = False) -> Iterator[None]:
        """Run the body while ``job_id`` holds the group; ``ends_step`` hands it on afterwards."""
        with self._cv:
            self._waiting[job_id] = (priority, shared)
            try:
                while not self._may_run(job_id, shared, time.monotonic()):
                    self._cv.wait(0.05)
            finally:
                self._waiting.pop(job_id, None)
            if job_id not in self._holders and self._last_joined != job_id:
                self.switches += 1
            self._holders[job_id] = shared
            self._last_joined = job_id
            self._busy[job_id] = self._busy.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                self._busy[job_id] -= 1
                self._last_use[job_id] = self._last_run[job_id] = time.monotonic()
                if ends_step and self._busy[job_id] == 0:
                    self._holders.pop(job_id, None)
                self._cv.notify_all()

    def release(self, job_id: str) -> None:
        """The job left (finished, paused, cancelled): it holds nothing any more."""
        with self._cv:
            if not self._busy.get(job_id):
                self._holders.pop(job_id, None)
            self._last_run.pop(job_id, None)
            self._cv.notify_all()


__all__ = ["LearnerSlicer"]
