"""What is allocated where: memory of engines and learner groups, adapter slots, exclusive groups.

``ClusterState`` answers the questions the policy asks: can this job ever run here (and if not,
why), where does it fit now (which running jobs would have to stop for it to fit is
``victims.py``'s). It never over-commits: ``allocate`` raises if a placement does not fit.
Engines and learner groups that join at run time are ``add``ed, and ``remove``d when they leave
for good.

A hybrid worker (``HybridSpec``) is kept as a learner side and an engine side under its one id (in
``learners`` and ``engines``, with the memory of each phase), so memory, host memory, adapter slots
and preemption are counted as for separate machines; a job placed there holds both sides of the
same worker (``Placement(learner=h, engine=h)``; one side for SFT or inference). A full-parameter
job takes the whole worker (nothing else joins either side), since its weights are no longer the
base the others sample and train on. Separate engines and groups are tried first; hybrid workers
take a job that does not fit there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from polytinker.errors import ConfigError
from polytinker.scheduler.placement import AdapterLoad, AdapterPlacement
from polytinker.scheduler.types import (
    ClusterSpec,
    EngineSpec,
    HybridSpec,
    Job,
    JobID,
    LearnerSpec,
    Placement,
    ResourceID,
)

MEMORY_EPS = 1e-9  # memory sums in floats: tolerate rounding, never real over-commit


@dataclass
class LearnerState:
    spec: LearnerSpec
    host_free_gb: float  # for the states of shared jobs
    jobs: dict[JobID, Job] = field(default_factory=dict)
    exclusive: JobID | None = None


@dataclass
class EngineState:
    spec: EngineSpec
    free_gb: float
    jobs: dict[JobID, Job] = field(default_factory=dict)


def _all(_: ResourceID) -> bool:
    return True


class ClusterState:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.hybrids: dict[ResourceID, HybridSpec] = {h.worker_id: h for h in spec.hybrids}
        learner_specs = [*spec.learners, *(h.learner_spec() for h in spec.hybrids)]
        engine_specs = [*spec.engines, *(h.engine_spec() for h in spec.hybrids)]
        self.learners = {g.group_id: LearnerState(g, g.host_memory_gb) for g in learner_specs}
        self.engines = {e.engine_id: EngineState(e, e.memory_gb) for e in engine_specs}
        self.adapters = AdapterPlacement(engine_specs)
        self.placed: dict[JobID, tuple[Job, Placement]] = {}
        self.total_learner_gb = sum(g.memory_gb for g in learner_specs)
        self.total_engine_gb = sum(e.memory_gb for e in engine_specs)
        self.present: Callable[[ResourceID], bool] = _all  # every resource is there (the simulator's)

    def impossible(self, job: Job) -> str | None:
        """Why ``job`` can never run on this cluster even when it is empty; ``None`` if it can."""
        why = self._impossible_separate(job)
        if why is None or not self.hybrids:
            return why
        on_hybrids = self._impossible_hybrid(job)
        if on_hybrids is None:
            return None
        if not any(h.base_model == job.base_model for h in self.hybrids.values()):
            return why
        if not self._separate_of(job.base_model):
            return on_hybrids  # only hybrid workers serve this base model
        return f"{why}; on its hybrid workers: {on_hybrids}"

    def _separate_of(self, base_model: str) -> list[ResourceID]:
        """Engines and learner groups (not hybrid workers) of ``base_model``."""
        rids = [gid for gid, g in self.learners.items() if g.spec.base_model == base_model]
        rids += [eid for eid, e in self.engines.items() if e.spec.base_model == base_model]
        return [r for r in rids if r not in self.hybrids]

    def _impossible_hybrid(self, job: Job) -> str | None:
        hybrids = [h for h in self.hybrids.values() if h.base_model == job.base_model]
        if not hybrids:
            return f"no hybrid worker serves base model {job.base_model}"
        if any(could_host(h, job) for h in hybrids):
            return None
        biggest = max(h.memory_gb for h in hybrids)
        if job.kind.needs_learner and job.learner_mem_gb > biggest + MEMORY_EPS:
            return f"needs {job.learner_mem_gb:g} GB of learner memory; the largest hybrid worker has {biggest:g} GB"
        biggest = max(h.kv_memory_gb for h in hybrids)
        if job.kind.needs_engine and job.engine_mem_gb > biggest + MEMORY_EPS:
            return f"needs {job.engine_mem_gb:g} GB of engine memory; the largest hybrid worker has {biggest:g} GB"
        return f"no hybrid worker of {job.base_model} has the memory and the adapter slot it needs"

    def _impossible_separate(self, job: Job) -> str | None:
        if job.kind.needs_learner:
            groups = [
                g.spec
                for gid, g in self.learners.items()
                if g.spec.base_model == job.base_model and gid not in self.hybrids
            ]
            if not groups:
                return f"no learner group serves base model {job.base_model}"
            biggest = max(g.memory_gb for g in groups)
            if job.learner_mem_gb > biggest + MEMORY_EPS:
                return f"needs {job.learner_mem_gb:g} GB of learner memory; the largest group has {biggest:g} GB"
        if job.kind.needs_engine:
            engines = [
                e.spec
                for eid, e in self.engines.items()
                if e.spec.base_model == job.base_model and eid not in self.hybrids
            ]
            if not engines:
                return f"no engine serves base model {job.base_model}"
            fits = [e for e in engines if e.memory_gb + MEMORY_EPS >= job.engine_mem_gb]
            if not fits:
                biggest = max(e.memory_gb for e in engines)
                return f"needs {job.engine_mem_gb:g} GB of engine memory; the largest engine has {biggest:g} GB"
            if job.needs_slot and not any(e.adapter_slots > 0 for e in fits):
                return f"no engine of {job.base_model} with enough memory has an adapter slot"
        return None

    def add(self, spec: EngineSpec | LearnerSpec) -> None:
        """An engine or learner group that joined at run time: placed on from now on, as a declared one."""
        rid = spec.engine_id if isinstance(spec, EngineSpec) else spec.group_id
        if rid in self.engines or rid in self.learners:
            raise ConfigError(f"resource id {rid!r} is already in the cluster")
        if isinstance(spec, EngineSpec):
            self.adapters.add_engine(spec)
            self.engines[rid] = EngineState(spec, spec.memory_gb)
            self.total_engine_gb += spec.memory_gb
        else:
            self.learners[rid] = LearnerState(spec, spec.host_memory_gb)
            self.total_learner_gb += spec.memory_gb

    def remove(self, rid: ResourceID) -> None:
        """An engine or learner group that joined and left for good: placed on no more. The jobs
        on it must have left it first (a scheduler queues them again)."""
        if rid in self.hybrids or (rid not in self.engines and rid not in self.learners):
            raise ConfigError(f"resource id {rid!r} is not a joined engine or learner group")
        if self.jobs_on(rid):
            raise ConfigError(f"{rid} still holds jobs {sorted(self.jobs_on(rid))}: take them off it first")
        if rid in self.engines:
            self.adapters.remove_engine(rid)
            self.total_engine_gb -= self.engines.pop(rid).spec.memory_gb
        else:
            self.total_learner_gb -= self.learners.pop(rid).spec.memory_gb

    # --- fitting ---------------------------------------------------------------------------------
    def set_presence(self, present: Callable[[ResourceID], bool]) -> None:
        """Which workers are there now (a scheduler's: registered and alive). Jobs and adapters
        go to those first; a declared worker that is not there (not started yet, or gone) gets
        work only when nothing that is there will do, and its calls then wait for it."""
        self.present = present
        self.adapters.present = present

    def fit(self, job: Job, now_s: float, allowed: Callable[[ResourceID], bool] = _all) -> Placement | None:
        """Where ``job`` fits now, on resources ``allowed`` says it may use; ``None`` if nowhere.
        Separate engines and learner groups first, then hybrid workers; those there now first
        (``set_presence``), then any."""
        if self.present is not _all:
            placement = self._fit(job, now_s, lambda r: allowed(r) and self.present(r))
            if placement is not None:
                return placement
        return self._fit(job, now_s, allowed)

    def _fit(self, job: Job, now_s: float, allowed: Callable[[ResourceID], bool]) -> Placement | None:
        placement = self._fit_separate(job, now_s, allowed)
        if placement is not None or not self.hybrids:
            return placement
        hid = self._fit_hybrid(job, now_s, allowed)
        if hid is None:
            return None
        return Placement(learner=hid if job.kind.needs_learner else None, engine=hid if job.kind.needs_engine else None)

    def _fit_separate(self, job: Job, now_s: float, allowed: Callable[[ResourceID], bool]) -> Placement | None:
        learner = engine = None
        if job.kind.needs_learner:
            learner = self._fit_learner(job, allowed)
            if learner is None:
                return None
        if job.kind.needs_engine:
            engine = self._fit_engine(job, now_s, allowed)
            if engine is None:
                return None
        return Placement(learner=learner, engine=engine)

    def _fit_learner(self, job: Job, allowed: Callable[[ResourceID], bool]) -> ResourceID | None:
        best: tuple[int, float, str] | None = None
        for gid, g in self.learners.items():
            if g.spec.base_model != job.base_model or not allowed(gid) or g.exclusive is not None:
                continue
            if gid in self.hybrids:
                continue
            ok = g.spec.memory_gb + MEMORY_EPS >= job.learner_mem_gb
            if job.kind.exclusive_learner:
                ok = ok and not g.jobs
            else:
                ok = ok and len(g.jobs) < g.spec.max_jobs and g.host_free_gb + MEMORY_EPS >= job.learner_mem_gb
            # Spread shared jobs: the group with the fewest jobs takes turns least often.
            key = (len(g.jobs), -g.host_free_gb, gid)
            if ok and (best is None or key < best):
                best = key
        return None if best is None else best[2]

    def _fit_engine(self, job: Job, now_s: float, allowed: Callable[[ResourceID], bool]) -> ResourceID | None:
        candidates = [
            eid
            for eid, e in self.engines.items()
            if e.spec.base_model == job.base_model and allowed(eid) and e.free_gb + MEMORY_EPS >= job.engine_mem_gb
            if eid not in self.hybrids
        ]
        adapter = job.adapter if job.needs_slot else None
        return self.adapters.choose_engine(
            adapter, job.base_model, candidates, now_s, lambda c: len(self.engines[c].jobs)
        )

    def _fit_hybrid(self, job: Job, now_s: float, allowed: Callable[[ResourceID], bool]) -> ResourceID | None:
        """The hybrid worker where both sides ``job`` needs have room now: the one holding its adapter,
        else one with a free slot, else the fewest jobs (``choose_engine``'s order)."""
        candidates = []
        for hid, h in self.hybrids.items():
            g, e = self.learners[hid], self.engines[hid]
            if h.base_model != job.base_model or not allowed(hid) or g.exclusive is not None:
                continue
            if not could_host(h, job):
                continue
            if job.kind.exclusive_learner:
                ok = not g.jobs and not e.jobs
            else:
                ok = not job.kind.needs_learner or (
                    len(g.jobs) < h.max_jobs and g.host_free_gb + MEMORY_EPS >= job.learner_mem_gb
                )
                ok = ok and (not job.kind.needs_engine or e.free_gb + MEMORY_EPS >= job.engine_mem_gb)
            if ok:
                candidates.append(hid)
        adapter = job.adapter if job.needs_slot else None
        return self.adapters.choose_engine(adapter, job.base_model, candidates, now_s, lambda c: len(self.jobs_on(c)))

    def jobs_on(self, rid: ResourceID) -> dict[JobID, Job]:
        """The jobs placed on an engine, a learner group or a hybrid worker (both of its sides)."""
        if rid in self.hybrids:
            return {**self.learners[rid].jobs, **self.engines[rid].jobs}
        return self.learners[rid].jobs if rid in self.learners else self.engines[rid].jobs

    def step_time_on(self, rid: ResourceID, job: Job) -> float:
        """Seconds of one declared step of ``job`` that take resource ``rid``'s time: training on a
        learner group, sampling on an engine, both on a hybrid worker (its phases do not overlap)."""
        if rid in self.hybrids:
            return job.step_work_s
        return job.step_s if rid in self.learners else job.sample_s

    def wants(self, job: Job, now_s: float) -> str:
        """What ``job`` waits for, in words, while ``fit`` finds no place for it now (what is free
        may be reserved for another job: then it says so)."""
        base = job.base_model
        hybrids = [hid for hid, h in self.hybrids.items() if h.base_model == base]
        if hybrids and not self._separate_of(base):
            if self._fit_hybrid(job, now_s, _all) is not None:
                return "resources reserved for a job ahead of it"
            held = len({j for hid in hybrids for j in self.jobs_on(hid)})
            return f"a hybrid worker of {base}: none of its {len(hybrids)} has room ({held} job(s) on them)"
        if job.kind.needs_learner and self._fit_learner(job, _all) is None:
            groups = [g for gid, g in self.learners.items() if g.spec.base_model == base and gid not in self.hybrids]
            held = sum(len(g.jobs) for g in groups)
            return f"a learner of {base}: its {len(groups)} learner group(s) are full ({held} job(s) on them)"
        if job.kind.needs_engine and self._fit_engine(job, now_s, _all) is None:
            engines = [e for eid, e in self.engines.items() if e.spec.base_model == base and eid not in self.hybrids]
            adapter = job.adapter if job.needs_slot else None
            if adapter is not None and not any(self.adapters.can_host(e.spec.engine_id, adapter) for e in engines):
                slots = sum(e.spec.adapter_slots for e in engines)
                return f"an adapter slot: all {slots} on the {len(engines)} engine(s) of {base} are held by jobs"
            return f"engine memory ({job.engine_mem_gb:g} GB) on an engine of {base}"
        return "resources reserved for a job ahead of it"

    # --- allocation ------------------------------------------------------------------------------
    def allocate(self, job: Job, placement: Placement, now_s: float) -> AdapterLoad | None:
        """Take the resources; returns the adapter load it needed, if any. Raises if it does not fit."""
        if job.job_id in self.placed:
            raise ConfigError(f"job {job.job_id} is already placed")
        if self.fit(job, now_s, allowed=lambda r: r in placement.resources()) is None:
            raise ConfigError(f"job {job.job_id} does not fit on {placement.resources()}: ask fit() first")
        load = None
        if placement.learner is not None:
            g = self.learners[placement.learner]
            g.host_free_gb -= 0.0 if job.kind.exclusive_learner else job.learner_mem_gb
            g.jobs[job.job_id] = job
            if job.kind.exclusive_learner:
                g.exclusive = job.job_id
        if placement.engine is not None:
            e = self.engines[placement.engine]
            e.free_gb -= job.engine_mem_gb
            e.jobs[job.job_id] = job
            if job.needs_slot:
                assert job.adapter is not None
                load = self.adapters.acquire(placement.engine, job.adapter, now_s)
        self.placed[job.job_id] = (job, placement)
        return load

    def release(self, job_id: JobID, now_s: float) -> None:
        job, placement = self.placed.pop(job_id)
        if placement.learner is not None:
            g = self.learners[placement.learner]
            g.host_free_gb += 0.0 if job.kind.exclusive_learner else job.learner_mem_gb
            del g.jobs[job_id]
            if g.exclusive == job_id:
                g.exclusive = None
        if placement.engine is not None:
            e = self.engines[placement.engine]
            e.free_gb += job.engine_mem_gb
            del e.jobs[job_id]
            if job.needs_slot:
                assert job.adapter is not None
                self.adapters.release(placement.engine, job.adapter, now_s)


def could_host(h: HybridSpec, job: Job) -> bool:
    """Whether the empty worker ``h`` has the memory (each phase) and the adapter slot ``job`` needs."""
    if job.kind.needs_learner and job.learner_mem_gb > h.memory_gb + MEMORY_EPS:
        return False
    if job.kind.needs_engine and job.engine_mem_gb > h.kv_memory_gb + MEMORY_EPS:
        return False
    return not job.needs_slot or h.adapter_slots > 0


__all__ = ["MEMORY_EPS", "ClusterState", "EngineState", "LearnerState", "could_host"]
