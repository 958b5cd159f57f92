"""``FifoPolicy``, the baseline: one queue in arrival order; the head waits until it fits and
nothing behind it runs (head-of-line blocking); no priorities, no preemption."""

from __future__ import annotations

from polytinker.scheduler.config import SchedulerPolicyConfig
from polytinker.scheduler.policy_base import PolicyEntry, SchedulingPolicy
from polytinker.scheduler.queue import FifoQueue
from polytinker.scheduler.types import ClusterSpec, Decision


class FifoPolicy(SchedulingPolicy):
    """Plain FIFO with head-of-line blocking: the baseline."""

    name = "fifo"

    def __init__(self, cluster: ClusterSpec, config: SchedulerPolicyConfig | None = None) -> None:
        super().__init__(cluster, config)
        self._queue = FifoQueue()

    def _push(self, e: PolicyEntry, now_s: float, *, new: bool) -> None:
        self._queue.push(e.job.job_id, e.seq)

    def _pop(self, e: PolicyEntry) -> None:
        self._queue.remove(e.job.job_id)

    def schedule(self, now_s: float) -> list[Decision]:
        decisions = []
        while (head := self._queue.head()) is not None:
            e = self._entries[head]
            placement = self.cluster.fit(e.job, now_s)
            if placement is None:
                break  # the head waits, and so does everything behind it
            decisions.append(self._start(e, placement, now_s, "head of the FIFO queue and it fits"))
        return decisions


__all__ = ["FifoPolicy"]
