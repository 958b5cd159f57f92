"""What a simulation run gives back: one ``JobOutcome`` per job of the trace, and the ``SimResult``.

``SimResult`` holds the outcomes, the policy's full decision log, utilization (busy resource-time
over available resource-time, counting for each engine or learner group only the time when some
queued job needed that kind of resource of that base model, and for a hybrid worker when some queued
job of its base model waited) and where learner and engine time went;
its methods give JCT statistics (JCT = finish - arrival). ``polytinker.scheduler.simulator``
produces it (``_sim_metrics`` counts the time and builds it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from polytinker.scheduler.types import Decision, JobID, JobKind


@dataclass(frozen=True)
class JobOutcome:
    job_id: JobID
    tenant: str
    kind: JobKind
    priority: int
    arrival_s: float
    first_start_s: float | None
    finish_s: float | None  # None: rejected, or not finished by max_time_s
    preemptions: int
    retries: int  # Overloaded answers it got before being queued
    rejected: str | None  # the reason, if rejected
    discarded_samples: int = 0  # rollouts sampled ahead and thrown away at a preemption (async jobs)
    staleness: int = 0  # most steps any of its rollouts was sampled behind (0: always on-policy)

    @property
    def jct_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True)
class SimResult:
    policy: str
    outcomes: tuple[JobOutcome, ...]
    decisions: tuple[Decision, ...]
    utilization: float  # busy resource-time / resource-time while a queued job needed that kind of resource
    learner_utilization: float
    engine_utilization: float
    end_s: float
    # Where learner and engine time went while work for them was queued, as fractions: learners
    # "train", "swap", "full_rl_sampling" (a full-parameter job's group waits for its engine),
    # "shared_sampling" (every job on the group is sampling, loading or saving), "empty"; engines
    # "sampling", "discarded_sampling" (rollouts sampled ahead by an async job and thrown away when
    # it was preempted: not busy), "idle_with_jobs", "idle_empty".
    learner_time: dict[str, float] = field(default_factory=dict)
    engine_time: dict[str, float] = field(default_factory=dict)
    # Hybrid workers (nan, empty and 0 on a cluster without them): their utilization, where their
    # time went ("train", "sampling", "discarded_sampling", "switch", "swap", "idle_with_jobs",
    # "empty") and how many times they changed phase.
    hybrid_utilization: float = math.nan
    hybrid_time: dict[str, float] = field(default_factory=dict)
    phase_switches: int = 0
    # Share of all resource-time (every engine, group and worker, from 0 to ``end_s``) that the
    # utilization figures count as available: how much of the run they speak for.
    counted_share: float = math.nan

    def jcts_s(self) -> list[float]:
        return sorted(o.jct_s for o in self.outcomes if o.jct_s is not None)

    def mean_jct_s(self) -> float:
        jcts = self.jcts_s()
        return sum(jcts) / len(jcts) if jcts else math.nan

    def percentile_jct_s(self, p: float) -> float:
        """Nearest-rank percentile, p in [0, 100]."""
        jcts = self.jcts_s()
        if not jcts:
            return math.nan
        return jcts[min(len(jcts) - 1, max(0, math.ceil(p / 100 * len(jcts)) - 1))]


def time_shares(times: Mapping[str, float]) -> dict[str, float]:
    """Accumulated seconds per state as fractions of their total (empty if no time was counted)."""
    total = sum(times.values())
    return {k: v / total for k, v in sorted(times.items())} if total else {}


__all__ = ["JobOutcome", "SimResult", "time_shares"]
