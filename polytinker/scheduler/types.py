"""Domain vocabulary of the scheduler's decision core.

- ``JobID``, ``TenantID``, ``ResourceID``, ``AdapterID``, ``BaseModelID``: names (plain strings).
- ``JobKind``: LoRA RL, full-parameter RL, SFT, inference; what each needs (engine, learner, exclusivity).
- ``JobState``: where a job is in its life (queued, running, preempting, paused, done, ...).
- ``Job``: one submitted job: tenant, kind, base model, priority, size (steps, seconds per step), memory,
  and for RL jobs how far its sampling may run ahead of its training (``max_staleness``: 0 sync, >= 1 async).
- ``EngineSpec`` / ``LearnerSpec`` / ``HybridSpec`` / ``ClusterSpec``: the machines a policy places jobs on
  (a hybrid worker holds one copy of the base model and both samples and trains the jobs placed on it).
- ``Placement``: the learner group and engine a running job holds (the same id twice on a hybrid worker).
- ``DecisionKind`` / ``Decision``: one logged decision and its reason; the policy returns them, the caller logs.
- ``Accepted`` / ``Overloaded`` / ``Rejected``: what a submission answers (``SubmitResult``).

Units are in the names: ``_s`` seconds, ``_gb`` gibibytes. This module imports nothing heavy (no torch),
so the policy and the simulator run anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from polytinker.errors import ConfigError

JobID = str
TenantID = str
ResourceID = str
AdapterID = str
BaseModelID = str


class JobKind(StrEnum):
    LORA_RL = "lora_rl"  # samples on an engine with its adapter, trains the adapter on a shared learner group
    FULL_RL = "full_rl"  # samples on an engine, trains all weights: a learner group to itself
    SFT = "sft"  # LoRA supervised fine-tuning: a shared learner group, no engine
    INFERENCE = "inference"  # sampling only: an engine (an adapter slot when it names an adapter)

    @property
    def needs_engine(self) -> bool:
        return self is not JobKind.SFT

    @property
    def needs_learner(self) -> bool:
        return self is not JobKind.INFERENCE

    @property
    def exclusive_learner(self) -> bool:
        return self is JobKind.FULL_RL


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTING = "preempting"  # told to stop at its next step boundary and save its state
    PAUSED = "paused"  # the service's: paused by its tenant or for being idle (out of the policy until resumed)
    DONE = "done"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Job:
    """One job as submitted. Its size is declared: ``steps`` optimizer steps (request batches for
    inference), each taking ``sample_s`` on an engine and ``step_s`` on a learner group.

    ``max_staleness`` is the training loop's mode (``TrainConfig.mode`` / ``max_staleness`` in
    polytinker.agents): 0 (sync) samples step k, then trains it; n >= 1 (async, RL kinds only)
    samples step k while up to n earlier sampled steps are not trained yet, so with 1 the rollouts of
    step k+1 are sampled while step k trains (one-step off-policy). Busy time per step is the same
    either way (``work_s``); only the time alone (``span_s``) is shorter when the loop is async."""

    job_id: JobID
    tenant: TenantID
    kind: JobKind
    base_model: BaseModelID
    priority: int = 0  # higher runs first and may preempt lower
    steps: int = 1
    step_s: float = 0.0  # learner compute per step (0 for inference)
    sample_s: float = 0.0  # engine compute per step (0 for sft)
    learner_mem_gb: float = 0.0  # adapter + optimizer state + activations (whole group for full_rl)
    engine_mem_gb: float = 0.0  # KV cache share (and weights for full_rl) on the engine
    arrival_s: float = 0.0
    adapter: AdapterID | None = None  # the LoRA adapter it samples with; None: the base model
    max_staleness: int = 0  # RL loop mode: 0 sync; n >= 1 async, sampling at most n steps ahead of training

    def __post_init__(self) -> None:
        if not self.job_id or not self.tenant or not self.base_model:
            raise ConfigError("Job needs a non-empty job_id, tenant and base_model")
        if self.steps <= 0:
            raise ConfigError(f"Job {self.job_id}: steps must be positive, got {self.steps}")
        if min(self.step_s, self.sample_s, self.learner_mem_gb, self.engine_mem_gb) < 0:
            raise ConfigError(f"Job {self.job_id}: times and memory must be >= 0")
        if self.kind.needs_learner and (self.step_s <= 0 or self.learner_mem_gb <= 0):
            raise ConfigError(f"Job {self.job_id} ({self.kind}): set step_s > 0 and learner_mem_gb > 0")
        if not self.kind.needs_learner and (self.step_s or self.learner_mem_gb):
            raise ConfigError(f"Job {self.job_id} (inference) uses no learner: leave step_s and learner_mem_gb at 0")
        if self.kind.needs_engine and (self.sample_s <= 0 or self.engine_mem_gb <= 0):
            raise ConfigError(f"Job {self.job_id} ({self.kind}): set sample_s > 0 and engine_mem_gb > 0")
        if not self.kind.needs_engine and (self.sample_s or self.engine_mem_gb or self.adapter):
            raise ConfigError(f"Job {self.job_id} (sft) uses no engine: leave sample_s, engine_mem_gb, adapter unset")
        if self.kind is JobKind.LORA_RL and not self.adapter:
            raise ConfigError(f"Job {self.job_id} (lora_rl) must name its adapter")
        if self.kind is JobKind.FULL_RL and self.adapter:
            raise ConfigError(f"Job {self.job_id} (full_rl) trains all weights: leave adapter unset")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"Job {self.job_id}: max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if self.max_staleness and not (self.kind.needs_engine and self.kind.needs_learner):
            raise ConfigError(f"Job {self.job_id} ({self.kind}): only RL jobs run async; leave max_staleness at 0")

    @property
    def needs_slot(self) -> bool:
        """Whether it holds an adapter slot on its engine."""
        return self.kind.needs_engine and self.adapter is not None

    @property
    def step_work_s(self) -> float:
        return self.step_s + self.sample_s

    @property
    def work_s(self) -> float:
        """Declared busy time if it ran alone: the size the policy orders by."""
        return self.steps * self.step_work_s

    @property
    def is_async(self) -> bool:
        """Whether its sampling overlaps its training (an RL job with ``max_staleness`` >= 1)."""
        return self.max_staleness > 0

    def span_s(self, steps: int | None = None) -> float:
        """Declared time from its first sample to its last step trained if it ran alone, for its
        remaining ``steps`` (default all). Sync: ``steps x (sample_s + step_s)``. Async: the first
        sample, then each step takes the longer of its sampling and its training, then the last
        training: ``sample_s + (steps - 1) x max(sample_s, step_s) + step_s`` (any staleness bound
        >= 1 gives this when every step takes the same time)."""
        n = self.steps if steps is None else steps
        if n <= 0:
            return 0.0
        if not self.is_async:
            return n * self.step_work_s
        return self.sample_s + (n - 1) * max(self.sample_s, self.step_s) + self.step_s


@dataclass(frozen=True)
class EngineSpec:
    engine_id: ResourceID
    base_model: BaseModelID
    memory_gb: float  # for KV cache and full-parameter weights, beyond the base model itself
    adapter_slots: int  # LoRA adapters it can hold at once (vLLM's max_loras)

    def __post_init__(self) -> None:
        if self.memory_gb <= 0 or self.adapter_slots < 0:
            raise ConfigError(f"Engine {self.engine_id}: memory_gb must be > 0 and adapter_slots >= 0")


@dataclass(frozen=True)
class LearnerSpec:
    """A learner group. Shared (LoRA) jobs take turns at step boundaries: only the job training now
    needs its working set in accelerator memory; the others' optimizer states wait in host memory."""

    group_id: ResourceID
    base_model: BaseModelID
    memory_gb: float  # accelerator memory beyond the base weights: the working set of the job training
    max_jobs: int = 16  # jobs time-sliced on the group at once
    host_memory_gb: float = 512.0  # holds the states of the shared jobs (each counted at its learner_mem_gb)

    def __post_init__(self) -> None:
        if self.memory_gb <= 0 or self.max_jobs < 1 or self.host_memory_gb <= 0:
            raise ConfigError(f"Learner group {self.group_id}: memory_gb > 0, max_jobs >= 1, host_memory_gb > 0")


@dataclass(frozen=True)
class HybridSpec:
    """A hybrid (colocated) worker: one copy of the base model that serves both the sampling and the
    training of the jobs placed on it, switching between the two phases (its time goes to whichever
    has work). In the sampling phase it is an engine (``kv_memory_gb``, ``adapter_slots``); in the
    training phase a learner group (``memory_gb``, ``max_jobs``, ``host_memory_gb``). The KV cache is
    released for training and allocated again for sampling, so each phase has the memory to itself.
    A full-parameter job takes the whole worker: its one copy of the weights serves both phases."""

    worker_id: ResourceID
    base_model: BaseModelID
    memory_gb: float  # training phase: the working set of the job training (as LearnerSpec.memory_gb)
    kv_memory_gb: float  # sampling phase: KV caches of the jobs placed here (as EngineSpec.memory_gb)
    adapter_slots: int = 8
    max_jobs: int = 16  # learner jobs time-sliced on it at once
    host_memory_gb: float = 512.0  # optimizer states of the shared jobs not training now

    def __post_init__(self) -> None:
        if min(self.memory_gb, self.kv_memory_gb, self.host_memory_gb) <= 0:
            raise ConfigError(f"Hybrid worker {self.worker_id}: memory_gb, kv_memory_gb, host_memory_gb must be > 0")
        if self.adapter_slots < 0 or self.max_jobs < 1:
            raise ConfigError(f"Hybrid worker {self.worker_id}: adapter_slots >= 0 and max_jobs >= 1")

    def engine_spec(self) -> EngineSpec:
        """Its sampling side, as an engine of the same id."""
        return EngineSpec(self.worker_id, self.base_model, self.kv_memory_gb, self.adapter_slots)

    def learner_spec(self) -> LearnerSpec:
        """Its training side, as a learner group of the same id."""
        return LearnerSpec(self.worker_id, self.base_model, self.memory_gb, self.max_jobs, self.host_memory_gb)


@dataclass(frozen=True)
class ClusterSpec:
    engines: tuple[EngineSpec, ...]
    learners: tuple[LearnerSpec, ...]
    hybrids: tuple[HybridSpec, ...] = ()

    def __post_init__(self) -> None:
        ids = [e.engine_id for e in self.engines] + [g.group_id for g in self.learners]
        ids += [h.worker_id for h in self.hybrids]
        if len(set(ids)) != len(ids):
            raise ConfigError("ClusterSpec: engine, learner group and hybrid worker ids must be unique")


@dataclass(frozen=True)
class Placement:
    """Where a running job sits: a learner group, an engine, or both (by its kind). On a hybrid worker
    both name the worker (one of them for SFT or inference)."""

    learner: ResourceID | None = None
    engine: ResourceID | None = None

    def resources(self) -> tuple[ResourceID, ...]:
        return tuple(dict.fromkeys(r for r in (self.learner, self.engine) if r is not None))


class DecisionKind(StrEnum):
    ADMIT = "admit"  # queued
    REJECT = "reject"  # can never run here (oversized, unknown base model)
    OVERLOADED = "overloaded"  # queue full: retry later
    START = "start"  # run now on the placement given
    PREEMPT = "preempt"  # stop at the next step boundary, save state first, requeue
    RESERVE = "reserve"  # keep these resources for a waiting job (nothing lower may take them)
    REQUEUE = "requeue"  # a preempted job, its state saved, is back in the queue
    FINISH = "finish"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    time_s: float
    job_id: JobID
    reason: str  # why, in words a person reading the log understands
    tenant: TenantID = ""
    placement: Placement | None = None
    save_state: bool = False  # PREEMPT: the job's state must be saved before its resources are freed
    for_job: JobID | None = None  # PREEMPT / RESERVE: the job that gains from it
    load_adapter: bool = False  # START: the engine must load the job's adapter first
    evicted: AdapterID | None = None  # START: the adapter evicted from the engine to make room

    def __str__(self) -> str:
        extra = f" on {self.placement.resources()}" if self.placement else ""
        extra += f" for {self.for_job}" if self.for_job else ""
        return f"[{self.time_s:.3f}s] {self.kind} {self.job_id}{extra}: {self.reason}"


@dataclass(frozen=True)
class Accepted:
    decision: Decision
    ok: bool = True


@dataclass(frozen=True)
class Overloaded:
    """The queue is full: come back in ``retry_after_s`` seconds (nothing was queued)."""

    decision: Decision
    retry_after_s: float
    ok: bool = False


@dataclass(frozen=True)
class Rejected:
    """The job can never run on this cluster; ``decision.reason`` says why."""

    decision: Decision
    ok: bool = False


SubmitResult = Accepted | Overloaded | Rejected

__all__ = [
    "Accepted",
    "AdapterID",
    "BaseModelID",
    "ClusterSpec",
    "Decision",
    "DecisionKind",
    "EngineSpec",
    "HybridSpec",
    "Job",
    "JobID",
    "JobKind",
    "JobState",
    "LearnerSpec",
    "Overloaded",
    "Placement",
    "Rejected",
    "ResourceID",
    "SubmitResult",
    "TenantID",
]
