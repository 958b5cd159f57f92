"""Discrete-event simulation of a cluster of engines and learner groups, driven by a policy.

The simulator replays a trace of jobs through a ``SchedulingPolicy`` (the same decision code the
scheduler service is to run) and acts out its decisions:

- A step of an RL job samples on its engine for ``sample_s`` and trains on its learner group for
  ``step_s``; SFT only trains; inference only samples. A sync RL job (``max_staleness`` 0) samples
  step k, then trains it. An async one (``max_staleness`` n >= 1) starts sampling step k as soon as
  step k-1 is sampled and at most n sampled steps wait untrained, so step k+1 samples while step k
  trains; steps train in order, each once sampled. Engines serve all their jobs at once
  (requests from different jobs meet in mixed batches). A learner group trains one job's step at
  a time: co-located LoRA jobs take turns at step boundaries (``next_learner_job``), and a switch
  to another job first costs ``optimizer_swap_s`` (its optimizer state moved in, the last one out).
- A hybrid worker (``HybridSpec``) samples and trains the jobs placed on it, one phase at a time:
  a training step waits for the batches in flight, sampling runs between training rounds, and each
  switch costs ``phase_switch_s`` (``full_phase_switch_s`` with a full-parameter job); the rules
  are in ``polytinker.scheduler._sim_hybrid``.
- A START costs ``adapter_load_s`` when the engine must load the adapter, and ``checkpoint_load_s``
  when the job resumes from saved state. A PREEMPT is obeyed at the job's next step boundary (the
  end of a step's training; inference: of a batch's sampling); the job then holds its resources
  ``checkpoint_save_s`` longer while its state is saved, and goes back to the queue. Once told to
  stop, an async job starts no further sample; at the boundary, rollouts it sampled ahead (done,
  or still sampling: that sampling stops at once) are discarded, since the saved state is that of
  the step trained, and are sampled again after it resumes. Their engine time is not counted as
  busy: it goes to ``engine_time["discarded_sampling"]`` (and ``JobOutcome.discarded_samples``
  counts them); the job pays for them in JCT. A job never samples past its last step, so a job that
  finishes discards nothing. An Overloaded submission is retried after the ``retry_after_s`` it
  was given.

Outputs: a ``SimResult`` (in ``polytinker.scheduler.sim_result``) with per-job completion times,
utilization and the full decision log, measured as ``polytinker.scheduler._sim_metrics`` describes.
There is no randomness here: the same trace and policy give the same result.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from polytinker.errors import SimulationError
from polytinker.scheduler._sim_hybrid import HybridWorkers, _check_engine, _check_group
from polytinker.scheduler._sim_metrics import SimMetrics
from polytinker.scheduler._sim_state import GroupState, JobRun
from polytinker.scheduler.config import SchedulerPolicyConfig, SimulatorConfig
from polytinker.scheduler.placement import next_learner_job
from polytinker.scheduler.policy_base import SchedulingPolicy
from polytinker.scheduler.sim_result import SimResult
from polytinker.scheduler.types import (
    ClusterSpec,
    Decision,
    DecisionKind,
    Job,
    JobID,
    Overloaded,
    Rejected,
    ResourceID,
)


class Simulator(SimMetrics, HybridWorkers):
    def __init__(
        self,
        cluster: ClusterSpec,
        policy: SchedulingPolicy,
        config: SimulatorConfig | None = None,
        *,
        audit: bool = False,
    ) -> None:
        self.cluster, self.policy = cluster, policy
        self.config = config or SimulatorConfig()
        self.audit = audit  # check for over-commitment after every event (slower; for tests)
        self.now_s = 0.0
        self._events: list[tuple[float, int, str, JobID, int]] = []
        self._seq = itertools.count()
        self._runs: dict[JobID, JobRun] = {}
        self._learners = {g.group_id: GroupState() for g in cluster.learners}
        # Per engine: remaining sampling work (seconds at full speed) of each job sampling there, and
        # when it was last brought up to date.
        self._sampling: dict[ResourceID, dict[JobID, float]] = {e.engine_id: {} for e in cluster.engines}
        self._sampled_at: dict[ResourceID, float] = dict.fromkeys(self._sampling, 0.0)
        self._holders: dict[ResourceID, set[JobID]] = {rid: set() for rid in [*self._learners, *self._sampling]}
        self._log: list[Decision] = []
        self._init_metrics()
        self._init_hybrids()  # a hybrid worker joins _learners and _sampling; not in _needs

    # --- driver ----------------------------------------------------------------------------------
    def run(self, trace: Sequence[Job]) -> SimResult:
        for job in trace:
            if job.job_id in self._runs:
                raise SimulationError(f"trace has job id {job.job_id} twice")
            self._runs[job.job_id] = JobRun(job)
            self._at(job.arrival_s, "arrive", job.job_id, 0)
        while self._events and self._events[0][0] <= self.config.max_time_s:
            t = self._events[0][0]
            self._advance(t)
            changed = False
            while self._events and self._events[0][0] == t:
                _, _, what, job_id, gen = heapq.heappop(self._events)
                changed |= self._handle(what, job_id, gen)
            if changed:
                self._apply(self.policy.schedule(self.now_s))
            if self.audit:
                self.check_invariants()
        return self._result()

    def _at(self, t: float, what: str, job_id: JobID, gen: int) -> None:
        heapq.heappush(self._events, (t, next(self._seq), what, job_id, gen))

    def _advance(self, t: float) -> None:
        dt = t - self.now_s
        if dt > 0 and self.policy.queued_count:
            self._count_time(dt)
            self._advance_hybrids(dt)
        self.now_s = max(self.now_s, t)

    def _vacate(self, r: JobRun) -> None:
        for rid in r.placement.resources() if r.placement else ():
            self._holders[rid].discard(r.job.job_id)

    def _handle(self, what: str, job_id: JobID, gen: int) -> bool:
        """Act out one event; True if it may let the policy start something."""
        if what == "phase_done":
            return self._phase_done(job_id, gen)  # job_id names a hybrid worker here
        r = self._runs[job_id]
        if what == "arrive":
            return self._submit(r)
        if gen != (r.sample_token if what == "sample_done" else r.gen):
            return False  # an event of an earlier run, or a sampling end moved by a change in contention
        if what == "setup_done":
            self._begin_step(r)
        elif what == "sample_done":
            self._sample_done(r)
        elif what == "swap_done":
            self._swap_done(r)
        elif what == "train_done":
            self._train_done(r)
        elif what == "save_done":
            self._log.append(self.policy.job_stopped(job_id, self.now_s, r.steps_done))
            self._leave_learner(r)
            self._vacate(r)
            r.placement, r.stop = None, False
            r.preemptions += 1
            return True
        return r.finish_s is not None

    def _submit(self, r: JobRun) -> bool:
        answer = self.policy.submit(r.job, self.now_s)
        self._log.append(answer.decision)
        if isinstance(answer, Rejected):
            r.rejected = answer.decision.reason
            return False
        if isinstance(answer, Overloaded):
            r.retries += 1
            self._at(self.now_s + answer.retry_after_s, "arrive", r.job.job_id, 0)
            return False
        return True

    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self._log.append(d)
            r = self._runs[d.job_id]
            if d.kind is DecisionKind.START:
                assert d.placement is not None
                assert r.sampled == r.steps_done and not r.sampling, "a job starts with nothing sampled ahead"
                r.placement, r.stop = d.placement, False
                for rid in d.placement.resources():
                    self._holders[rid].add(r.job.job_id)
                r.gen += 1
                if r.first_start_s is None:
                    r.first_start_s = self.now_s
                setup = self.config.adapter_load_s if d.load_adapter else 0.0
                setup += self.config.checkpoint_load_s if r.steps_done else 0.0
                self._at(self.now_s + setup, "setup_done", r.job.job_id, r.gen)
            elif d.kind is DecisionKind.PREEMPT:
                r.stop = True

    # --- a job's step ----------------------------------------------------------------------------
    def _begin_step(self, r: JobRun) -> None:
        if r.job.kind.needs_engine:
            self._sample_more(r)
        else:
            self._to_learner(r)

    def _may_sample(self, r: JobRun) -> bool:
        """Whether the job may start sampling its next step now. Sync: only the step after the ones
        trained. Async: also while at most ``max_staleness`` sampled steps wait untrained, unless it
        was told to stop (then nothing beyond the step it needs to reach its boundary)."""
        if r.sampling or r.sampled >= r.job.steps:
            return False
        ahead = r.sampled - r.steps_done
        return ahead == 0 or (not r.stop and ahead <= r.job.max_staleness)

    def _sample_more(self, r: JobRun, leave: bool = False) -> None:
        """Start the job's next sample if it may (and take its finished one off the engine if ``leave``)."""
        assert r.placement is not None and r.placement.engine is not None
        start = self._may_sample(r)
        if start:
            r.staleness = max(r.staleness, r.sampled - r.steps_done)
            r.sampling = True
        if start or leave:
            join = (r.job.job_id, r.job.sample_s) if start else None
            self._resample(r.placement.engine, join=join, leave=r.job.job_id if leave else None)

    def _sample_done(self, r: JobRun) -> None:
        assert r.placement is not None and r.placement.engine is not None
        r.sampling = False
        r.sampled += 1
        if r.job.is_async:
            r.untrained_busy_s.append(r.inflight_busy_s)
            r.inflight_busy_s = 0.0
        if r.job.kind.needs_learner:
            self._sample_more(r, leave=True)  # async: the next step's rollouts start at once
            self._to_learner(r)
        else:
            self._resample(r.placement.engine, leave=r.job.job_id)
            self._step_done(r)

    def _resample(self, eid: ResourceID, join: tuple[JobID, float] | None = None, leave: JobID | None = None) -> None:
        """A job starts or ends sampling on engine ``eid`` (on a hybrid worker, a start may be held
        until its sampling phase)."""
        joins = dict([join]) if join is not None else {}
        h = self._hybrid.get(eid)
        if h is not None:
            joins, leave = self._gate(h, joins, leave)
        if joins or leave is not None:
            self._rebalance(eid, joins, leave)
        if h is not None:
            self._poke(eid)

    def _rebalance(self, eid: ResourceID, joins: dict[JobID, float], leave: JobID | None) -> None:
        """Jobs start (``joins``: seconds of work each) or end sampling on ``eid``: bring the others'
        remaining work up to date and move their end times, since its throughput is shared."""
        active = self._sampling[eid]
        rate = min(1.0, self.config.engine_full_speed_jobs / len(active)) if active else 1.0
        elapsed = self.now_s - self._sampled_at[eid]
        for job_id in active:
            active[job_id] = max(0.0, active[job_id] - elapsed * rate)
        self._sampled_at[eid] = self.now_s
        if leave is not None:
            del active[leave]
        active.update(joins)
        rate = min(1.0, self.config.engine_full_speed_jobs / len(active)) if active else 1.0
        for job_id, remaining in active.items():
            r = self._runs[job_id]
            r.sample_token = next(self._seq)
            self._at(self.now_s + remaining / rate, "sample_done", job_id, r.sample_token)

    def _to_learner(self, r: JobRun) -> None:
        """The job has a step ready to train: queue it on its group (unless it is on the group now;
        it comes back for its next sampled step when this one is trained)."""
        assert r.placement is not None and r.placement.learner is not None
        g = self._learners[r.placement.learner]
        if g.busy == r.job.job_id or r.job.job_id in g.ready:
            return
        g.ready[r.job.job_id] = None
        self._next_on_learner(r.placement.learner)

    def _next_on_learner(self, gid: ResourceID) -> None:
        hybrid = gid in self._hybrid
        if hybrid and not self._hybrid_trains(gid):
            return
        g = self._learners[gid]
        if g.busy is not None or not g.ready:
            if hybrid:
                self._poke(gid)  # nothing to train: a held sampling batch may switch it back
            return
        prio = {j: self._runs[j].job.priority for j in g.ready}
        job_id = next_learner_job((j, prio[j], g.last_run_s.get(j, -math.inf)) for j in g.ready)
        assert job_id is not None
        del g.ready[job_id]
        r = self._runs[job_id]
        g.busy = job_id
        # A switch moves the last job's optimizer state out and this one's back in (a fresh job has none).
        if g.last != job_id and (g.last is not None or job_id in g.last_run_s):
            g.training = False
            self._at(self.now_s + self.config.optimizer_swap_s, "swap_done", job_id, r.gen)
        else:
            self._swap_done(r)

    def _swap_done(self, r: JobRun) -> None:
        assert r.placement is not None and r.placement.learner is not None
        g = self._learners[r.placement.learner]
        g.training, g.last = True, r.job.job_id
        self._at(self.now_s + r.job.step_s, "train_done", r.job.job_id, r.gen)

    def _train_done(self, r: JobRun) -> None:
        assert r.placement is not None and r.placement.learner is not None
        gid = r.placement.learner
        g = self._learners[gid]
        g.busy, g.training = None, False
        g.last_run_s[r.job.job_id] = self.now_s
        if r.untrained_busy_s:
            r.untrained_busy_s.popleft()  # that sample became a trained step: its engine time was useful
        self._step_done(r)
        self._next_on_learner(gid)

    def _step_done(self, r: JobRun) -> None:
        r.steps_done += 1
        r.sampled = r.steps_done if not r.job.kind.needs_engine else r.sampled
        if r.steps_done == r.job.steps:
            self._finish(r)
        elif r.stop:
            # At the step boundary: drop what an async job sampled ahead, save state (holding the
            # resources), then hand them back.
            self._discard_ahead(r)
            self._at(self.now_s + self.config.checkpoint_save_s, "save_done", r.job.job_id, r.gen)
        else:
            self._begin_step(r)  # sync: this step's rollouts; async: one more ahead if now allowed
            if r.job.kind.needs_learner and r.sampled > r.steps_done:
                self._to_learner(r)  # async: its next step was sampled while this one trained

    def _discard_ahead(self, r: JobRun) -> None:
        """A preempted async job at its step boundary: the rollouts it sampled for later steps (done,
        or in flight: that sampling stops now) are thrown away; their engine time is moved out of the
        busy time into ``discarded_sampling``."""
        ahead = r.sampled - r.steps_done + r.sampling
        if not ahead:
            return
        assert r.placement is not None and r.placement.engine is not None
        eid = r.placement.engine
        if r.sampling:
            r.sampling, r.sample_token = False, -1  # its end-of-sampling event is void
            self._resample(eid, leave=r.job.job_id)
        wasted = r.inflight_busy_s + sum(r.untrained_busy_s)
        self._busy_s[eid] -= wasted
        times = self._hybrid_time if eid in self._hybrid else self._engine_time
        times["sampling"] -= wasted
        times["discarded_sampling"] += wasted
        r.inflight_busy_s = 0.0
        r.untrained_busy_s.clear()
        r.sampled = r.steps_done
        r.discarded += ahead

    def _finish(self, r: JobRun) -> None:
        assert not r.sampling and r.sampled == r.job.steps, "a job never samples past its last step"
        r.finish_s = self.now_s
        self._leave_learner(r)
        self._vacate(r)
        r.placement = None
        self._log.append(self.policy.job_finished(r.job.job_id, self.now_s))

    def _leave_learner(self, r: JobRun) -> None:
        if r.placement is not None and r.placement.learner is not None:
            g = self._learners[r.placement.learner]
            g.last_run_s.pop(r.job.job_id, None)
            g.ready.pop(r.job.job_id, None)
            if g.last == r.job.job_id:
                g.last = None  # its optimizer state left with it (done, or saved): nothing to swap out

    # --- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recount every resource from the simulator's own view of what runs where, and check that
        no job samples further ahead of its training than its ``max_staleness`` allows (and that no
        hybrid worker trains and samples at once, or works while it switches phase)."""
        on_group: dict[ResourceID, list[Job]] = {g: [] for g in self._learners}
        on_engine: dict[ResourceID, list[Job]] = {e: [] for e in self._sampling}
        on_worker: dict[ResourceID, list[Job]] = {h: [] for h in self._hybrid}
        for r in self._runs.values():
            if r.placement is not None and r.placement.learner is not None:
                on_group[r.placement.learner].append(r.job)
            if r.placement is not None and r.placement.engine is not None:
                on_engine[r.placement.engine].append(r.job)
            for rid in r.placement.resources() if r.placement is not None else ():
                if rid in on_worker:
                    on_worker[rid].append(r.job)
        for g in self.cluster.learners:
            _check_group(g, on_group[g.group_id])
        for e in self.cluster.engines:
            _check_engine(e, on_engine[e.engine_id])
        self._check_hybrids(on_worker)
        held = {j for h in self._hybrid.values() for j in h.waiting}
        for r in self._runs.values():
            ahead = r.sampled + r.sampling - r.steps_done  # sampled or sampling, not trained
            if ahead < 0 or ahead > r.job.max_staleness + 1 or r.staleness > r.job.max_staleness:
                raise SimulationError(f"job {r.job.job_id} sampled {ahead} steps ahead of its training")
            asked = r.job.job_id in held or any(r.job.job_id in active for active in self._sampling.values())
            if r.sampling != asked:
                raise SimulationError(f"job {r.job.job_id}: its sampling state and its engine's disagree")


def simulate(
    trace: Sequence[Job],
    cluster: ClusterSpec,
    policy: Callable[[ClusterSpec, SchedulerPolicyConfig | None], SchedulingPolicy],
    policy_config: SchedulerPolicyConfig | None = None,
    config: SimulatorConfig | None = None,
    *,
    audit: bool = False,
) -> SimResult:
    """Replay ``trace`` on ``cluster`` under a fresh ``policy(cluster, policy_config)``."""
    return Simulator(cluster, policy(cluster, policy_config), config, audit=audit).run(trace)


__all__ = ["Simulator", "simulate"]
