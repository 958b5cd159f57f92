"""Typed messages of the scheduler service: one frozen dataclass per request kind.

Each is registered with the transport under its RPC kind, so the server decodes a request into
exactly its type (``__post_init__`` validation runs at the edge) and rejects anything else.
This module imports no torch: the scheduler process stays light.

Client -> scheduler (every one carries ``api_key``): ``CreateJob``, ``JobQuery``, ``JobAction``,
``ListJobs``, ``ForwardBackward``, ``Forward``, ``OptimStep``, ``SaveState``, ``LoadState``,
``SaveWeights``, ``Sample``, ``ComputeLogprobs``, ``ExportWeights``, ``RuntimeStatus``.

Worker <-> scheduler: ``Register`` (worker -> scheduler), ``ActorsReport`` of ``ActorState``
(the local runtime's supervisor -> scheduler), and to workers ``EnsureAdapter``,
``LearnerForwardBackward``, ``LearnerForward``, ``LearnerStep``, ``LearnerSave``, ``LearnerLoad``,
``LearnerExport``, ``EngineSample``, ``EngineLogprobs``, ``WorkerStats``.

Nested values: ``DatumMsg`` (one training example), ``SamplingMsg`` (sampling parameters) and
``WeightsRef`` (a stored version's weights, by ids: no message to a worker names a filesystem
path; each worker makes the path under its own state root, see ``layout``).
The replies to the client requests are typed too: ``polytinker.scheduler.service.replies``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polytinker.errors import ConfigError
from polytinker.model_path import MODEL_PREFIX
from polytinker.scheduler.service.layout import KINDS, check_adapter_key, check_name, relative_path
from polytinker.scheduler.types import JobKind
from polytinker.transport.messages import message

JOB_KINDS = tuple(str(k) for k in JobKind)  # ("lora_rl", "full_rl", "sft", "inference")
_RL_KINDS = (JobKind.LORA_RL, JobKind.FULL_RL)  # they sample and train
JOB_ACTIONS = ("cancel", "pause", "resume", "finish")
LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
MAX_DATA = 100_000  # datums in one call
MAX_PROMPTS = 4096


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


MAX_REQUEST_ID = 64


def _request_id_ok(request_id: str, attempt: int) -> None:
    _need(
        len(request_id) <= MAX_REQUEST_ID and all(c.isascii() and (c.isalnum() or c in "-_") for c in request_id),
        f"request_id: at most {MAX_REQUEST_ID} ASCII letters, digits, '-' or '_'",
    )
    _need(isinstance(attempt, int) and 0 <= attempt < 1_000_000, "attempt must be an int in [0, 1000000)")


@message("sched.datum")
@dataclass(frozen=True)
class DatumMsg:
    input_tokens: tuple[int, ...]
    target_tokens: tuple[int, ...]
    weights: tuple[float, ...]
    advantages: tuple[float, ...] | None = None
    sampling_logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.target_tokens)
        _need(n > 0 and len(self.input_tokens) == n, "a datum needs input_tokens and target_tokens of one length")
        for name in ("weights", "advantages", "sampling_logprobs"):
            v = getattr(self, name)
            _need(v is None or len(v) == n, f"datum.{name} must have one entry per target token")


@message("sched.sampling_params")
@dataclass(frozen=True)
class SamplingMsg:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _need(0 < self.max_tokens <= 1 << 16, "max_tokens must be in 1..65536")
        _need(math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _need(0 < self.top_p <= 1 and self.top_k >= 0, "need 0 < top_p <= 1 and top_k >= 0")


# --- client -> scheduler --------------------------------------------------------------------


@message("sched.create_job")
@dataclass(frozen=True)
class CreateJob:
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

    def __post_init__(self) -> None:
        _need(self.kind in JOB_KINDS, f"job kind must be one of {JOB_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "kind", JobKind(self.kind))
        check_name("agent", self.agent)  # part of the adapter key, and so of its paths on the workers
        _need(self.max_staleness >= 0, "max_staleness must be >= 0")
        _need(
            not self.max_staleness or self.kind in _RL_KINDS,
            f"max_staleness is for RL jobs (they sample and train); a {self.kind} job leaves it at 0",
        )
        _need(bool(self.base_model), "base_model must be named")
        _need(0 < self.rank <= 1024 and self.alpha > 0, "LoRA rank must be in 1..1024 and alpha > 0")
        _need(self.steps >= 0 and -1000 <= self.priority <= 1000, "steps >= 0, priority in -1000..1000")


@message("sched.job_query")
@dataclass(frozen=True)
class JobQuery:
    api_key: str
    job_id: str


@message("sched.job_action")
@dataclass(frozen=True)
class JobAction:
    api_key: str
    job_id: str
    action: str

    def __post_init__(self) -> None:
        _need(self.action in JOB_ACTIONS, f"action must be one of {JOB_ACTIONS}, got {self.action!r}")


@message("sched.list_jobs")
@dataclass(frozen=True)
class ListJobs:
    api_key: str
    include_finished: bool = True


@message("sched.forward_backward")
@dataclass(frozen=True)
class ForwardBackward:
    api_key: str
    job_id: str
    data: tuple[DatumMsg, ...]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    request_id: str = ""  # the same on every resend of one call: the learner applies it once
    attempt: int = 0  # 0 the first time, then 1, 2, ... on resends

    def __post_init__(self) -> None:
        _need(0 < len(self.data) <= MAX_DATA, f"forward_backward needs 1..{MAX_DATA} datums")
        _need(all(isinstance(d, DatumMsg) for d in self.data), "data must hold datums")
        _need(self.loss_fn in LOSS_FNS, f"loss_fn must be one of {LOSS_FNS}, got {self.loss_fn!r}")
        _request_id_ok(self.request_id, self.attempt)


@message("sched.forward")
@dataclass(frozen=True)
class Forward:
    api_key: str
    job_id: str
    data: tuple[DatumMsg, ...]

    def __post_init__(self) -> None:
        _need(0 < len(self.data) <= MAX_DATA, f"forward needs 1..{MAX_DATA} datums")
        _need(all(isinstance(d, DatumMsg) for d in self.data), "data must hold datums")


@message("sched.optim_step")
@dataclass(frozen=True)
class OptimStep:
    api_key: str
    job_id: str
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    request_id: str = ""  # the same on every resend of one call: the learner steps once
    attempt: int = 0  # 0 the first time, then 1, 2, ... on resends
    grad_clip_norm: float = 0.0  # clip the gradient's norm to this before the step; 0: no clip

    def __post_init__(self) -> None:
        _request_id_ok(self.request_id, self.attempt)
        _need(math.isfinite(self.grad_clip_norm) and self.grad_clip_norm >= 0, "grad_clip_norm must be >= 0")


@message("sched.save_state")
@dataclass(frozen=True)
class SaveState:
    api_key: str
    job_id: str
    name: str


@message("sched.load_state")
@dataclass(frozen=True)
class LoadState:
    api_key: str
    job_id: str
    path: str  # a name given to save_state, or the polytinker-ckpt://JOB/NAME it returned; never a filesystem path
    optimizer: bool = True  # False: the weights only (Tinker's load_state), the optimizer starts afresh


@message("sched.save_weights")
@dataclass(frozen=True)
class SaveWeights:
    api_key: str
    job_id: str
    name: str = ""


@message("sched.sample")
@dataclass(frozen=True)
class Sample:
    api_key: str
    model_path: str  # "polytinker://JOB/AGENT@VERSION", or "" for the base model
    base_model: str
    prompt_token_ids: tuple[int, ...]
    num_samples: int = 1
    params: SamplingMsg = SamplingMsg()
    job_id: str = ""  # the base model: the caller's inference job, which gates and accounts the call

    def __post_init__(self) -> None:
        _need(len(self.prompt_token_ids) > 0, "the prompt needs at least one token")
        _need(0 < self.num_samples <= 1024, "num_samples must be in 1..1024")
        _need(isinstance(self.params, SamplingMsg), "params must be sampling parameters")


@message("sched.compute_logprobs")
@dataclass(frozen=True)
class ComputeLogprobs:
    api_key: str
    model_path: str
    base_model: str
    sequences: tuple[tuple[int, ...], ...]
    job_id: str = ""  # the base model: the caller's inference job, which gates and accounts the call

    def __post_init__(self) -> None:
        _need(0 < len(self.sequences) <= MAX_PROMPTS and all(self.sequences), "1..4096 non-empty sequences")


@message("sched.export_weights")
@dataclass(frozen=True)
class ExportWeights:
    """The peft files of one of the tenant's saved versions (``polytinker://JOB/AGENT@VERSION``)."""

    api_key: str
    model_path: str

    def __post_init__(self) -> None:
        _need(self.model_path.startswith(MODEL_PREFIX), f"model_path must be {MODEL_PREFIX}JOB/AGENT@VERSION")


@message("sched.runtime_status")
@dataclass(frozen=True)
class RuntimeStatus:
    api_key: str


# --- workers ---------------------------------------------------------------------------------


@message("sched.w.register")
@dataclass(frozen=True)
class Register:
    proof: str  # worker_auth.register_proof of the fields below: made with the worker token, not the token
    worker_id: str
    role: str  # "engine" or "learner"
    address: str  # where the worker serves the scheduler's requests
    incarnation: str  # new at every process start: a change means its memory is empty again
    base_model: str
    curve_public_key: str  # the Curve key the worker serves with (every worker serves with Curve)

    def __post_init__(self) -> None:
        _need(self.role in ("engine", "learner"), f"role must be 'engine' or 'learner', got {self.role!r}")
        _need(len(self.curve_public_key) == 40, "curve_public_key must be the worker's 40-character Z85 key")


@message("sched.w.workers")
@dataclass(frozen=True)
class WorkersQuery:
    """The registered workers, for the launcher (authenticated by a credential derived from the
    worker token, ``worker_auth.launcher_credential``: the token itself never goes on the wire)."""

    credential: str


@message("sched.actor_state")
@dataclass(frozen=True)
class ActorState:
    """One actor of a local runtime as its supervisor sees it (a row of ``polytinker status``)."""

    name: str
    alive: bool
    pid: int  # of the running incarnation; 0 while down
    restarts: int
    gave_up: bool  # the restart limit was hit: it stays down and the runtime stops
    last_exit_code: int | None  # negative for a signal (-9: SIGKILL); None before any exit
    last_exit_time: float  # Unix time the supervisor saw its last exit; 0.0 before any
    last_error: str  # the last line of its last traceback; '' for none


@message("sched.w.actors")
@dataclass(frozen=True)
class ActorsReport:
    """The launcher -> scheduler: every supervised actor's state, sent at each exit and restart
    (and every few seconds). A worker's exit fails the calls in flight to it at once."""

    credential: str  # worker_auth.launcher_credential(worker token)
    actors: tuple[ActorState, ...]


@message("sched.w.weights")
@dataclass(frozen=True)
class WeightsRef:
    """A stored version's weights by ids: ``adapter`` (the key TENANT/JOB/AGENT), ``version``,
    ``kind`` ("checkpoint": learner state; "export": the peft directory engines load) and ``name``
    (a save_state name; for an export, the checkpoint it was loaded from). A worker reads and
    writes ``relative_path`` under its own state root, never a path a message names."""

    adapter: str
    version: int
    kind: str = "checkpoint"
    name: str = ""

    def __post_init__(self) -> None:
        check_adapter_key(self.adapter)
        _need(isinstance(self.version, int) and self.version >= 0, "a weights version must be an int >= 0")
        _need(self.kind in KINDS, f"weights kind must be one of {KINDS}, got {self.kind!r}")
        if self.name:
            check_name("weights name", self.name)

    @property
    def relative_path(self) -> str:
        return relative_path(self.adapter, self.version, self.kind, self.name)


def _adapter_ok(adapter: str, base_allowed: bool = False) -> None:
    if not (base_allowed and adapter == ""):
        check_adapter_key(adapter)


@message("sched.w.ensure")
@dataclass(frozen=True)
class EnsureAdapter:
    """Have ``adapter`` resident on the learner at ``version``: from ``checkpoint`` when given,
    else freshly initialised (version 0). ``full``: a full-parameter slot instead of LoRA."""

    adapter: str
    version: int
    checkpoint: WeightsRef | None = None
    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ()
    seed: int = 0
    full: bool = False

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        _need(self.checkpoint is None or isinstance(self.checkpoint, WeightsRef), "checkpoint must be a WeightsRef")


@message("sched.w.fb")
@dataclass(frozen=True)
class LearnerForwardBackward:
    adapter: str
    data: tuple[DatumMsg, ...]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    full: bool = False
    request_id: str = ""  # with ``adapter``, the idempotency key: a duplicate answers the first result
    from_version: int = -1  # the adapter version the gradient is taken at (the step it belongs to)
    attempt: int = 0  # resends so far, by the client and the scheduler together

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.forward")
@dataclass(frozen=True)
class LearnerForward:
    adapter: str
    data: tuple[DatumMsg, ...]
    full: bool = False

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.step")
@dataclass(frozen=True)
class LearnerStep:
    """Step, then write the new version's checkpoint (and, with ``export``, what engines load: for
    LoRA its peft export, for full parameters the checkpoint itself) before answering; the paths
    are the learner's own (``WeightsRef`` of ``adapter`` and the new version)."""

    adapter: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    export: bool = True
    full: bool = False
    request_id: str = ""  # with ``adapter``, the idempotency key: a duplicate answers the first result
    from_version: int = -1  # the version this step starts from: it makes from_version + 1
    attempt: int = 0  # resends so far, by the client and the scheduler together
    expected_fb: int = -1  # forward_backward calls the scheduler saw answered for this step (-1: unknown)
    grad_clip_norm: float = 0.0  # 0: no clip

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.save")
@dataclass(frozen=True)
class LearnerSave:
    """Checkpoint the adapter as ``name`` (``WeightsRef(adapter, version, "checkpoint", name)``)."""

    adapter: str
    name: str
    full: bool = False

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        check_name("checkpoint name", self.name)


@message("sched.w.load")
@dataclass(frozen=True)
class LearnerLoad:
    """Load ``checkpoint`` (one of the same tenant's, the scheduler checked) into the adapter."""

    adapter: str
    checkpoint: WeightsRef
    full: bool = False
    optimizer: bool = True  # False: the weights only, the optimizer starts afresh

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        _need(isinstance(self.checkpoint, WeightsRef), "checkpoint must be a WeightsRef")


@message("sched.w.export")
@dataclass(frozen=True)
class LearnerExport:
    """Write what engines load of the adapter at its resident ``version`` (LoRA: the peft export,
    ``WeightsRef(adapter, version, "export", loaded_from)``; ``full``: the weights as the checkpoint
    ``WeightsRef(adapter, version)``). A version other than the resident one is refused."""

    adapter: str
    version: int
    full: bool = False
    loaded_from: str = ""  # the checkpoint name load_state just loaded: its export gets a path of its own

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        if self.loaded_from:
            check_name("checkpoint name", self.loaded_from)


@message("sched.w.sample")
@dataclass(frozen=True)
class EngineSample:
    adapter: str  # "" for the base model
    version: int
    weights: WeightsRef | None  # what the engine loads the version from if it is not resident
    prompt_token_ids: tuple[int, ...]
    num_samples: int
    params: SamplingMsg
    tag: str = ""  # the tenant, for the engine's mixed-batch statistics only
    full: bool = False  # a full-parameter job's version: weights is its checkpoint

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter, base_allowed=True)


@message("sched.w.logprobs")
@dataclass(frozen=True)
class EngineLogprobs:
    adapter: str
    version: int
    weights: WeightsRef | None
    sequences: tuple[tuple[int, ...], ...]
    full: bool = False

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter, base_allowed=True)


@message("sched.w.stats")
@dataclass(frozen=True)
class WorkerStats:
    pass


__all__ = [
    "JOB_ACTIONS",
    "JOB_KINDS",
    "LOSS_FNS",
    "ActorState",
    "ActorsReport",
    "ComputeLogprobs",
    "CreateJob",
    "DatumMsg",
    "EngineLogprobs",
    "EngineSample",
    "EnsureAdapter",
    "Forward",
    "ForwardBackward",
    "JobAction",
    "JobQuery",
    "LearnerExport",
    "LearnerForward",
    "LearnerForwardBackward",
    "LearnerLoad",
    "LearnerSave",
    "LearnerStep",
    "ListJobs",
    "LoadState",
    "OptimStep",
    "Register",
    "RuntimeStatus",
    "Sample",
    "SamplingMsg",
    "SaveState",
    "SaveWeights",
    "WeightsRef",
    "WorkerStats",
    "WorkersQuery",
]
