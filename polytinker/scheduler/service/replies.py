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

Workers answer the scheduler with typed replies too: the learner ``WorkerVersion`` (``sched.w.ensure``,
``sched.w.load``), ``ForwardBackwardReply`` (``sched.w.fb``), ``ForwardReply`` (``sched.w.forward``),
``StepResult`` (``sched.w.step``), ``SavedCheckpoint`` (``sched.w.save``), ``ExportedWeights``
(``sched.w.export``); the engine ``SampleReply`` (``sched.w.sample``) and ``LogprobsReply``
(``sched.w.logprobs``). The scheduler hands the ones a client gets unchanged on. Statistics
(``sched.w.stats``) stay a map of counters. The scheduler answers a worker's ``sched.w.register``
with ``Registered``, and the local runtime's ``sched.w.workers`` and ``sched.w.actors`` with
``WorkersReply`` and ``ActorsNoted``.

A job is the map ``JobRow.public()`` makes; statistics and events stay maps
(their keys are listed in docs/scheduler-service.md). ``as_dict()`` gives the map a
``ServiceClient`` method answers for the replies it hands to its caller unchanged (``get_job``,
``runtime_status``): ``status`` ``"ok"`` and the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytinker.engine.types import AdapterRef, AdapterWeights, LoraConfig, TensorLayout
from polytinker.errors import ProtocolError
from polytinker.scheduler.types import JobState
from polytinker.transport.messages import message, register_message, to_fields


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


@message("sched.r.forward_backward")
@dataclass(frozen=True)
class ForwardBackwardReply:
    loss: float
    logprobs: list[list[float]]  # per datum, per target token
    metrics: dict[str, Any]


@message("sched.r.forward_backward_many")
@dataclass(frozen=True)
class ForwardBackwardManyReply:
    results: tuple[ForwardBackwardReply, ...]  # one per item of the batch, in order


# An adapter's layout travels inside AdapterTensors: registered where that message is defined,
# so every process that can decode the one decodes the other.
register_message("sched.tensor_layout", TensorLayout, reused=True)


@message("sched.r.adapter_tensors")
@dataclass(frozen=True)
class AdapterTensors:
    """A LoRA version's tensors and its shape, from the learner that trained it
    (``sched.w.adapter_weights``); the scheduler hands it on to an engine (``EnginePutAdapter``).
    The tensors travel as one flat buffer (one frame, out of band) that ``layout`` (peft's keys
    and the shapes, in order) cuts up."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    layout: TensorLayout
    flat: Any  # a 1-D torch tensor

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank >= 1 and isinstance(self.layout, TensorLayout)):
            raise ProtocolError("AdapterTensors: rank must be an int >= 1 and layout a TensorLayout")
        # The known equal layout, whose sizes are computed already (every version repeats it).
        object.__setattr__(self, "layout", self.layout.interned())
        if getattr(self.flat, "dim", lambda: -1)() != 1 or self.flat.numel() != self.layout.numel:
            raise ProtocolError(f"AdapterTensors: flat must be a 1-D tensor of {self.layout.numel} elements")

    @classmethod
    def of(cls, weights: AdapterWeights) -> AdapterTensors:
        """From an ``AdapterWeights`` (sharing its buffer)."""
        c = weights.config
        return cls(c.rank, c.alpha, tuple(c.target_modules), weights.layout, weights.flat)

    def weights(self, ref: AdapterRef) -> AdapterWeights:
        """As the ``AdapterWeights`` of ``ref`` (sharing ``flat``: treat it as read-only)."""
        lora = LoraConfig(rank=self.rank, alpha=self.alpha, target_modules=tuple(self.target_modules))
        return AdapterWeights(ref, lora, self.flat, self.layout)


@message("sched.r.forward")
@dataclass(frozen=True)
class ForwardReply:
    logprobs: list[list[float]]
    loss: float = 0.0  # with a loss_fn: the summed loss, and the learner's metrics (as forward_backward's)
    metrics: dict[str, float] = field(default_factory=dict)


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


# --- sampling ----------------------------------------------------------------------------------


@message("sched.r.sequence")
@dataclass(frozen=True)
class SequenceReply:
    """One sampled completion: its tokens, each one's logprob, why it stopped, its text."""

    tokens: list[int]
    logprobs: list[float]  # one per token, under the distribution sampled from
    stop_reason: str  # "stop" (a stop string or token, EOS included), "length" or "abort"
    text: str


@message("sched.r.sample")
@dataclass(frozen=True)
class SampleReply:
    sequences: list[SequenceReply]  # num_samples of them


@message("sched.r.logprobs")
@dataclass(frozen=True)
class LogprobsReply:
    logprobs: list[list[float]]  # per sequence, per token after the first
    # With top_k: per sequence, per position, the k likeliest next tokens as [token id, logprob].
    topk: list[list[list[tuple[int, float]]]] | None = None


# --- workers -> scheduler (besides the results above that go on to the client as they are) ----------


@message("sched.wr.version")
@dataclass(frozen=True)
class WorkerVersion:
    """``ensure`` and ``load``: the adapter's (or full-parameter model's) version now resident."""

    version: int | None


@message("sched.wr.step")
@dataclass(frozen=True)
class StepResult:
    """``step``: the new version and where this learner wrote it (paths relative to its state root)."""

    version: int
    checkpoint: str
    export_dir: str  # what engines load ("" without export; a full-parameter version: the checkpoint)
    metrics: dict[str, Any]


@message("sched.wr.save")
@dataclass(frozen=True)
class SavedCheckpoint:
    checkpoint: str  # relative to the learner's state root
    version: int


@message("sched.wr.export")
@dataclass(frozen=True)
class ExportedWeights:
    weights: str  # relative to the learner's state root


# --- scheduler -> workers and the runtime that launched them ------------------------------------


@message("sched.wr.registered")
@dataclass(frozen=True)
class Registered:
    known: bool  # this incarnation at this address was registered already (a re-registration)


@message("sched.wr.workers")
@dataclass(frozen=True)
class WorkersReply:
    workers: list[dict[str, Any]]  # per worker: worker_id, role, address, incarnation, alive, ...


@message("sched.wr.actors_noted")
@dataclass(frozen=True)
class ActorsNoted:
    """The scheduler took an ``ActorsReport`` in."""


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
