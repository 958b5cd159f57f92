"""The simulator's measurements: where each resource's time goes while work for it is queued, and
the ``SimResult`` built from them at the end of a run.

Only time when some queued job needed that kind of resource (an engine or a learner group) of that
base model is counted: idle capacity then had work it could have been given; idle capacity no
waiting job could use is not a policy's fault. Utilization is busy resource-time over that
available resource-time. An engine is busy while it samples (at full throughput, shared out to the
jobs sampling there); an async job's share stays booked to its sampled, untrained steps, which a
preemption throws away (``Simulator._discard_ahead`` moves that time to ``discarded_sampling``). A
learner group is busy while it trains. Where the rest went: a group's ``swap``,
``full_rl_sampling``, ``shared_sampling`` or ``empty``, an engine's ``idle_with_jobs`` or
``idle_empty``; a hybrid worker's time is counted by ``polytinker.scheduler._sim_hybrid``.

The outputs (a ``SimResult``, in ``polytinker.scheduler.sim_result``): per-job completion times
(JCT = finish - arrival), utilization, where the time went, the full decision log.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from polytinker.scheduler._sim_state import SimulatorParts
from polytinker.scheduler.sim_result import JobOutcome, SimResult, time_shares
from polytinker.scheduler.types import ResourceID


class SimMetrics(SimulatorParts):
    """The measuring part of ``Simulator`` (a mixin on the simulator's attributes)."""

    # Its own: time per state; what each engine or group is needed for (base model, "engine" or
    # "learner").
    _learner_time: defaultdict[str, float]
    _engine_time: defaultdict[str, float]
    _needs: dict[ResourceID, tuple[str, str]]

    def _init_metrics(self) -> None:
        """Counters for the engines and learner groups (a hybrid worker joins ``_busy_s`` and
        ``_pending_s`` in ``_init_hybrids``; it is not in ``_needs``)."""
        self._busy_s = dict.fromkeys([*self._learners, *self._sampling], 0.0)
        self._pending_s = dict.fromkeys(self._busy_s, 0.0)
        self._learner_time = defaultdict(float)
        self._engine_time = defaultdict(float)
        self._needs = {g.group_id: (g.base_model, "learner") for g in self.cluster.learners}
        self._needs.update({e.engine_id: (e.base_model, "engine") for e in self.cluster.engines})

    def _count_time(self, dt: float) -> None:
        """``dt`` seconds passed with jobs queued: count them on the engines and learner groups."""
        # Only time when a queued job could have used the resource counts: idle capacity that no
        # waiting job can use (another base model, another kind of machine) is not a policy's fault.
        for rid, (base, kind) in self._needs.items():
            if not self.policy.queued_needing(base, kind):
                continue
            self._pending_s[rid] += dt
            if kind == "learner":
                self._busy_s[rid] += dt if self._learners[rid].training else 0.0
                self._learner_time[self._learner_state(rid)] += dt
            else:
                busy = self._sampling_busy(rid, dt)
                self._busy_s[rid] += busy
                self._engine_time["sampling"] += busy
                self._engine_time["idle_with_jobs" if self._holders[rid] else "idle_empty"] += dt - busy

    def _sampling_busy(self, rid: ResourceID, dt: float) -> float:
        """Busy seconds of engine (or hybrid worker) ``rid`` over ``dt`` from the jobs sampling there,
        shared out to each async job's sample in flight (what a preemption would throw away)."""
        active = self._sampling[rid]
        busy = dt * min(1.0, len(active) / self.config.engine_full_speed_jobs)
        for job_id in active:
            r = self._runs[job_id]
            if r.job.is_async:
                r.inflight_busy_s += busy / len(active)
        return busy

    def _learner_state(self, gid: ResourceID) -> str:
        g = self._learners[gid]
        if g.training:
            return "train"
        if g.busy is not None:
            return "swap"
        holders = self._holders[gid]
        if not holders:
            return "empty"
        if any(self._runs[j].job.kind.exclusive_learner for j in holders):
            return "full_rl_sampling"
        return "shared_sampling"

    def _result(self) -> SimResult:
        outcomes = tuple(
            JobOutcome(
                r.job.job_id,
                r.job.tenant,
                r.job.kind,
                r.job.priority,
                r.job.arrival_s,
                r.first_start_s,
                r.finish_s,
                r.preemptions,
                r.retries,
                r.rejected,
                r.discarded,
                r.staleness,
            )
            for r in self._runs.values()
        )

        def util(ids: Sequence[ResourceID]) -> float:
            avail = sum(self._pending_s[i] for i in ids)
            return sum(self._busy_s[i] for i in ids) / avail if avail else math.nan

        learners = [g for g in self._learners if g not in self._hybrid]
        engines = [e for e in self._sampling if e not in self._hybrid]
        hybrids = list(self._hybrid)
        counted = sum(self._pending_s.values())
        return SimResult(
            policy=self.policy.name,
            outcomes=outcomes,
            decisions=tuple(self._log),
            utilization=util(learners + engines + hybrids),
            learner_utilization=util(learners),
            engine_utilization=util(engines),
            end_s=self.now_s,
            learner_time=time_shares(self._learner_time),
            engine_time=time_shares(self._engine_time),
            hybrid_utilization=util(hybrids),
            hybrid_time=time_shares(self._hybrid_time),
            phase_switches=sum(h.switches for h in self._hybrid.values()),
            counted_share=counted / (len(self._pending_s) * self.now_s) if self.now_s else math.nan,
        )


__all__ = ["SimMetrics"]
