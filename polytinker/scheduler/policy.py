"""``FairSharePolicy``, ours: what to run, where, and what to stop, with a reason for each.

It answers the ``SchedulingPolicy`` interface (``polytinker.scheduler.policy_base``: admission,
bounded queues, the events the service and the simulator report) with strict priorities; weighted
fair share across tenants by virtual time (each tenant is charged its dominant memory share times
the work it starts, divided by its weight; the tenant with the least charge goes first); within a
tenant and priority the smallest declared job first; backfill, so a job that does not fit never
stalls one that does; a reservation for a job waiting longer than ``starvation_s`` so backfill
cannot starve it; preemption of lower-priority jobs at step boundaries. Sizes and charges are
declared busy time (``Job.work_s``); when a resource is expected to be free, and whether a job is
done within a reservation's window, are measured in declared time alone (``Job.span_s``: the same
for a sync job, shorter for an async RL job, whose sampling overlaps its training).

``FifoPolicy`` (``polytinker.scheduler.fifo``) is the baseline behind the same interface.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from polytinker.scheduler.config import SchedulerPolicyConfig
from polytinker.scheduler.policy_base import PolicyEntry, SchedulingPolicy
from polytinker.scheduler.queue import TenantQueue
from polytinker.scheduler.reclaim import Reclaim, idle_victims
from polytinker.scheduler.types import (
    ClusterSpec,
    Decision,
    DecisionKind,
    Job,
    JobID,
    JobState,
    Placement,
    ResourceID,
    TenantID,
)
from polytinker.scheduler.victims import find_victims


class FairSharePolicy(SchedulingPolicy):
    """Ours: priorities, weighted fair share, backfill, reservations against starvation, preemption."""

    name = "fair_share"

    def __init__(self, cluster: ClusterSpec, config: SchedulerPolicyConfig | None = None) -> None:
        super().__init__(cluster, config)
        self._queues: dict[TenantID, TenantQueue] = {}
        self._vtime: dict[TenantID, float] = {}  # weighted charge so far: lowest goes first
        self._active: Counter[TenantID] = Counter()  # queued + running jobs per tenant
        self._reserved: dict[ResourceID, JobID] = {}
        # When each reserved resource is expected to be free for its owner (declared work of the jobs
        # that must leave it); a job that fits and is expected to be done by then may use it meanwhile.
        self._reserved_until: dict[ResourceID, float] = {}
        self._aged: JobID | None = None  # the one starving job holding a reservation
        self._draining_for: dict[JobID, set[JobID]] = {}  # waiting job -> victims still stopping
        self._running_prio: Counter[int] = Counter()  # running jobs per priority: is preemption possible?

    def vtime(self, tenant: TenantID) -> float:
        return self._vtime.get(tenant, 0.0)

    def reserved(self) -> dict[ResourceID, JobID]:
        return dict(self._reserved)

    # --- queue hooks -----------------------------------------------------------------------------
    def _push(self, e: PolicyEntry, now_s: float, *, new: bool) -> None:
        t = e.job.tenant
        if new:
            if self._active[t] == 0:
                # A tenant coming back from idle starts at the least charge among active tenants: it
                # gets its fair share from now on, not credit banked while it had nothing to run.
                active = [self._vtime.get(o, 0.0) for o, n in self._active.items() if n > 0]
                self._vtime[t] = max(self._vtime.get(t, 0.0), min(active, default=0.0))
            self._active[t] += 1
        size = e.remaining_work_s if self.config.order_by_size else 0.0
        self._queues.setdefault(t, TenantQueue()).push(e.job.job_id, e.job.priority, size, e.seq)

    def _pop(self, e: PolicyEntry) -> None:
        self._queues[e.job.tenant].remove(e.job.job_id)

    def _charge(self, e: PolicyEntry) -> float:
        job = e.job
        share = max(
            job.learner_mem_gb / self.cluster.total_learner_gb if self.cluster.total_learner_gb else 0.0,
            job.engine_mem_gb / self.cluster.total_engine_gb if self.cluster.total_engine_gb else 0.0,
        )
        return share * e.remaining_work_s / self.config.weight(job.tenant)

    def _on_started(self, e: PolicyEntry) -> None:
        self._running_prio[e.job.priority] += 1
        e.charged = self._charge(e)
        self._vtime[e.job.tenant] = self.vtime(e.job.tenant) + e.charged
        self._drop_claims(e.job.job_id)

    def _on_stopped(self, e: PolicyEntry, steps_ran: int) -> None:
        self._running_prio[e.job.priority] -= 1
        # Charged for all remaining work at start; give back what it did not get to run.
        unused = e.charged * (1 - steps_ran / max(1, e.job.steps - e.steps_done + steps_ran))
        self._vtime[e.job.tenant] = self.vtime(e.job.tenant) - unused
        for waiting, victims in list(self._draining_for.items()):
            victims.discard(e.job.job_id)
            if not victims:
                del self._draining_for[waiting]

    def _on_gone(self, e: PolicyEntry, was_running: bool) -> None:
        self._active[e.job.tenant] -= 1
        if was_running:
            self._running_prio[e.job.priority] -= 1
        self._drop_claims(e.job.job_id)

    def _on_worker_left(self, rid: ResourceID) -> None:
        self._reserved.pop(rid, None)  # its owner looks for room again on what is left
        self._reserved_until.pop(rid, None)

    def _drop_claims(self, job_id: JobID) -> None:
        """The job started or left: its reservations and pending preemptions lapse."""
        for rid in [r for r, j in self._reserved.items() if j == job_id]:
            del self._reserved[rid]
            self._reserved_until.pop(rid, None)
        if self._aged == job_id:
            self._aged = None
        self._draining_for.pop(job_id, None)
        for waiting, victims in list(self._draining_for.items()):
            victims.discard(job_id)
            if not victims:  # all stopped or finished: it may look for victims again
                del self._draining_for[waiting]

    def reclaim_idle(
        self, now_s: float, idle_s: Mapping[JobID, float], wanted: Callable[[JobID], bool]
    ) -> list[Reclaim]:
        """Idle running jobs to take out so that queued jobs someone waits on (``wanted``) fit, by
        ``polytinker.scheduler.reclaim``'s rules; ``idle_s``: seconds since the last call of each job
        the caller counts as idle. The caller takes them out (``cancel``) and runs a pass."""
        looked = itertools.islice(self.candidates(), self.config.backfill_depth)
        fits = lambda e: self.cluster.fit(e.job, now_s, self._allowed_for(e, now_s)) is not None  # noqa: E731
        blocked = (e.job for e in looked if wanted(e.job.job_id) and not fits(e))
        idle = {j: s for j, s in idle_s.items() if j in self._entries and self._entries[j].state is JobState.RUNNING}
        weights = {t: self.config.weight(t) for t, n in self._active.items() if n > 0}
        return idle_victims(self.cluster, blocked, idle, weights)

    # --- the pass --------------------------------------------------------------------------------
    def schedule(self, now_s: float) -> list[Decision]:
        decisions = self._serve_claims(now_s)
        decisions += self._reserve_for_starving(now_s)
        misses = 0
        checks = self.config.preempt_checks_per_pass if self.config.preemption else 0
        for e in self.candidates():
            placement = self.cluster.fit(e.job, now_s, self._allowed_for(e, now_s))
            if placement is not None:
                decisions.append(self._start(e, placement, now_s, self._start_reason(e, misses)))
                continue
            misses += 1
            if checks and self._outranks_someone(e.job):
                checks -= 1
                decisions += self._preempt_for(e, now_s)
            if misses >= self.config.backfill_depth:
                break
        return decisions

    def candidates(self) -> Iterator[PolicyEntry]:
        """Queued jobs in decision order: higher priority first; at one priority, the tenant with the
        least weighted charge; within a tenant, its queue order. Charges move as jobs start, so the
        tenant order is re-read after every job taken."""
        streams = {t: q.ranked() for t, q in self._queues.items() if len(q)}
        heap = []
        for t, it in streams.items():
            first = next(it, None)
            if first is not None:
                heap.append((first[0], self.vtime(t), t, first[3]))
        heapq.heapify(heap)
        while heap:
            _, _, t, job_id = heapq.heappop(heap)
            e = self._entries[job_id]
            if e.state is JobState.QUEUED:
                yield e
            nxt = next(streams[t], None)
            if nxt is not None:
                heapq.heappush(heap, (nxt[0], self.vtime(t), t, nxt[3]))

    def _allowed_for(self, e: PolicyEntry, now_s: float) -> Callable[[ResourceID], bool]:
        job = e.job

        def allowed(rid: ResourceID) -> bool:
            owner = self._reserved.get(rid)
            if owner is None or owner == job.job_id or self._entries[owner].job.priority < job.priority:
                return True
            return self.config.backfill_reserved and self._done_before_reserved(e, rid, now_s)

        return allowed

    def _done_before_reserved(self, e: PolicyEntry, rid: ResourceID, now_s: float) -> bool:
        """EASY backfilling on a reserved resource: ``e`` may use it if, by declared sizes, it is done
        before the resource is expected to be free for its owner, and the work already there plus its
        own fits in that window on the resource (so it does not slow the others past it either)."""
        window = self._reserved_until.get(rid, now_s) - now_s
        if e.remaining_span_s > window:
            return False
        jobs = self.cluster.jobs_on(rid)  # a hybrid worker's time goes to both phases of its jobs
        on_resource = lambda job: self.cluster.step_time_on(rid, job)  # noqa: E731
        load = (e.job.steps - e.steps_done) * on_resource(e.job)
        for jid, job in jobs.items():
            other = self._entries[jid]
            span_s = other.remaining_span_s  # from its start, alone, by its declared size
            left_s = max(0.0, other.started_s + span_s - now_s)
            # Its work on this resource, spread evenly over its span (a sync job's span is its work).
            if job.is_async:
                load += left_s * (job.steps - other.steps_done) * on_resource(job) / span_s
            else:
                load += left_s * on_resource(job) / job.step_work_s
        return load <= window

    def _start_reason(self, e: PolicyEntry, misses: int) -> str:
        t = e.job.tenant
        why = f"priority {e.job.priority}; tenant {t} has the least weighted charge among waiting tenants "
        why += f"({self.vtime(t):.4g}, weight {self.config.weight(t):g}); "
        why += f"{e.remaining_work_s:.4g} s of declared work left"
        if misses:
            why += f"; backfilled past {misses} higher-ranked job(s) that do not fit now"
        return why

    def _outranks_someone(self, job: Job) -> bool:
        lowest = min((p for p, n in self._running_prio.items() if n > 0), default=None)
        return lowest is not None and lowest < job.priority and job.job_id not in self._draining_for

    def _preempt_for(self, e: PolicyEntry, now_s: float) -> list[Decision]:
        job = e.job
        if job.job_id in self._draining_for:
            return []  # its victims are still stopping

        def preemptible(jid: JobID) -> bool:
            v = self._entries[jid]
            return v.state is JobState.RUNNING and v.job.priority < job.priority

        found = find_victims(self.cluster, job, preemptible, lambda j: (j.priority, -self._entries[j.job_id].started_s))
        if found is None or not found[1]:
            return []
        placement, victims = found
        out = []
        for vid in victims:
            v = self._entries[vid]
            v.state = JobState.PREEMPTING
            # The victim's tenant reads this reason: another tenant's job is not named to it.
            who = job.job_id if job.tenant == v.job.tenant else "a job of another tenant"
            why = f"priority {v.job.priority} is the lowest running where {who} (priority {job.priority}) "
            why += "fits; stop at the next step boundary and save state"
            out.append(Decision(DecisionKind.PREEMPT, now_s, vid, why, v.job.tenant, v.placement, True, job.job_id))
        self._draining_for[job.job_id] = set(victims)
        # Victims stop at their next step boundary: no window worth backfilling.
        out.append(self._reserve(job, placement, now_s, f"{len(victims)} lower-priority job(s) stopping for it"))
        return out

    def _reserve(
        self, job: Job, placement: Placement, now_s: float, why: str, until_s: float | None = None
    ) -> Decision:
        """Hold ``placement`` for ``job``; ``until_s``: when it is expected to be free (None: at once)."""
        for rid in [r for r, j in self._reserved.items() if j == job.job_id]:
            del self._reserved[rid]  # a new reservation replaces its old one
            self._reserved_until.pop(rid, None)
        for rid in placement.resources():
            displaced = self._reserved.get(rid)
            if displaced is not None and displaced == self._aged and displaced != job.job_id:
                self._aged = None  # a higher-priority job took its resources: reserve anew next pass
            self._reserved[rid] = job.job_id
            self._reserved_until[rid] = now_s if until_s is None else until_s
        return Decision(DecisionKind.RESERVE, now_s, job.job_id, why, job.tenant, placement, for_job=job.job_id)

    def _serve_claims(self, now_s: float) -> list[Decision]:
        """Jobs holding reservations go first, wherever they stand in the queue order: otherwise a
        pass could spend its backfill depth on jobs the reservations keep out and never reach them."""
        out = []
        for job_id in dict.fromkeys(self._reserved.values()):
            e = self._entries[job_id]
            if e.state is not JobState.QUEUED:
                continue
            placement = self.cluster.fit(e.job, now_s, self._allowed_for(e, now_s))
            if placement is not None:
                out.append(self._start(e, placement, now_s, "the resources reserved for it are free"))
        return out

    def _reserve_for_starving(self, now_s: float) -> list[Decision]:
        """EASY-style: the oldest job, once waiting past ``starvation_s``, gets the resources that
        drain soonest reserved for it, so backfill cannot keep it out forever."""
        if self._aged is not None:
            return []
        heads = [h for q in self._queues.values() if (h := q.oldest()) is not None]
        if not heads:
            return []
        oldest = min(heads)
        e = self._entries[oldest[1]]
        if now_s - e.job.arrival_s < self.config.starvation_s:
            return []
        waited = now_s - e.job.arrival_s
        placement = self.cluster.fit(e.job, now_s, self._allowed_for(e, now_s))
        if placement is not None:  # start it now: the pass might not reach it within its backfill depth
            return [self._start(e, placement, now_s, f"waited {waited:.4g} s (> starvation_s) and fits now")]

        def free(jid: JobID) -> bool:
            return not any(self._reserved.get(r) for r in self.cluster.placed[jid][1].resources())

        found = find_victims(self.cluster, e.job, free, lambda j: (self._entries[j.job_id].remaining_span_s,))
        if found is None:
            return []
        self._aged = e.job.job_id
        ends = [self._entries[v].started_s + self._entries[v].remaining_span_s for v in found[1]]
        until_s = max([now_s, *ends])
        why = f"waited {waited:.4g} s (> starvation_s); holding resources (expected free at {until_s:.4g} s)"
        return [self._reserve(e.job, found[0], now_s, why, until_s)]
