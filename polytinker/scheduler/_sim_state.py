"""The simulator's mutable records: a job's life (``JobRun``), a learner group's turn-taking
(``GroupState``) and a hybrid worker's phase (``HybridPhase``); and ``SimulatorParts``, the
simulator's attributes that its parts (the mixins in ``_sim_hybrid`` and ``_sim_metrics``) read.
Used by ``simulator`` and those parts only."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Literal

from polytinker.scheduler.config import SimulatorConfig
from polytinker.scheduler.policy_base import SchedulingPolicy
from polytinker.scheduler.types import ClusterSpec, Decision, HybridSpec, Job, JobID, Placement, ResourceID


@dataclass
class JobRun:
    """A job's life in the simulation."""

    job: Job
    placement: Placement | None = None
    steps_done: int = 0
    gen: int = 0  # bumped on each start, so events of an earlier run are ignored
    stop: bool = False  # PREEMPT received: stop at the next step boundary
    sample_token: int = -1  # matches the one pending end-of-sampling event that is still valid
    sampled: int = 0  # steps whose rollouts are sampled (steps_done of them trained, the rest waiting)
    sampling: bool = False  # the rollouts of step ``sampled`` are being sampled now
    # Async jobs: engine busy time counted for the sample in flight, and for each sampled step not yet
    # trained (what a preemption would throw away).
    inflight_busy_s: float = 0.0
    untrained_busy_s: deque[float] = field(default_factory=deque)
    discarded: int = 0
    staleness: int = 0
    first_start_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    retries: int = 0
    rejected: str | None = None


@dataclass
class GroupState:
    """A learner group (or a hybrid worker's training side): the step training and the steps ready."""

    busy: JobID | None = None  # training (or swapping in) this job's step
    training: bool = False  # False while swapping: not counted as busy
    last: JobID | None = None  # whose optimizer state is loaded
    ready: dict[JobID, None] = field(default_factory=dict)  # sampled, waiting to train (insertion order)
    last_run_s: dict[JobID, float] = field(default_factory=dict)


@dataclass
class HybridPhase:
    """A hybrid worker's phase: ``"sample"`` (its engine side serves the jobs' sampling batches) or
    ``"train"`` (its learner side trains one step at a time); ``switching`` while it moves to
    ``phase`` (the KV cache released or allocated again), which takes a ``SimulatorConfig`` switch cost."""

    spec: HybridSpec
    phase: Literal["sample", "train"] = "sample"
    switching: bool = False
    # Sampling requests held until the sampling phase (job -> seconds of work at full speed): a batch
    # asked for while the worker trains, switches, or has a training step waiting.
    waiting: dict[JobID, float] = field(default_factory=dict)
    switches: int = 0


class SimulatorParts:
    """The attributes of ``Simulator`` that its parts read and update (declared once here; the
    simulator sets them in ``__init__``)."""

    cluster: ClusterSpec
    config: SimulatorConfig
    policy: SchedulingPolicy
    now_s: float
    _runs: dict[JobID, JobRun]
    _learners: dict[ResourceID, GroupState]
    _sampling: dict[ResourceID, dict[JobID, float]]
    _sampled_at: dict[ResourceID, float]
    _holders: dict[ResourceID, set[JobID]]
    _hybrid: dict[ResourceID, HybridPhase]
    _hybrid_time: defaultdict[str, float]
    _log: list[Decision]
    # Per resource: its busy time, and the time work for it was queued (the measurements').
    _busy_s: dict[ResourceID, float]
    _pending_s: dict[ResourceID, float]


__all__ = ["GroupState", "HybridPhase", "JobRun", "SimulatorParts"]
