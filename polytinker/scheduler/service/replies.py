"""Typed replies of the scheduler service: one frozen dataclass per answer a client handler gives.

Each is registered with the transport (``sched.r.*``), so a reply travels as a typed message and
the client decodes it into the same class (``polytinker.client`` imports this module). This
module imports no torch.

Retry answers (any call that names a job or does work may get one instead of its result):
``OverloadedReply`` (a bound is reached: retry after ``retry_after_s``) and ``WaitingReply`` (the
job is queued, preempting or paused: ask again soon).

Results: ``JobReply`` (``create_job``, ``job_action``), ``JobQueryReply``, ``JobListReply``,
``RuntimeStatusReply``, ``ForwardBackwardReply``, ``ForwardReply``, ``OptimStepReply``,
``SaveStateReply``, ``LoadStateReply``, ``SaveWeightsReply``, ``ExportWeightsReply``,
``AuditLogReply`` (of ``AuditEntry``), ``UsageReply`` (of ``UsageRow``), ``StorageUsageReply``,
``SampleReply`` (of ``SequenceReply``), ``LogprobsReply``.

What workers answer (``ForwardBackwardReply``, ``ForwardReply``, ``SampleReply``, ``LogprobsReply``
and the rest) is defined with the workers' protocol, ``polytinker.engine.worker.replies``, and
re-exported here: the scheduler hands the ones a client gets on unchanged.

A job is the map ``JobRow.public()`` makes; statistics and events stay maps
(their keys are listed in docs/scheduler-service.md). ``as_dict()`` gives the map a
``ServiceClient`` method answers for the replies it hands to its caller unchanged (``get_job``,
``runtime_status``): ``status`` ``"ok"`` and the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytinker.engine.worker.replies import (
    ActorsNoted,
    AdapterTensors,
    ExportedWeights,
    ForwardBackwardManyReply,
    ForwardBackwardReply,
    ForwardReply,
    Left,
    LogprobsReply,
    Registered,
    SampleReply,
    SavedCheckpoint,
    SequenceReply,
    StepResult,
    WorkersReply,
    WorkerVersion,
)
from polytinker.scheduler.types import JobState
from polytinker.transport.messages import message, to_fields


class _Ok:
    """A result (not a retry answer)."""

    def as_dict(self) -> dict[str, Any]:
        """``{"status": "ok", **fields}``: the map the scheduler answered before replies were typed."""
        return {"status": "ok", **to_fields(self)}


# --- retry answers -----------------------------------------------------------------------------


@message("sched.r.overloaded")
@dataclass(frozen=True)
class OverloadedReply:
    """A bound on calls in flight or queued jobs is reached: retry after ``retry_after_s``."""

    retry_after_s: float
    reason: str = ""


@message("sched.r.waiting")
@dataclass(frozen=True)
class WaitingReply:
    """The job the call names cannot run it now (``state``: queued, preempting or paused)."""

    state: JobState
    retry_after_s: float
    reason: str = ""


# --- jobs --------------------------------------------------------------------------------------


@message("sched.r.job")
@dataclass(frozen=True)
class JobReply(_Ok):
    """``create_job`` and ``job_action``: the job as its tenant sees it (``JobRow.public()``)."""

    job: dict[str, Any]


@message("sched.r.job_query")
@dataclass(frozen=True)
class JobQueryReply(_Ok):
    job: dict[str, Any]
    adapter: dict[str, Any] | None  # agent, version, model_path of its adapter; None for inference jobs
    lora: dict[str, Any] | None  # the adapter's shape (rank, alpha, target_modules, seed) for LoRA jobs
    checkpoints: list[str]  # its save_state names
    events: list[dict[str, Any]]  # its last decisions: time_s, kind, reason
    checkpoint_expiry: dict[str, float] = field(default_factory=dict)  # name -> when it is deleted (Unix time)
    public_checkpoints: list[str] = field(default_factory=list)  # the names every tenant may read
    checkpoint_bytes: dict[str, int] = field(default_factory=dict)  # name -> bytes of its files on the scheduler's disk


@message("sched.r.jobs")
@dataclass(frozen=True)
class JobListReply(_Ok):
    jobs: list[dict[str, Any]]  # public() of each, with calls, in_flight, idle_s where this process knows them
    load: dict[str, Any]  # the tenant's call figures and live jobs by state


@message("sched.r.runtime_status")
@dataclass(frozen=True)
class RuntimeStatusReply(_Ok):
    base_model: str
    workers: list[dict[str, Any]]
    actors: list[dict[str, Any]]
    stats: dict[str, Any]  # per worker id: its own statistics
    learner_switches: dict[str, int]
    tenants: dict[str, Any]  # the caller's own load only
    totals: dict[str, Any]


# --- training ----------------------------------------------------------------------------------


@message("sched.r.optim_step")
@dataclass(frozen=True)
class OptimStepReply:
    version: int  # the new version, durable
    metrics: dict[str, Any]


@message("sched.r.save_state")
@dataclass(frozen=True)
class SaveStateReply:
    path: str  # polytinker-ckpt://JOB/NAME
    version: int


@message("sched.r.load_state")
@dataclass(frozen=True)
class LoadStateReply:
    version: int  # the job's version after the load


@message("sched.r.save_weights")
@dataclass(frozen=True)
class SaveWeightsReply:
    model_path: str  # polytinker://JOB/AGENT@VERSION
    version: int


@message("sched.r.delete_checkpoint")
@dataclass(frozen=True)
class DeleteCheckpointReply:
    name: str
    files_deleted: bool  # False: its files stay, as an adapter's version was loaded from them


@message("sched.r.hold_weights")
@dataclass(frozen=True)
class HoldWeightsReply:
    held: int  # the holder's holds now (after a release: how many adapters it held versions of)


@message("sched.r.checkpoint_ttl")
@dataclass(frozen=True)
class CheckpointTtlReply:
    name: str
    expires_s: float | None  # when it is deleted (Unix time); None: kept


@message("sched.r.publish_checkpoint")
@dataclass(frozen=True)
class PublishCheckpointReply:
    name: str
    public: bool
    was_public: bool  # its state before: the same as ``public`` when nothing changed


@message("sched.r.copy_checkpoint")
@dataclass(frozen=True)
class CopyCheckpointReply:
    job_id: str  # the new job that holds the copy
    path: str  # the copy's path, of the source's kind


@message("sched.r.weights_info")
@dataclass(frozen=True)
class WeightsInfoReply:
    job_id: str
    kind: str  # the saving job's JobKind
    base_model: str
    agent: str
    lora: dict[str, Any] | None  # rank, alpha, target_modules, seed; None for full parameters
    public: bool  # published: every tenant may read it
    owned: bool  # the asking tenant's own


@message("sched.r.audit_entry")
@dataclass(frozen=True)
class AuditEntry:
    """One audited act on saved weights. ``event`` is ``checkpoint_ACTION`` (create, read,
    delete, expire, publish, unpublish, ttl_set); ``tenant`` acted (``"scheduler"`` for an expiry)
    on weights ``owner`` owns; ``path`` names them (``polytinker-ckpt://`` or ``polytinker://``);
    ``details`` adds the checkpoint's name and version, and a read's purpose."""

    time_s: float
    event: str
    tenant: str
    owner: str
    job_id: str
    path: str
    details: dict[str, Any]


@message("sched.r.audit_log")
@dataclass(frozen=True)
class AuditLogReply:
    entries: list[AuditEntry]  # oldest first
    truncated: bool  # the day had more entries than one answer carries (AuditLog.MAX_ENTRIES)


@message("sched.r.usage_row")
@dataclass(frozen=True)
class UsageRow:
    bucket_s: float  # the UTC hour's start (Unix time)
    kind: str  # training, sampling_prefill, sampling_sample (tokens) or checkpoint (saves)
    base_model: str
    job_id: str
    count: int


@message("sched.r.usage")
@dataclass(frozen=True)
class UsageReply:
    rows: list[UsageRow]  # by hour, then kind and job


@message("sched.r.storage_usage")
@dataclass(frozen=True)
class StorageUsageReply:
    checkpoint_count: int  # named checkpoints the tenant keeps
    size_bytes: int  # their files on the scheduler's disk (a remote learner's count 0)


@message("sched.r.export_weights")
@dataclass(frozen=True)
class ExportWeightsReply:
    version: int
    base_model: str
    # A version's adapter_config.json as text; "" for full parameters and for a save_state
    # checkpoint, whose meta.json (checkpoint_meta) holds its LoRA shape.
    adapter_config: str
    # adapter_model.safetensors (full, or a checkpoint: its weights.safetensors, in peft's key
    # layout for an adapter) as one uint8 array, a raw frame
    weights: Any
    full: bool = False  # full parameters: every weight of the model
    checkpoint_meta: str = ""  # a learner checkpoint's meta.json (full, or a save_state checkpoint)


__all__ = [
    "ActorsNoted",
    "AdapterTensors",
    "AuditEntry",
    "AuditLogReply",
    "CheckpointTtlReply",
    "CopyCheckpointReply",
    "DeleteCheckpointReply",
    "ExportWeightsReply",
    "ExportedWeights",
    "ForwardBackwardManyReply",
    "ForwardBackwardReply",
    "ForwardReply",
    "HoldWeightsReply",
    "JobListReply",
    "JobQueryReply",
    "JobReply",
    "Left",
    "LoadStateReply",
    "LogprobsReply",
    "OptimStepReply",
    "OverloadedReply",
    "PublishCheckpointReply",
    "Registered",
    "RuntimeStatusReply",
    "SampleReply",
    "SaveStateReply",
    "SaveWeightsReply",
    "SavedCheckpoint",
    "SequenceReply",
    "StepResult",
    "StorageUsageReply",
    "UsageReply",
    "UsageRow",
    "WaitingReply",
    "WeightsInfoReply",
    "WorkerVersion",
    "WorkersReply",
]
