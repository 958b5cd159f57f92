"""Typed messages between the scheduler and its workers: one frozen dataclass per request kind.

Worker -> scheduler: ``Register``, ``Leave``; the launcher's ``WorkersQuery``; ``ActorsReport`` of
``ActorState`` (the local runtime's supervisor -> scheduler). Scheduler -> workers:
``EnsureAdapter``, ``LearnerForwardBackward``, ``LearnerForward``, ``LearnerStep``, ``LearnerSave``,
``LearnerLoad``, ``LearnerExport``, ``EngineSample``, ``EngineLogprobs``, ``WorkerStats``.
Each request derives from ``Request[Reply]``, naming what its handler answers (``replies``), so
a caller sends it with ``ask`` and a worker files its handler by class (``handler_table``): the
kind is written once, in ``@message``.

``WeightsRef`` names a stored version's weights by ids: no message to a worker names a filesystem
path; each worker makes the path under its own state root (see ``layout``). The nested training
and sampling values (``engine.types.Datum``, ``SamplingParams``, registered in ``messages``)
and the checks are shared with the client requests in ``messages``. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum, SamplingParams, check_top_k, need
from polytinker.engine.worker import replies as r
from polytinker.engine.worker.auth import leave_proof, register_proof
from polytinker.engine.worker.layout import KINDS, check_adapter_key, check_name, relative_path
from polytinker.engine.worker.replies import AdapterTensors
from polytinker.transport.messages import message
from polytinker.transport.requests import Request

MAX_REQUEST_KEY = 64  # characters of a call's request key (the scheduler checks the client's at its door)
MAX_WORKER_GB = 1 << 20  # a worker's declared memory (GB), as it registers
MAX_WORKER_SLOTS = 1 << 16  # an engine's adapter slots, a learner group's jobs, as it registers


@message("sched.w.register")
@dataclass(frozen=True)
class Register(Request[r.Registered]):
    proof: str  # auth.register_proof of the fields below: made with the worker token, not the token
    worker_id: str
    role: str  # "engine" or "learner"
    address: str  # where the worker serves the scheduler's requests
    incarnation: str  # new at every process start: a change means its memory is empty again
    base_model: str
    curve_public_key: str  # the Curve key the worker serves with (every worker serves with Curve)
    vocab_size: int = 0  # the base model's ModelLimits, read from its config (0: unknown)
    max_positions: int = 0
    # Its capacity, as its own config declares it: what the scheduler's policy places on a worker
    # its config does not declare ([cluster] join_undeclared). An engine's memory_gb and adapter
    # slots, a learner group's memory_gb and max_jobs.
    memory_gb: float = 0.0
    slots: int = 0
    # layout.read_state_id of the worker's state root: the scheduler's own when it sees the same
    # state (a learner's checkpoints then outlive its node); '' where there is none.
    state_id: str = ""

    def __post_init__(self) -> None:
        need(0 <= self.vocab_size < 1 << 31 and 0 <= self.max_positions < 1 << 31, "model limits out of range")
        need(self.role in ("engine", "learner"), f"role must be 'engine' or 'learner', got {self.role!r}")
        need(len(self.curve_public_key) == 40, "curve_public_key must be the worker's 40-character Z85 key")
        need(math.isfinite(self.memory_gb) and 0 <= self.memory_gb <= MAX_WORKER_GB, "memory_gb out of range")
        need(0 <= self.slots <= MAX_WORKER_SLOTS, "slots out of range")
        need(len(self.state_id) <= 64, "state_id out of range")

    def signed_fields(self) -> tuple[str | int | float, ...]:
        """What ``proof`` is the MAC of (``auth.register_proof``), in this order."""
        return (
            *(self.worker_id, self.role, self.address, self.incarnation, self.base_model, self.curve_public_key),
            *(self.vocab_size, self.max_positions, self.memory_gb, self.slots, self.state_id),
        )

    @classmethod
    def signed(cls, token: str, **fields: Any) -> Register:
        """A ``Register`` of ``fields`` with its proof made with the worker ``token``."""
        unsigned = cls(proof="", **fields)
        return dataclasses.replace(unsigned, proof=register_proof(token, *unsigned.signed_fields()))


@message("sched.w.leave")
@dataclass(frozen=True)
class Leave(Request[r.Left]):
    """A worker that stops on purpose (``polytinker worker`` on SIGTERM, a runtime shutting down)
    says so: its calls in flight fail over at once, and a worker that joined at run time is
    forgotten and its jobs queued again, instead of after ``worker_silence_s`` and ``joined_gone_s``."""

    proof: str  # auth.leave_proof(worker token, worker_id, incarnation)
    worker_id: str
    incarnation: str  # the process that leaves: a later incarnation of the same id stays

    @classmethod
    def signed(cls, token: str, worker_id: str, incarnation: str) -> Leave:
        return cls(leave_proof(token, worker_id, incarnation), worker_id, incarnation)


@message("sched.w.workers")
@dataclass(frozen=True)
class WorkersQuery(Request[r.WorkersReply]):
    """The registered workers, for the launcher (authenticated by a credential derived from the
    worker token, ``auth.launcher_credential``: the token itself never goes on the wire)."""

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
    node: str = ""  # where it runs when a cluster placed it (Ray: the node's id and IP); '' for this machine


@message("sched.w.actors")
@dataclass(frozen=True)
class ActorsReport(Request[r.ActorsNoted]):
    """The launcher -> scheduler: every supervised actor's state, sent at each exit and restart
    (and every few seconds). A worker's exit fails the calls in flight to it at once."""

    credential: str  # auth.launcher_credential(worker token)
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
        need(isinstance(self.version, int) and self.version >= 0, "a weights version must be an int >= 0")
        need(self.kind in KINDS, f"weights kind must be one of {KINDS}, got {self.kind!r}")
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
class EnsureAdapter(Request[r.WorkerVersion]):
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
        need(self.checkpoint is None or isinstance(self.checkpoint, WeightsRef), "checkpoint must be a WeightsRef")


@message("sched.w.fb")
@dataclass(frozen=True)
class LearnerForwardBackward(Request[r.ForwardBackwardReply]):
    adapter: str
    data: tuple[Datum, ...]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    full: bool = False
    request_id: str = ""  # with ``adapter``, the idempotency key: a duplicate answers the first result
    from_version: int = -1  # the adapter version the gradient is taken at (the step it belongs to)
    attempt: int = 0  # resends so far, by the client and the scheduler together

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.fb_many")
@dataclass(frozen=True)
class LearnerForwardBackwardMany(Request[r.ForwardBackwardManyReply]):
    """Several LoRA adapters' ``forward_backward`` calls in one pass over their adapters (they met
    at the learner: ``FbBatcher``). One loss function and config; each adapter once; each item
    keeps its own idempotency key. The answer is one ``ForwardBackwardReply`` per item, in order."""

    items: tuple[LearnerForwardBackward, ...]
    attempt: int = 0  # resends of the whole batch by the scheduler

    def __post_init__(self) -> None:
        need(len(self.items) >= 2, "a batched forward_backward holds at least two calls")
        need(all(isinstance(i, LearnerForwardBackward) and not i.full for i in self.items), "items are LoRA calls")
        need(len({i.adapter for i in self.items}) == len(self.items), "each adapter once per batch")
        first = self.items[0]
        need(
            all((i.loss_fn, i.loss_fn_config) == (first.loss_fn, first.loss_fn_config) for i in self.items),
            "one loss function and config per batch",
        )


@message("sched.w.forward")
@dataclass(frozen=True)
class LearnerForward(Request[r.ForwardReply]):
    """Score ``data``; with ``loss_fn``, also the loss and metrics ``forward_backward`` would answer."""

    adapter: str
    data: tuple[Datum, ...]
    full: bool = False
    loss_fn: str = ""  # '' for the logprobs alone
    loss_fn_config: dict[str, float] | None = None

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.step")
@dataclass(frozen=True)
class LearnerStep(Request[r.StepResult]):
    """Step, then write the new version's checkpoint (and, with ``export``, what engines load: for
    LoRA its peft export, for full parameters the checkpoint itself) before answering; the paths
    are the learner's own (``WeightsRef`` of ``adapter`` and the new version)."""

    adapter: str
    adam: AdamParams
    export: bool = True
    full: bool = False
    request_id: str = ""  # with ``adapter``, the idempotency key: a duplicate answers the first result
    from_version: int = -1  # the version this step starts from: it makes from_version + 1
    attempt: int = 0  # resends so far, by the client and the scheduler together
    expected_fb: int = -1  # forward_backward calls the scheduler saw answered for this step (-1: unknown)

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)


@message("sched.w.save")
@dataclass(frozen=True)
class LearnerSave(Request[r.SavedCheckpoint]):
    """Checkpoint the adapter as ``name`` (``WeightsRef(adapter, version, "checkpoint", name)``)."""

    adapter: str
    name: str
    full: bool = False

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        check_name("checkpoint name", self.name)


@message("sched.w.load")
@dataclass(frozen=True)
class LearnerLoad(Request[r.WorkerVersion]):
    """Load ``checkpoint`` (one of the same tenant's, the scheduler checked) into the adapter."""

    adapter: str
    checkpoint: WeightsRef
    full: bool = False
    optimizer: bool = True  # False: the weights only, the optimizer starts afresh

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter)
        need(isinstance(self.checkpoint, WeightsRef), "checkpoint must be a WeightsRef")


@message("sched.w.export")
@dataclass(frozen=True)
class LearnerExport(Request[r.ExportedWeights]):
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


@message("sched.w.adapter_weights")
@dataclass(frozen=True)
class LearnerAdapterWeights(Request[r.AdapterTensors]):
    """The LoRA tensors of the export ``weights`` names, for an engine that cannot read them (no
    shared filesystem): from memory when it is the resident version, else from the learner's own
    copy. Answered with an ``AdapterTensors``."""

    weights: WeightsRef

    def __post_init__(self) -> None:
        need(self.weights.kind == "export", "adapter weights are sent for exports")


@message("sched.w.has_weights")
@dataclass(frozen=True)
class EngineHasWeights(Request[bool]):
    """Whether the engine holds the export ``weights`` names or can read it itself (a bool)."""

    weights: WeightsRef


@message("sched.w.put_adapter", arrays=True)
@dataclass(frozen=True)
class EnginePutAdapter(Request[bool]):
    """A LoRA version's tensors for the engine's host cache (as the learner sent them), over the
    transport; registered as the export ``weights`` names, so requests naming it use them."""

    weights: WeightsRef
    adapter: AdapterTensors

    def __post_init__(self) -> None:
        need(self.weights.kind == "export", "adapter tensors are put for exports")
        need(isinstance(self.adapter, AdapterTensors), "adapter is an AdapterTensors")


@message("sched.w.sample")
@dataclass(frozen=True)
class EngineSample(Request[r.SampleReply]):
    adapter: str  # "" for the base model
    version: int
    weights: WeightsRef | None  # what the engine loads the version from if it is not resident
    prompt_token_ids: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    tag: str = ""  # the tenant: the engine takes turns between tenants, and counts its mixed batches
    full: bool = False  # a full-parameter job's version: weights is its checkpoint
    # The client's key for the call, the same on its resends: a resend the engine still runs (or
    # just ran) joins that run (engine/inference/_resends.py); "" runs every send.
    request_key: str = ""

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter, base_allowed=True)
        need(
            isinstance(self.request_key, str) and len(self.request_key) <= MAX_REQUEST_KEY,
            f"request_key must be a string of at most {MAX_REQUEST_KEY} characters",
        )


@message("sched.w.logprobs")
@dataclass(frozen=True)
class EngineLogprobs(Request[r.LogprobsReply]):
    adapter: str
    version: int
    weights: WeightsRef | None
    sequences: tuple[tuple[int, ...], ...]
    full: bool = False
    top_k: int = 0  # also the k likeliest tokens at each position
    tag: str = ""  # the tenant: the engine takes turns between tenants (as EngineSample.tag)

    def __post_init__(self) -> None:
        _adapter_ok(self.adapter, base_allowed=True)
        check_top_k(self.top_k)


@message("sched.w.stats")
@dataclass(frozen=True)
class WorkerStats(Request[dict[str, Any]]):
    pass


__all__ = [
    "ActorState",
    "ActorsReport",
    "EngineHasWeights",
    "EngineLogprobs",
    "EnginePutAdapter",
    "EngineSample",
    "EnsureAdapter",
    "LearnerAdapterWeights",
    "LearnerExport",
    "LearnerForward",
    "LearnerForwardBackward",
    "LearnerForwardBackwardMany",
    "LearnerLoad",
    "LearnerSave",
    "LearnerStep",
    "Leave",
    "Register",
    "WeightsRef",
    "WorkerStats",
    "WorkersQuery",
]
