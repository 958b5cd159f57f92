"""Hybrid (colocated) workers in the simulator: one worker's time goes to whichever phase has work.

A hybrid worker is an engine side and a learner side under one id (``Simulator._sampling`` and
``Simulator._learners`` both hold it), and never both at once. The rules:

- In the sampling phase the jobs' sampling batches share the worker as they share an engine
  (processor sharing, mixed batches). Once a training step waits, no new batch starts: the step
  waits for the batches in flight, then the worker switches to training.
- In the training phase it trains the ready steps one at a time, as a learner group does (the
  optimizer swap between jobs included); batches asked for meanwhile wait. When no step is ready
  and a batch waits, it switches back to sampling: sampling runs between training rounds.
- A switch costs ``SimulatorConfig.phase_switch_s`` (``full_phase_switch_s`` while a full-parameter
  job holds the worker), during which it does no work; a worker idle in one phase stays there.

Time on a hybrid worker, while a queued job of its base model could have used it, is counted as
``train``, ``sampling`` (busy), ``switch``, ``swap``, ``idle_with_jobs`` (its jobs load, save, or
sample at less than full speed) or ``empty``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from polytinker.errors import SimulationError
from polytinker.scheduler._sim_state import GroupState, HybridPhase, SimulatorParts
from polytinker.scheduler.types import EngineSpec, Job, JobID, LearnerSpec, ResourceID


class HybridWorkers(SimulatorParts):
    """The hybrid-worker part of ``Simulator`` (a mixin on the simulator's attributes)."""

    def _init_hybrids(self) -> None:
        self._hybrid = {h.worker_id: HybridPhase(h) for h in self.cluster.hybrids}
        self._hybrid_time = defaultdict(float)
        for hid in self._hybrid:
            self._learners[hid] = GroupState()
            self._sampling[hid] = {}
            self._sampled_at[hid] = self._busy_s[hid] = self._pending_s[hid] = 0.0
            self._holders[hid] = set()

    # --- the simulator's, used here ----------------------------------------------------------------
    def _at(self, t: float, what: str, job_id: JobID, gen: int) -> None:
        raise NotImplementedError

    def _rebalance(self, eid: ResourceID, joins: dict[JobID, float], leave: JobID | None) -> None:
        raise NotImplementedError

    def _next_on_learner(self, gid: ResourceID) -> None:
        raise NotImplementedError

    def _sampling_busy(self, rid: ResourceID, dt: float) -> float:
        raise NotImplementedError

    # --- phases ------------------------------------------------------------------------------------
    def _gate(self, h: HybridPhase, joins: dict[JobID, float], leave: JobID | None) -> tuple[dict, JobID | None]:
        """Sampling requests to a hybrid worker: a withdrawn one that was held is dropped; new ones
        are held unless the worker is sampling with no training step waiting."""
        if leave is not None and leave in h.waiting:
            del h.waiting[leave]
            leave = None
        if joins and not self._open_for_sampling(h):
            h.waiting.update(joins)
            joins = {}
        return joins, leave

    def _open_for_sampling(self, h: HybridPhase) -> bool:
        g = self._learners[h.spec.worker_id]
        return h.phase == "sample" and not h.switching and not g.ready and g.busy is None

    def _hybrid_trains(self, hid: ResourceID) -> bool:
        """Whether the worker may start a training step now (else it may start switching to training)."""
        h = self._hybrid[hid]
        if h.phase == "train" and not h.switching:
            return True
        self._poke(hid)
        return False

    def _poke(self, hid: ResourceID) -> None:
        """Something changed on the worker: switch phase or let held batches in, by the rules above."""
        h = self._hybrid[hid]
        if h.switching:
            return
        g, active = self._learners[hid], self._sampling[hid]
        if h.phase == "sample":
            if g.ready and not active:
                self._switch(h, "train")  # the batches in flight are done: the waiting step trains
            elif not g.ready and h.waiting:
                joins = dict(h.waiting)
                h.waiting.clear()
                self._rebalance(hid, joins, None)
        elif g.busy is None and not g.ready and h.waiting:
            self._switch(h, "sample")

    def _switch(self, h: HybridPhase, to: str) -> None:
        hid = h.spec.worker_id
        full = any(self._runs[j].job.kind.exclusive_learner for j in self._holders[hid])
        cost = self.config.full_phase_switch_s if full else self.config.phase_switch_s
        h.switching, h.switches = True, h.switches + 1
        h.phase = "train" if to == "train" else "sample"
        self._at(self.now_s + cost, "phase_done", hid, h.switches)

    def _phase_done(self, hid: ResourceID, token: int) -> bool:
        h = self._hybrid[hid]
        if token != h.switches:
            raise SimulationError(f"hybrid worker {hid}: a phase switch ended that was not the last one begun")
        h.switching = False
        if h.phase == "train":
            self._next_on_learner(hid)
        else:
            self._poke(hid)
        return False

    # --- accounting and checks ---------------------------------------------------------------------
    def _advance_hybrids(self, dt: float) -> None:
        for hid, h in self._hybrid.items():
            base = h.spec.base_model
            if not (self.policy.queued_needing(base, "engine") or self.policy.queued_needing(base, "learner")):
                continue  # any job of its base model could use it; none waits
            self._pending_s[hid] += dt
            g = self._learners[hid]
            if g.training:
                self._busy_s[hid] += dt
                self._hybrid_time["train"] += dt
                continue
            busy = self._sampling_busy(hid, dt) if self._sampling[hid] else 0.0
            self._busy_s[hid] += busy
            self._hybrid_time["sampling"] += busy
            if h.switching:
                state = "switch"
            elif g.busy is not None:
                state = "swap"
            else:
                state = "idle_with_jobs" if self._holders[hid] else "empty"
            self._hybrid_time[state] += dt - busy

    def _check_hybrids(self, on_worker: dict[ResourceID, list[Job]]) -> None:
        for h in self.cluster.hybrids:
            hid, jobs = h.worker_id, on_worker.get(h.worker_id, [])
            if any(j.kind.exclusive_learner for j in jobs) and len(jobs) > 1:
                raise SimulationError(f"hybrid worker {hid}: a full-parameter job shares it")
            _check_group(h.learner_spec(), [j for j in jobs if j.kind.needs_learner])
            _check_engine(h.engine_spec(), [j for j in jobs if j.kind.needs_engine])
            if self._learners[hid].training and self._sampling[hid]:
                raise SimulationError(f"hybrid worker {hid} trains and samples at once")
            if self._hybrid[hid].switching and (self._learners[hid].busy or self._sampling[hid]):
                raise SimulationError(f"hybrid worker {hid} works while it switches phase")


def _check_group(g: LearnerSpec, jobs: Sequence[Job]) -> None:
    if any(j.kind.exclusive_learner for j in jobs) and len(jobs) > 1:
        raise SimulationError(f"learner group {g.group_id}: a full-parameter job shares it")
    shared = [j for j in jobs if not j.kind.exclusive_learner]
    if len(shared) > g.max_jobs or sum(j.learner_mem_gb for j in shared) > g.host_memory_gb + 1e-6:
        raise SimulationError(f"learner group {g.group_id} over-committed: {len(shared)} jobs")
    if any(j.learner_mem_gb > g.memory_gb + 1e-6 for j in jobs):
        raise SimulationError(f"learner group {g.group_id}: a job's working set exceeds its memory")


def _check_engine(e: EngineSpec, jobs: Sequence[Job]) -> None:
    adapters = {j.adapter for j in jobs if j.adapter is not None}
    if sum(j.engine_mem_gb for j in jobs) > e.memory_gb + 1e-6 or len(adapters) > e.adapter_slots:
        raise SimulationError(f"engine {e.engine_id} over-committed (memory or adapter slots)")


__all__ = ["HybridWorkers"]
