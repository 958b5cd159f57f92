"""Preemption's question: which running jobs would have to stop for a job to fit.

``find_victims(cluster, job, preemptible, order)`` answers it over a ``ClusterState``: the cheapest set
of running jobs (taken in ``order``, lowest-ranked first, only those ``preemptible`` allows)
whose removal lets ``job`` fit, on separate engines and learner groups or on one hybrid worker,
whichever costs least. The fair-share policy asks it to preempt for a higher-priority or starving
job, and the idle reclaim (``reclaim.py``) to pick idle jobs to pause. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from polytinker.scheduler.cluster import MEMORY_EPS, ClusterState, EngineState, LearnerState, could_host
from polytinker.scheduler.types import Job, JobID, Placement, ResourceID


def find_victims(
    cluster: ClusterState,
    job: Job,
    preemptible: Callable[[JobID], bool],
    order: Callable[[Job], tuple[float, ...]],
) -> tuple[Placement, list[JobID]] | None:
    """The cheapest set of running jobs whose removal lets ``job`` fit, taking victims in ``order``
    (lowest priority first) and only those ``preemptible`` allows; ``None`` if no such set exists.
    On separate machines or on one hybrid worker, whichever costs least (separate on a tie)."""
    options = []
    separate = _separate_victims(cluster, job, preemptible, order)
    if separate is not None:
        options.append(separate)
    for hid in cluster.hybrids:
        found = _hybrid_victims(cluster, job, hid, preemptible, order)
        if found is not None:
            options.append(found)
    if not options:
        return None
    placement, taken = min(options, key=lambda o: _cost(o[1], order))
    return placement, [j.job_id for j in sorted(taken, key=order)]


def _separate_victims(
    cluster: ClusterState,
    job: Job,
    preemptible: Callable[[JobID], bool],
    order: Callable[[Job], tuple[float, ...]],
) -> tuple[Placement, list[Job]] | None:
    learner: tuple[ResourceID | None, list[Job]] = (None, [])
    engine: tuple[ResourceID | None, list[Job]] = (None, [])
    if job.kind.needs_learner:
        opts = [_learner_victims(cluster, job, g, preemptible, order) for g in cluster.learners.values()]
        found = [o for o in opts if o is not None]
        if not found:
            return None
        learner = min(found, key=lambda o: (_cost(o[1], order), o[0] or ""))
    if job.kind.needs_engine:
        eopts = [_engine_victims(cluster, job, e, preemptible, order) for e in cluster.engines.values()]
        efound = [o for o in eopts if o is not None]
        if not efound:
            return None
        engine = min(efound, key=lambda o: (_cost(o[1], order), o[0] or ""))
    chosen = {j.job_id: j for j in learner[1] + engine[1]}
    return Placement(learner=learner[0], engine=engine[0]), list(chosen.values())


def _hybrid_victims(
    cluster: ClusterState,
    job: Job,
    hid: ResourceID,
    preemptible: Callable[[JobID], bool],
    order: Callable[[Job], tuple[float, ...]],
) -> tuple[Placement, list[Job]] | None:
    h, g, e = cluster.hybrids[hid], cluster.learners[hid], cluster.engines[hid]
    if h.base_model != job.base_model or not could_host(h, job):
        return None
    placement = Placement(hid if job.kind.needs_learner else None, hid if job.kind.needs_engine else None)
    running = sorted(cluster.jobs_on(hid).values(), key=order)
    if job.kind.exclusive_learner or g.exclusive is not None:
        return (placement, running) if all(preemptible(j.job_id) for j in running) else None

    def enough(taken: list[Job]) -> bool:
        ids = {j.job_id for j in taken}
        if job.kind.needs_learner:
            host_gb = g.host_free_gb + sum(j.learner_mem_gb for j in taken if j.job_id in g.jobs)
            if len(g.jobs.keys() - ids) >= h.max_jobs or host_gb + MEMORY_EPS < job.learner_mem_gb:
                return False
        kv_gb = e.free_gb + sum(j.engine_mem_gb for j in taken if j.job_id in e.jobs)
        if job.kind.needs_engine and kv_gb + MEMORY_EPS < job.engine_mem_gb:
            return False
        if not job.needs_slot or cluster.adapters.can_host(hid, job.adapter or ""):
            return True
        # A slot frees when every job pinning some adapter here stops (and no person pinned it).
        pinned_by = {k.adapter for k in e.jobs.values() if k.needs_slot and k.job_id not in ids}
        return any(
            j.needs_slot and j.adapter not in pinned_by and not cluster.adapters.is_user_pinned(j.adapter)
            for j in taken
        )

    found = _take_until(hid, running, preemptible, enough)
    return None if found is None else (placement, found[1])


def _learner_victims(
    cluster: ClusterState,
    job: Job,
    g: LearnerState,
    preemptible: Callable[[JobID], bool],
    order: Callable[[Job], tuple[float, ...]],
) -> tuple[ResourceID, list[Job]] | None:
    if g.spec.base_model != job.base_model or g.spec.memory_gb + MEMORY_EPS < job.learner_mem_gb:
        return None
    if g.spec.group_id in cluster.hybrids:
        return None  # both sides of a hybrid worker go together: _hybrid_victims
    running = sorted(g.jobs.values(), key=order)
    if job.kind.exclusive_learner or g.exclusive is not None:
        return (g.spec.group_id, running) if all(preemptible(j.job_id) for j in running) else None

    def enough(taken: list[Job]) -> bool:
        host_gb = g.host_free_gb + sum(j.learner_mem_gb for j in taken)
        return len(g.jobs) - len(taken) < g.spec.max_jobs and host_gb + MEMORY_EPS >= job.learner_mem_gb

    return _take_until(g.spec.group_id, running, preemptible, enough)


def _engine_victims(
    cluster: ClusterState,
    job: Job,
    e: EngineState,
    preemptible: Callable[[JobID], bool],
    order: Callable[[Job], tuple[float, ...]],
) -> tuple[ResourceID, list[Job]] | None:
    if e.spec.base_model != job.base_model or e.spec.memory_gb + MEMORY_EPS < job.engine_mem_gb:
        return None
    if e.spec.engine_id in cluster.hybrids:
        return None
    if job.needs_slot and e.spec.adapter_slots == 0:
        return None
    running = sorted(e.jobs.values(), key=order)

    def enough(taken: list[Job]) -> bool:
        return e.free_gb + sum(j.engine_mem_gb for j in taken) + MEMORY_EPS >= job.engine_mem_gb

    found = _take_until(e.spec.engine_id, running, preemptible, enough)
    if found is None or not job.needs_slot:
        return found
    assert job.adapter is not None
    eid, taken = found
    if cluster.adapters.can_host(eid, job.adapter):
        return found
    # A slot frees when the last job pinning some adapter stops: add the cheapest such job.
    for j in running:
        if j in taken or not preemptible(j.job_id) or not j.needs_slot or cluster.adapters.is_user_pinned(j.adapter):
            continue
        if sum(1 for k in e.jobs.values() if k.adapter == j.adapter and k not in taken) == 1:
            return eid, [*taken, j]
    return None


def _take_until(
    rid: ResourceID,
    running: list[Job],
    preemptible: Callable[[JobID], bool],
    enough: Callable[[list[Job]], bool],
) -> tuple[ResourceID, list[Job]] | None:
    """The fewest victims from ``running``, taken in order, that make ``enough`` true; None if none do."""
    taken: list[Job] = []
    for j in running:
        if enough(taken):
            break
        if preemptible(j.job_id):
            taken.append(j)
    return (rid, taken) if enough(taken) else None


def _cost(victims: list[Job], order: Callable[[Job], tuple[float, ...]]) -> tuple[object, ...]:
    # Prefer stopping only the lowest-ranked jobs, then as few as possible.
    worst: tuple[float, ...] = max((order(j) for j in victims), default=())
    return (worst, len(victims))


__all__ = ["find_victims"]
