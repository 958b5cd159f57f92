"""Typed messages of the scheduler service: one frozen dataclass per request kind.

Each is registered with the transport under its RPC kind, so the server decodes a request into
exactly its type (``__post_init__`` validation runs at the edge) and rejects anything else.
This module imports no torch: the scheduler process stays light.

Client -> scheduler (every one carries ``api_key``): ``CreateJob``, ``JobQuery``, ``JobAction``,
``ListJobs``, ``ForwardBackward``, ``Forward``, ``OptimStep``, ``SaveState``, ``LoadState``,
``SaveWeights``, ``Sample``, ``ComputeLogprobs``, ``ExportWeights``, ``DeleteCheckpoint``,
``SetCheckpointTtl``, ``PublishCheckpoint``, ``WeightsInfo``, ``CopyCheckpoint``, ``AuditLog``,
``Usage``, ``StorageUsage``, ``RuntimeStatus``.

Nested values: ``polytinker.engine.types.Datum`` (one training example) and ``SamplingParams``
(sampling parameters), registered here as message values: the learner and the engine get the
very objects the client built; shared with the messages between the scheduler and its workers
(``polytinker.engine.worker.messages``).
The replies to the client requests are typed too: ``polytinker.scheduler.service.replies``. Each
request derives from ``Request[Reply]``, naming its result there, so the client sends it with
``Connection.ask`` (the kind and the reply type come from the class) and the service files its
handler by class. A guarded call may also be answered with a retry answer (``OverloadedReply``,
``WaitingReply``), which the client's connection handles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import (
    LOSS_FNS,
    MAX_SAMPLES,
    Datum,
    ModelLimits,
    SamplingParams,
    check_data,
    check_loss_config,
    check_token_ids,
    check_top_k,
    need,
)
from polytinker.engine.worker.layout import check_name
from polytinker.model_path import CKPT_PREFIX, MODEL_PREFIX
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.types import JobKind
from polytinker.transport.messages import message
from polytinker.transport.requests import Request

JOB_KINDS = tuple(str(k) for k in JobKind)  # ("lora_rl", "full_rl", "sft", "inference")
_RL_KINDS = (JobKind.LORA_RL, JobKind.FULL_RL)  # they sample and train
JOB_ACTIONS = ("cancel", "pause", "resume", "finish")
MAX_DATA = 100_000  # datums in one call
MAX_PROMPTS = 4096
MAX_STEPS = 1_000_000_000  # a job's step budget
MAX_NAME_CHARS = 256  # a base model's or an adapter's name
MAX_TARGET_MODULES = 64


MAX_REQUEST_ID = 64


def request_id_ok(request_id: str, attempt: int, field: str = "request_id") -> None:
    need(
        len(request_id) <= MAX_REQUEST_ID and all(c.isascii() and (c.isalnum() or c in "-_") for c in request_id),
        f"{field}: at most {MAX_REQUEST_ID} ASCII letters, digits, '-' or '_'",
    )
    need(isinstance(attempt, int) and 0 <= attempt < 1_000_000, "attempt must be an int in [0, 1000000)")


# --- client -> scheduler --------------------------------------------------------------------


@message("sched.create_job")
@dataclass(frozen=True)
class CreateJob(Request[r.JobReply]):
    api_key: str
    kind: str  # a JobKind value; __post_init__ checks it and makes it the JobKind
    base_model: str
    agent: str = "default"
    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ()
    seed: int = 0
    priority: int = 0
    steps: int = 0  # 0: the runtime's default
    adapter: str = ""  # inference jobs: "job_id/agent" of one of the tenant's adapters
    max_staleness: int = 0  # RL jobs: the client samples up to this many steps ahead of training (async)
    request_key: str = ""  # one per call, the same on its resends: a repeat gets the first one's job (request_keys.py)

    def __post_init__(self) -> None:
        request_id_ok(self.request_key, 0, "request_key")
        need(self.kind in JOB_KINDS, f"job kind must be one of {JOB_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "kind", JobKind(self.kind))
        check_name("agent", self.agent)  # part of the adapter key, and so of its paths on the workers
        need(self.max_staleness >= 0, "max_staleness must be >= 0")
        need(
            not self.max_staleness or self.kind in _RL_KINDS,
            f"max_staleness is for RL jobs (they sample and train); a {self.kind} job leaves it at 0",
        )
        need(
            0 < len(self.base_model) <= MAX_NAME_CHARS,
            f"base_model must be named (at most {MAX_NAME_CHARS} characters)",
        )
        need(len(self.adapter) <= MAX_NAME_CHARS, f"adapter: at most {MAX_NAME_CHARS} characters")
        need(0 < self.rank <= 1024, f"rank must be in 1..1024, got {self.rank}")
        need(0 < self.alpha <= 1 << 16, f"alpha must be in 1..65536, got {self.alpha}")
        need(0 <= self.steps <= MAX_STEPS, f"steps must be in 0..{MAX_STEPS}, got {self.steps}")
        need(-1000 <= self.priority <= 1000, f"priority must be in -1000..1000, got {self.priority}")
        need(0 <= self.seed < 1 << 63, f"seed must be in 0..2**63-1, got {self.seed}")
        need(self.max_staleness <= 1000, f"max_staleness must be in 0..1000, got {self.max_staleness}")
        need(len(self.target_modules) <= MAX_TARGET_MODULES, f"target_modules: at most {MAX_TARGET_MODULES} names")
        for name in self.target_modules:
            check_name("target_modules", name)


@message("sched.job_query")
@dataclass(frozen=True)
class JobQuery(Request[r.JobQueryReply]):
    api_key: str
    job_id: str


@message("sched.job_action")
@dataclass(frozen=True)
class JobAction(Request[r.JobReply]):
    api_key: str
    job_id: str
    action: str

    def __post_init__(self) -> None:
        need(self.action in JOB_ACTIONS, f"action must be one of {JOB_ACTIONS}, got {self.action!r}")


@message("sched.list_jobs")
@dataclass(frozen=True)
class ListJobs(Request[r.JobListReply]):
    api_key: str
    include_finished: bool = True


@message("sched.forward_backward")
@dataclass(frozen=True)
class ForwardBackward(Request[r.ForwardBackwardReply]):
    api_key: str
    job_id: str
    data: tuple[Datum, ...]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    request_id: str = ""  # the same on every resend of one call: the learner applies it once
    attempt: int = 0  # 0 the first time, then 1, 2, ... on resends

    def __post_init__(self) -> None:
        need(0 < len(self.data) <= MAX_DATA, f"forward_backward needs 1..{MAX_DATA} datums")
        need(all(isinstance(d, Datum) for d in self.data), "data must hold datums")
        check_data(self.data, self.loss_fn)  # the loss_fn's name too
        check_loss_config(self.loss_fn_config)
        request_id_ok(self.request_id, self.attempt)

    def check_model(self, limits: ModelLimits) -> None:
        check_data(self.data, self.loss_fn, limits.vocab_size)


@message("sched.forward")
@dataclass(frozen=True)
class Forward(Request[r.ForwardReply]):
    api_key: str
    job_id: str
    data: tuple[Datum, ...]
    loss_fn: str = ""  # '' for the logprobs alone; else also the loss forward_backward would answer
    loss_fn_config: dict[str, float] | None = None

    def __post_init__(self) -> None:
        need(0 < len(self.data) <= MAX_DATA, f"forward needs 1..{MAX_DATA} datums")
        need(all(isinstance(d, Datum) for d in self.data), "data must hold datums")
        check_data(self.data, self.loss_fn or "cross_entropy")
        check_loss_config(self.loss_fn_config)

    def check_model(self, limits: ModelLimits) -> None:
        check_data(self.data, self.loss_fn or "cross_entropy", limits.vocab_size)


@message("sched.optim_step")
@dataclass(frozen=True)
class OptimStep(Request[r.OptimStepReply]):
    api_key: str
    job_id: str
    adam: AdamParams = field(default_factory=AdamParams)  # as the learner steps with it (it checks itself)
    request_id: str = ""  # the same on every resend of one call: the learner steps once
    attempt: int = 0  # 0 the first time, then 1, 2, ... on resends

    def __post_init__(self) -> None:
        request_id_ok(self.request_id, self.attempt)


@message("sched.save_state")
@dataclass(frozen=True)
class SaveState(Request[r.SaveStateReply]):
    api_key: str
    job_id: str
    name: str
    ttl_s: float = 0.0  # delete the checkpoint this long after it is saved; 0: keep it

    def __post_init__(self) -> None:
        check_ttl(self.ttl_s)


@message("sched.load_state")
@dataclass(frozen=True)
class LoadState(Request[r.LoadStateReply]):
    api_key: str
    job_id: str
    path: str  # a name given to save_state, or the polytinker-ckpt://JOB/NAME it returned; never a filesystem path
    optimizer: bool = True  # False: the weights only (Tinker's load_state), the optimizer starts afresh


@message("sched.save_weights")
@dataclass(frozen=True)
class SaveWeights(Request[r.SaveWeightsReply]):
    api_key: str
    job_id: str
    name: str = ""
    ttl_s: float = 0.0  # a named save: forget the name this long after (see SaveState); 0: keep it

    def __post_init__(self) -> None:
        check_ttl(self.ttl_s)


@message("sched.sample")
@dataclass(frozen=True)
class Sample(Request[r.SampleReply]):
    api_key: str
    model_path: str  # "polytinker://JOB/AGENT@VERSION", or "" for the base model
    base_model: str
    prompt_token_ids: tuple[int, ...]
    num_samples: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    job_id: str = ""  # the base model: the caller's inference job, which gates and accounts the call
    # One per call, the same on its resends: an engine still running the call when the scheduler
    # restarted answers the resend from that run (engine/inference/_resends.py).
    request_key: str = ""

    def __post_init__(self) -> None:
        request_id_ok(self.request_key, 0, "request_key")
        need(len(self.prompt_token_ids) > 0, "prompt_token_ids: the prompt needs at least one token")
        need(0 < self.num_samples <= MAX_SAMPLES, f"num_samples must be in 1..{MAX_SAMPLES}, got {self.num_samples}")
        need(isinstance(self.params, SamplingParams), "params must be sampling parameters")
        check_token_ids(self.prompt_token_ids, "prompt_token_ids")

    def check_model(self, limits: ModelLimits) -> None:
        check_token_ids(self.prompt_token_ids, "prompt_token_ids", limits.vocab_size)
        check_token_ids(self.params.stop_token_ids, "stop_token_ids", limits.vocab_size)
        for i, choice in enumerate(self.params.choices):
            check_token_ids(choice, f"choices[{i}]", limits.vocab_size)
        limits.check_context(len(self.prompt_token_ids), self.params.max_tokens)


@message("sched.compute_logprobs")
@dataclass(frozen=True)
class ComputeLogprobs(Request[r.LogprobsReply]):
    api_key: str
    model_path: str
    base_model: str
    sequences: tuple[tuple[int, ...], ...]
    job_id: str = ""  # the base model: the caller's inference job, which gates and accounts the call
    top_k: int = 0  # also the k likeliest tokens at each position (LogprobsReply.topk)

    def __post_init__(self) -> None:
        need(0 < len(self.sequences) <= MAX_PROMPTS and all(self.sequences), "sequences: 1..4096 non-empty sequences")
        check_top_k(self.top_k)
        for i, seq in enumerate(self.sequences):
            check_token_ids(seq, f"sequences[{i}]")

    def check_model(self, limits: ModelLimits) -> None:
        for i, seq in enumerate(self.sequences):
            check_token_ids(seq, f"sequences[{i}]", limits.vocab_size)
            limits.check_context(len(seq), 0)


@message("sched.delete_checkpoint")
@dataclass(frozen=True)
class DeleteCheckpoint(Request[r.DeleteCheckpointReply]):
    """Forget a named checkpoint of one of the tenant's jobs and delete its files."""

    api_key: str
    job_id: str
    name: str  # as the job lists it: a save_state name, or sampler-NAME for a named sampler save


@message("sched.publish_checkpoint")
@dataclass(frozen=True)
class PublishCheckpoint(Request[r.PublishCheckpointReply]):
    """Let every tenant of the runtime read a named checkpoint of one of the tenant's jobs
    (``public``), or only the tenant again: sample a published sampler save, load or start a
    new job from a published ``save_state`` checkpoint. Deleting it stays its owner's."""

    api_key: str
    job_id: str
    name: str  # as the job lists it (see DeleteCheckpoint)
    public: bool


@message("sched.copy_checkpoint")
@dataclass(frozen=True)
class CopyCheckpoint(Request[r.CopyCheckpointReply]):
    """Copy saved weights the tenant may read (its own, or published: a ``polytinker-ckpt://``
    checkpoint or a ``polytinker://`` version) into a new job of the tenant's that holds them and
    does not train; ``ttl_s`` deletes the copy then (0: kept)."""

    api_key: str
    path: str
    ttl_s: float = 0.0
    request_key: str = ""  # as CreateJob's: a resend gets the first copy (request_keys.py)

    def __post_init__(self) -> None:
        need(self.path.startswith((MODEL_PREFIX, CKPT_PREFIX)), f"path must be {MODEL_PREFIX}... or {CKPT_PREFIX}...")
        check_ttl(self.ttl_s)
        request_id_ok(self.request_key, 0, "request_key")


@message("sched.weights_info")
@dataclass(frozen=True)
class WeightsInfo(Request[r.WeightsInfoReply]):
    """What saved weights are: the job that saved them and its shape (base model, kind, agent,
    LoRA rank and modules). ``path``: a ``polytinker-ckpt://`` checkpoint or a ``polytinker://``
    version, the tenant's own or a published one."""

    api_key: str
    path: str


@message("sched.set_checkpoint_ttl")
@dataclass(frozen=True)
class SetCheckpointTtl(Request[r.CheckpointTtlReply]):
    """Delete a named checkpoint ``ttl_s`` from now (0: never)."""

    api_key: str
    job_id: str
    name: str  # as the job lists it (see DeleteCheckpoint)
    ttl_s: float

    def __post_init__(self) -> None:
        check_ttl(self.ttl_s)


MAX_TTL_S = 10 * 366 * 86400.0  # ten years, as Tinker allows


def check_ttl(ttl_s: float) -> None:
    need(
        isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and 0 <= ttl_s <= MAX_TTL_S,
        f"a checkpoint's ttl must be 0 (keep it) or seconds up to {MAX_TTL_S:.0f}",
    )


@message("sched.export_weights")
@dataclass(frozen=True)
class ExportWeights(Request[r.ExportWeightsReply]):
    """The files of saved weights the tenant may read: a version (``polytinker://JOB/AGENT@VERSION``)
    or a ``save_state`` checkpoint (``polytinker-ckpt://JOB/NAME``)."""

    api_key: str
    model_path: str

    def __post_init__(self) -> None:
        need(
            self.model_path.startswith((MODEL_PREFIX, CKPT_PREFIX)),
            f"model_path must be {MODEL_PREFIX}JOB/AGENT@VERSION or {CKPT_PREFIX}JOB/NAME",
        )


# What ``AuditLog.event_type`` selects, as Tinker's admin client names it: every event, or one
# resource's. polytinker keeps events of checkpoints alone (it has no projects, teams or
# organizations), so the other three select nothing.
AUDIT_EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")


@message("sched.audit_log")
@dataclass(frozen=True)
class AuditLog(Request[r.AuditLogReply]):
    """The tenant's audit log of one UTC day (``day`` as ``YYYY-MM-DD``; "": today): what it did
    to saved weights, and what any tenant did to the weights it owns."""

    api_key: str
    day: str = ""
    event_type: str = "all"

    def __post_init__(self) -> None:
        need(self.event_type in AUDIT_EVENT_TYPES, f"event_type must be one of {', '.join(AUDIT_EVENT_TYPES)}")
        need(self.day == "" or _is_date(self.day), f"day {self.day[:40]!r} is not a date, YYYY-MM-DD")


def _is_date(text: str) -> bool:
    try:
        return len(text) == 10 and bool(date.fromisoformat(text))
    except ValueError:
        return False


MAX_USAGE_WINDOW_S = 14 * 86400.0  # one answer's window, as Tinker bounds it


@message("sched.usage")
@dataclass(frozen=True)
class Usage(Request[r.UsageReply]):
    """The tenant's usage counts of the UTC hours starting in [start_s, end_s) (Unix times; at most
    14 days apart)."""

    api_key: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        need(
            all(isinstance(t, int | float) and math.isfinite(t) for t in (self.start_s, self.end_s)),
            "start_s and end_s must be Unix times",
        )
        need(0 < self.end_s - self.start_s <= MAX_USAGE_WINDOW_S, "the window must be positive and at most 14 days")


@message("sched.storage_usage")
@dataclass(frozen=True)
class StorageUsage(Request[r.StorageUsageReply]):
    """How many named checkpoints the tenant keeps now, and their bytes on the scheduler's disk."""

    api_key: str


@message("sched.hold_weights")
@dataclass(frozen=True)
class HoldWeights(Request[r.HoldWeightsReply]):
    """The tenant's ``holder`` holds the version at ``model_path`` (never pruned while held), or,
    with ``model_path`` "", releases every version it holds (``WeightHolds``)."""

    api_key: str
    holder: str  # the client's name for what holds (the gateway: a session id); layout.check_name
    model_path: str = ""

    def __post_init__(self) -> None:
        need(not self.model_path or self.model_path.startswith(MODEL_PREFIX), f"model_path must be {MODEL_PREFIX}...")


@message("sched.runtime_status")
@dataclass(frozen=True)
class RuntimeStatus(Request[r.RuntimeStatusReply]):
    api_key: str


__all__ = [
    "AUDIT_EVENT_TYPES",
    "JOB_ACTIONS",
    "JOB_KINDS",
    "LOSS_FNS",
    "MAX_USAGE_WINDOW_S",
    "AuditLog",
    "ComputeLogprobs",
    "CopyCheckpoint",
    "CreateJob",
    "DeleteCheckpoint",
    "Forward",
    "ForwardBackward",
    "HoldWeights",
    "JobAction",
    "JobQuery",
    "ListJobs",
    "LoadState",
    "OptimStep",
    "PublishCheckpoint",
    "RuntimeStatus",
    "Sample",
    "SaveState",
    "SaveWeights",
    "SetCheckpointTtl",
    "StorageUsage",
    "Usage",
    "WeightsInfo",
    "check_ttl",
]
