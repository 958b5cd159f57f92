"""The contract of a scheduling policy, and what every policy shares: the job table, admission,
the bounded queue, the cluster's allocations and a job's states.

``SchedulingPolicy`` holds the job table and the cluster's allocations and answers events:

- ``submit(job, now_s)``: admission. Rejected (with the reason) if the job can never fit the
  cluster's memory; Overloaded (with ``retry_after_s``) if the queue is at its bound; else queued.
- ``schedule(now_s)``: one scheduling pass; returns START, PREEMPT and RESERVE decisions.
- ``job_finished``, ``job_stopped`` (a preempted job stopped at a step boundary and its state is
  saved: it goes back to the queue), ``cancel``.

The policy never does I/O: it returns ``Decision`` records and the caller (the service, or the
simulator) acts on them and logs them.

A policy brings its queue discipline (``_push``, ``_pop``, ``schedule``) and may follow a job's
life through the hooks ``_on_started``, ``_on_stopped`` and ``_on_gone``; ``PolicyEntry`` is its
record of one job. The policies: ``FairSharePolicy`` (``polytinker.scheduler.policy``, ours) and
``FifoPolicy`` (``polytinker.scheduler.fifo``, the baseline).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

from polytinker.errors import ConfigError
from polytinker.scheduler.cluster import ClusterState
from polytinker.scheduler.config import SchedulerPolicyConfig
from polytinker.scheduler.queue import RetryEstimator
from polytinker.scheduler.types import (
    Accepted,
    ClusterSpec,
    Decision,
    DecisionKind,
    Job,
    JobID,
    JobState,
    Overloaded,
    Placement,
    Rejected,
    ResourceID,
    SubmitResult,
    TenantID,
)


@dataclass
class PolicyEntry:
    """The policy's mutable record of one job."""

    job: Job
    seq: int
    state: JobState = JobState.QUEUED
    steps_done: int = 0
    placement: Placement | None = None
    started_s: float = 0.0
    charged: float = 0.0  # fair-share charge taken at the last start

    @property
    def remaining_work_s(self) -> float:
        """Declared busy time left (engine plus learner): the size it is ordered and charged by."""
        return (self.job.steps - self.steps_done) * self.job.step_work_s

    @property
    def remaining_span_s(self) -> float:
        """Declared time left if it ran alone: ``remaining_work_s`` for a sync job, less for an async
        one (its sampling overlaps its training). What reservation windows are measured in."""
        return self.job.span_s(self.job.steps - self.steps_done)


class SchedulingPolicy(ABC):
    """The interface the service and the simulator drive; see the module docstring."""

    name = "policy"

    def __init__(self, cluster: ClusterSpec, config: SchedulerPolicyConfig | None = None) -> None:
        self.config = config or SchedulerPolicyConfig()
        self.cluster = ClusterState(cluster)
        self._entries: dict[JobID, PolicyEntry] = {}
        self._seq = itertools.count()
        self._queued_by_tenant: Counter[TenantID] = Counter()
        self._queued_by_need: Counter[tuple[str, str]] = Counter()  # (base model, "engine"/"learner")
        self._retry = RetryEstimator(self.config.retry_after_min_s, self.config.retry_after_max_s)

    # --- queries ---------------------------------------------------------------------------------
    def state(self, job_id: JobID) -> JobState:
        return self._entries[job_id].state

    def placement(self, job_id: JobID) -> Placement | None:
        return self._entries[job_id].placement

    def steps_done(self, job_id: JobID) -> int:
        return self._entries[job_id].steps_done

    @property
    def queued_count(self) -> int:
        return self._queued_by_tenant.total()

    def queued_needing(self, base_model: str, resource: str) -> int:
        """Queued jobs of ``base_model`` that need an ``"engine"`` or a ``"learner"``."""
        return self._queued_by_need[(base_model, resource)]

    def running(self) -> list[JobID]:
        return [j for j, e in self._entries.items() if e.state in (JobState.RUNNING, JobState.PREEMPTING)]

    # --- events ----------------------------------------------------------------------------------
    def submit(self, job: Job, now_s: float) -> SubmitResult:
        if job.job_id in self._entries:
            raise ConfigError(f"job id {job.job_id} was already submitted; job ids must be unique")
        why = self.cluster.impossible(job)
        if why is not None:
            return Rejected(Decision(DecisionKind.REJECT, now_s, job.job_id, f"can never run here: {why}", job.tenant))
        excess = max(
            self.queued_count + 1 - self.config.max_queued_jobs,
            self._queued_by_tenant[job.tenant] + 1 - self.config.max_queued_per_tenant,
        )
        if excess > 0:
            retry_s = self._retry.retry_after_s(excess)
            reason = (
                f"queue full ({self.queued_count} queued, tenant {job.tenant}: {self._queued_by_tenant[job.tenant]})"
            )
            reason += f"; retry after {retry_s:.1f} s"
            return Overloaded(Decision(DecisionKind.OVERLOADED, now_s, job.job_id, reason, job.tenant), retry_s)
        entry = PolicyEntry(job, next(self._seq))
        self._entries[job.job_id] = entry
        self._enqueue(entry, now_s, new=True)
        return Accepted(Decision(DecisionKind.ADMIT, now_s, job.job_id, "fits the cluster; queued", job.tenant))

    @abstractmethod
    def schedule(self, now_s: float) -> list[Decision]:
        """One scheduling pass: the jobs to start now, the jobs to preempt, the reservations made."""

    def job_finished(self, job_id: JobID, now_s: float) -> Decision:
        e = self._entries[job_id]
        if e.state not in (JobState.RUNNING, JobState.PREEMPTING):
            raise ConfigError(f"job {job_id} finished but it is {e.state}, not running")
        self.cluster.release(job_id, now_s)
        e.state, e.steps_done, e.placement = JobState.DONE, e.job.steps, None
        self._retry.observe_completion(now_s)
        self._on_gone(e, was_running=True)
        return Decision(DecisionKind.FINISH, now_s, job_id, "all steps done; resources freed", e.job.tenant)

    def job_stopped(self, job_id: JobID, now_s: float, steps_done: int) -> Decision:
        """A job told to stop (PREEMPT) finished its step ``steps_done`` and saved its state."""
        e = self._entries[job_id]
        if e.state is not JobState.PREEMPTING:
            raise ConfigError(f"job {job_id} stopped but it was not being preempted (it is {e.state})")
        if not e.steps_done <= steps_done < e.job.steps:
            raise ConfigError(f"job {job_id}: steps_done {steps_done} outside [{e.steps_done}, {e.job.steps})")
        self.cluster.release(job_id, now_s)
        ran = steps_done - e.steps_done
        e.steps_done, e.placement = steps_done, None
        self._on_stopped(e, ran)
        self._enqueue(e, now_s, new=False)
        why = f"preempted after step {steps_done}/{e.job.steps}; state saved; back in the queue"
        return Decision(DecisionKind.REQUEUE, now_s, job_id, why, e.job.tenant)

    def cancel(self, job_id: JobID, now_s: float) -> Decision:
        e = self._entries[job_id]
        was_running = e.state in (JobState.RUNNING, JobState.PREEMPTING)
        if e.state is JobState.QUEUED:
            self._unqueue(e)
        elif e.state in (JobState.RUNNING, JobState.PREEMPTING):
            self.cluster.release(job_id, now_s)
        else:
            raise ConfigError(f"job {job_id} is {e.state}; only queued or running jobs can be cancelled")
        e.state, e.placement = JobState.CANCELLED, None
        self._on_gone(e, was_running)
        return Decision(DecisionKind.CANCEL, now_s, job_id, "cancelled by its tenant", e.job.tenant)

    def worker_left(self, rid: ResourceID) -> None:
        """An engine or learner group that joined left for good: placed on no more. Its jobs must
        have left the policy first (the service submits them again)."""
        self.cluster.remove(rid)
        self._on_worker_left(rid)

    # --- shared machinery ------------------------------------------------------------------------
    def _enqueue(self, e: PolicyEntry, now_s: float, *, new: bool) -> None:
        e.state = JobState.QUEUED
        self._count_queued(e.job, +1)
        self._push(e, now_s, new=new)

    def _count_queued(self, job: Job, sign: int) -> None:
        self._queued_by_tenant[job.tenant] += sign
        if job.kind.needs_engine:
            self._queued_by_need[(job.base_model, "engine")] += sign
        if job.kind.needs_learner:
            self._queued_by_need[(job.base_model, "learner")] += sign

    def _unqueue(self, e: PolicyEntry) -> None:
        self._count_queued(e.job, -1)
        self._pop(e)

    def _start(self, e: PolicyEntry, placement: Placement, now_s: float, reason: str) -> Decision:
        self._unqueue(e)
        load = self.cluster.allocate(e.job, placement, now_s)
        e.state, e.placement, e.started_s = JobState.RUNNING, placement, now_s
        self._on_started(e)
        return Decision(
            DecisionKind.START,
            now_s,
            e.job.job_id,
            reason,
            e.job.tenant,
            placement=placement,
            load_adapter=bool(load and load.load),
            evicted=load.evicted if load else None,
        )

    @abstractmethod
    def _push(self, e: PolicyEntry, now_s: float, *, new: bool) -> None: ...

    @abstractmethod
    def _pop(self, e: PolicyEntry) -> None: ...

    def _on_started(self, e: PolicyEntry) -> None:
        """Hook: a job took its resources."""
        return None

    def _on_stopped(self, e: PolicyEntry, steps_ran: int) -> None:
        """Hook: a preempted job gave its resources back after ``steps_ran`` steps."""
        return None

    def _on_gone(self, e: PolicyEntry, was_running: bool) -> None:
        """Hook: a job finished or was cancelled (``was_running``: it held resources)."""
        return None

    def _on_worker_left(self, rid: ResourceID) -> None:
        """Hook: resource ``rid`` is gone (``worker_left``)."""
        return None


__all__ = ["PolicyEntry", "SchedulingPolicy"]
