"""Idle jobs' resources for waiting jobs: which running jobs with no recent call to take out so
that a waiting job fits. Pure decisions, as in ``policy``: no I/O, no clock.

A running job keeps its adapter slot, engine memory and learner share whether or not its client
calls, so a few quiet jobs can keep every other tenant's jobs queued. The caller (the service's
idle pass) hands ``FairSharePolicy.reclaim_idle`` the running jobs it counts as idle, with the
seconds since their last call, and says which queued jobs someone is waiting on; for each of those
that does not fit (decision order, at most ``MAX_RECLAIMS_PER_PASS`` a pass), ``idle_victims``
picks the idle jobs whose removal lets it fit. The caller takes them out (an idle pause: their
state stays, their next call queues them again) and runs a scheduling pass.

Who may be taken, and in what order:

- never a job of higher priority than the waiting one: its next call would preempt the job placed
  instead of it, and wait for that job's step boundary;
- a job of another tenant only if that tenant holds more than its fair share, or the waiting job's
  tenant holds no more than its own: a tenant over its share takes nothing from one within it,
  whose quiet job would otherwise come back to find its resource gone to the larger tenant;
- tenants over their fair share first, then the longest idle.

A tenant's held share is the sum, over its placed jobs, of each job's dominant share of the
cluster (the largest of its part of all learner memory, of all engine memory and of all adapter
slots; a job with a learner group to itself counts the whole group); its fair share is its weight
over the summed weights of the tenants with jobs queued or running.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from polytinker.scheduler.cluster import ClusterState
from polytinker.scheduler.types import Job, JobID, Placement, TenantID
from polytinker.scheduler.victims import find_victims

MAX_RECLAIMS_PER_PASS = 4  # waiting jobs per pass that look for idle victims (each look scans the running jobs)
_EPS = 1e-9


@dataclass(frozen=True)
class Reclaim:
    """Take ``victims`` out so that ``for_job`` fits; ``reasons[i]`` says why ``victims[i]``, naming
    no job or tenant but the victim's own (it goes into the victim's history)."""

    for_job: JobID
    victims: tuple[JobID, ...]
    reasons: tuple[str, ...]


def dominant_share(cluster: ClusterState, job: Job, placement: Placement) -> float:
    """The largest part of the cluster ``job`` holds on ``placement``: learner memory (a whole group
    when it has one to itself), engine memory, or one adapter slot."""
    learner_gb = job.learner_mem_gb
    if placement.learner is not None and job.kind.exclusive_learner:
        learner_gb = cluster.learners[placement.learner].spec.memory_gb
    slots = sum(e.spec.adapter_slots for e in cluster.engines.values())  # hybrid workers' slots too
    parts = (
        learner_gb / cluster.total_learner_gb if cluster.total_learner_gb else 0.0,
        job.engine_mem_gb / cluster.total_engine_gb if cluster.total_engine_gb else 0.0,
        1.0 / slots if job.needs_slot and slots else 0.0,
    )
    return max(parts)


def held_shares(cluster: ClusterState) -> dict[TenantID, float]:
    """Each tenant's summed dominant share of what its placed jobs hold now."""
    held: defaultdict[TenantID, float] = defaultdict(float)
    for job, placement in cluster.placed.values():
        held[job.tenant] += dominant_share(cluster, job, placement)
    return dict(held)


def over_share(held: Mapping[TenantID, float], weights: Mapping[TenantID, float]) -> set[TenantID]:
    """Tenants holding more than their weight's part of the cluster; ``weights``: the tenants with
    jobs queued or running (the ones the cluster is shared among now)."""
    total = sum(weights.values())
    if total <= 0:
        return set()
    return {t for t, h in held.items() if h > weights.get(t, 0.0) / total + _EPS}


def idle_victims(
    cluster: ClusterState,
    blocked: Iterable[Job],
    idle_s: Mapping[JobID, float],
    weights: Mapping[TenantID, float],
) -> list[Reclaim]:
    """For each job of ``blocked`` (waiting, someone asks for it, it does not fit now; decision
    order), the idle running jobs (``idle_s``: seconds since each one's last call) to take out so
    that it fits, by the rules of the module docstring. A victim is taken for one job only."""
    if not idle_s:
        return []
    held = held_shares(cluster)
    over = over_share(held, weights)
    taken: set[JobID] = set()
    out: list[Reclaim] = []

    def order(j: Job) -> tuple[float, ...]:
        return (0.0 if j.tenant in over else 1.0, -idle_s.get(j.job_id, 0.0))

    for job in blocked:
        if len(out) >= MAX_RECLAIMS_PER_PASS:
            break

        def eligible(jid: JobID, job: Job = job) -> bool:
            if jid in taken or jid not in idle_s:
                return False
            victim = cluster.placed[jid][0]
            return victim.priority <= job.priority and (
                victim.tenant == job.tenant or victim.tenant in over or job.tenant not in over
            )

        found = find_victims(cluster, job, eligible, order)
        if found is None or not found[1]:
            continue
        taken.update(found[1])
        reasons = tuple(_reason(cluster.placed[v][0], idle_s[v], held, over) for v in found[1])
        out.append(Reclaim(job.job_id, tuple(found[1]), reasons))
    return out


def _reason(victim: Job, idle_s: float, held: Mapping[TenantID, float], over: set[TenantID]) -> str:
    t = victim.tenant
    standing = "more than" if t in over else "within"
    return (
        f"no call for {idle_s:.3g} s while a job of equal or higher priority waited for its resources; "
        f"tenant {t} holds {held.get(t, 0.0):.3g} of the cluster, {standing} its fair share"
    )


__all__ = ["MAX_RECLAIMS_PER_PASS", "Reclaim", "dominant_share", "held_shares", "idle_victims", "over_share"]
