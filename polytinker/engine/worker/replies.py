"""What workers answer the scheduler: typed replies (``sched.r.*`` for the answers the scheduler
hands on to a client unchanged, ``sched.wr.*`` for the rest), registered with the transport.

The learner answers ``WorkerVersion`` (``sched.w.ensure``, ``sched.w.load``), ``ForwardBackwardReply``
(``sched.w.fb``; ``ForwardBackwardManyReply`` for a batch), ``ForwardReply`` (``sched.w.forward``),
``StepResult`` (``sched.w.step``), ``SavedCheckpoint`` (``sched.w.save``), ``ExportedWeights``
(``sched.w.export``) and ``AdapterTensors`` (``sched.w.adapter_weights``); the engine ``SampleReply``
(of ``SequenceReply``, ``sched.w.sample``) and ``LogprobsReply`` (``sched.w.logprobs``). The
scheduler answers a worker's ``sched.w.register`` with ``Registered``, its ``sched.w.leave`` with
``Left``, and the local runtime's
``sched.w.workers`` and ``sched.w.actors`` with ``WorkersReply`` and ``ActorsNoted``. The
scheduler's own replies (``polytinker.scheduler.service.replies``) re-export these. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytinker.engine.adapter_weights import AdapterWeights, TensorLayout
from polytinker.engine.types import AdapterRef, LoraConfig
from polytinker.errors import ProtocolError
from polytinker.transport.messages import message, register_message

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
    """``ensure`` and ``load``: the adapter's (or full-parameter model's) version now resident;
    ``loaded``: ``ensure`` read it from its checkpoint now (it was not resident at that version)."""

    version: int | None
    loaded: bool = False


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


@message("sched.wr.left")
@dataclass(frozen=True)
class Left:
    known: bool  # the incarnation that left was the one registered (False: a stale or repeated Leave)


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
    "ExportedWeights",
    "ForwardBackwardManyReply",
    "ForwardBackwardReply",
    "ForwardReply",
    "Left",
    "LogprobsReply",
    "Registered",
    "SampleReply",
    "SavedCheckpoint",
    "SequenceReply",
    "StepResult",
    "WorkerVersion",
    "WorkersReply",
]
