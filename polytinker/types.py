"""The vocabulary of the client API, shaped like the ``tinker`` SDK's ``tinker.types``.

Code written for Tinker runs on polytinker's own client with the import changed
(``import polytinker as tinker``, ``from polytinker import types``). Plain frozen dataclasses:

- ``EncodedTextChunk``, ``ModelInput``: a model's input tokens (``ModelInput.from_ints``, ``to_ints``).
- ``TensorDtype``, ``TensorData``: a flat list of numbers with a dtype and a shape (to and from numpy
  and torch).
- ``Datum``: one training example: ``model_input`` and ``loss_fn_inputs`` (``target_tokens``,
  ``weights``; ``logprobs`` and ``advantages`` for the RL losses), each a ``TensorData``.
- ``LossFnType``: the built-in losses.
- ``SamplingParams``: how to sample, with Tinker's defaults (``max_tokens=None``, ``top_k=-1``, ...).
- ``AdamParams``: the AdamW hyperparameters of one ``optim_step`` (the learner's own class).
- ``DEFAULT_TARGET_MODULES``: the linear layers a LoRA adapter trains unless told otherwise.
- ``StopReason``; ``SampledSequence``, ``SampleResponse``: what ``sample`` answers.
- ``ForwardBackwardOutput``, ``OptimStepResponse``, ``SaveWeightsResponse``,
  ``SaveWeightsForSamplerResponse``, ``LoadWeightsResponse``, ``ModelData``, ``GetInfoResponse``,
  ``SupportedModel``, ``GetServerCapabilitiesResponse``: what the other calls answer.
- ``Metrics``: a result's metrics under Tinker's names (``loss:sum``); polytinker's earlier names
  (``loss/sum``) still answer lookups.

Beyond Tinker's fields, results keep what polytinker's client answered before:
``ForwardBackwardOutput.loss`` and ``.logprobs``, ``OptimStepResponse.version``,
``SampledSequence.text``, ``LoadWeightsResponse.version``; the two save responses are the path
strings themselves (with ``.path``). This module imports neither torch nor numpy until a
conversion needs them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import DEFAULT_TARGET_MODULES, LossFnName
from polytinker.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

TensorDtype: TypeAlias = Literal["int64", "float32"]
LossFnType: TypeAlias = LossFnName  # Tinker's name for polytinker.engine.types.LossFnName
StopReason: TypeAlias = Literal["length", "stop"]

MAX_SEED = 1 << 63  # seeds are ints in [0, MAX_SEED): what every engine's generator takes


def _ints(values: Iterable[Any], what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or (not isinstance(v, int) and not hasattr(v, "__index__")):
            raise ConfigError(f"{what} must be token ids (ints), got {v!r}")
        out.append(int(v))
    return out


# --- model input ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids (the only kind of chunk built: no images)."""

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _ints(self.tokens, "EncodedTextChunk.tokens"))

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    """What the model reads: a list of chunks. ``append`` and ``append_int`` return new inputs."""

    chunks: list[EncodedTextChunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        chunks = list(self.chunks)
        for c in chunks:
            if not isinstance(c, EncodedTextChunk):
                raise ConfigError(f"only encoded-text chunks are built (no images), got {type(c).__name__}")
        object.__setattr__(self, "chunks", chunks)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls([EncodedTextChunk(list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls([])

    def to_ints(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput([*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk([token]))


# --- tensors ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorData:
    """A tensor as a flat, row-major list of numbers, its dtype and its shape (``None``: 1-D)."""

    data: list[int] | list[float]
    dtype: TensorDtype
    shape: list[int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("int64", "float32"):
            raise ConfigError(f"TensorData.dtype must be 'int64' or 'float32', got {self.dtype!r}")
        data = [int(x) for x in self.data] if self.dtype == "int64" else [float(x) for x in self.data]
        object.__setattr__(self, "data", data)
        if self.shape is not None:
            shape = [int(n) for n in self.shape]
            if math.prod(shape) != len(data):
                raise ConfigError(f"TensorData: shape {shape} does not hold {len(data)} values")
            object.__setattr__(self, "shape", shape)

    @classmethod
    def from_numpy(cls, array: npt.NDArray[Any]) -> TensorData:
        kind = array.dtype.kind
        if kind not in "fiub":
            raise ConfigError(f"TensorData holds numbers, not numpy dtype {array.dtype}")
        return cls(array.reshape(-1).tolist(), "float32" if kind == "f" else "int64", list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        dtype: TensorDtype = "float32" if tensor.dtype.is_floating_point else "int64"
        return cls(tensor.detach().cpu().reshape(-1).tolist(), dtype, list(tensor.shape))

    def to_numpy(self) -> np.ndarray[Any, Any]:
        import numpy as np

        arr = np.asarray(self.data, dtype=np.float32 if self.dtype == "float32" else np.int64)
        return arr.reshape(self.shape) if self.shape is not None else arr

    def to_torch(self) -> torch.Tensor:
        import torch

        t = torch.tensor(self.data, dtype=torch.float32 if self.dtype == "float32" else torch.int64)
        return t.reshape(self.shape) if self.shape is not None else t

    def tolist(self) -> list[Any]:
        if self.shape is None or len(self.shape) == 1:
            return list(self.data)
        out: list[Any] = self.to_numpy().tolist()
        return out


def to_tensor_data(key: str, value: Any) -> TensorData:
    """``value`` (a TensorData, numpy array, torch tensor, ModelInput, or list of numbers) as
    TensorData; a list takes ``int64`` for ``target_tokens`` and ``float32`` for anything else."""
    if isinstance(value, TensorData):
        return value
    if hasattr(value, "to_ints"):
        return TensorData(value.to_ints(), "int64")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(dtype, "is_floating_point") and hasattr(value, "detach"):
        return TensorData.from_torch(value)
    if dtype is not None and hasattr(dtype, "kind") and hasattr(value, "reshape"):
        return TensorData.from_numpy(value)
    if isinstance(value, list | tuple):
        if any(isinstance(v, list | tuple) for v in value):
            raise ConfigError(f"loss_fn_inputs[{key!r}]: pass a nested list as a numpy array or TensorData")
        return TensorData(list(value), "int64" if key == "target_tokens" else "float32")
    raise ConfigError(f"loss_fn_inputs[{key!r}]: unsupported value of type {type(value).__name__}")


# --- training ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Datum:
    """One training example. ``loss_fn_inputs`` values may be given as lists, numpy arrays or
    torch tensors; they are stored as TensorData. A datum of the RL losses without ``weights``
    counts the positions whose advantage is non-zero (the prompt's positions have advantage 0)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        model_input = self.model_input
        if not isinstance(model_input, ModelInput):  # token ids, or another ModelInput class (the SDK's)
            tokens = model_input.to_ints() if hasattr(model_input, "to_ints") else model_input
            model_input = ModelInput.from_ints(tokens)
        object.__setattr__(self, "model_input", model_input)
        inputs = {str(k): to_tensor_data(str(k), v) for k, v in dict(self.loss_fn_inputs).items()}
        object.__setattr__(self, "loss_fn_inputs", inputs)


class Metrics(dict[str, float]):
    """Metrics under Tinker's names (``loss:sum``, ``optim:grad_norm``). A lookup by polytinker's
    earlier names (``loss/sum``, ``optim/grad_norm``) answers the same value; iteration shows each
    metric once, under its Tinker name."""

    def __missing__(self, key: str) -> float:
        alias = tinker_metric_name(key) if isinstance(key, str) else key
        if alias != key and dict.__contains__(self, alias):
            return float(dict.__getitem__(self, alias))
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        return isinstance(key, str) and dict.__contains__(self, tinker_metric_name(key))


def tinker_metric_name(name: str) -> str:
    """Tinker's name of a polytinker metric: ``loss/sum`` -> ``loss:sum``; a bare name is a mean."""
    return name.replace("/", ":") if "/" in name or ":" in name else f"{name}:mean"


def tinker_metrics(metrics: Mapping[str, Any]) -> Metrics:
    """The finite numeric ``metrics`` under Tinker's names."""
    out = Metrics()
    for k, v in metrics.items():
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[tinker_metric_name(k)] = float(v)
    return out


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """What ``forward_backward`` (and ``forward`` with a loss) answers: per datum a dict of
    TensorData (``logprobs``: one per target token, before the step), and the call's metrics
    (``loss:sum``, ``loss:tokens``, ...)."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=Metrics)

    @property
    def loss(self) -> float:
        """The summed loss of the call (``metrics["loss:sum"]``)."""
        return float(self.metrics.get("loss:sum", math.nan))

    @cached_property
    def logprobs(self) -> list[list[float]]:
        """Per datum, the log-probability of each target token (``loss_fn_outputs[i]["logprobs"]``)."""
        return [[float(x) for x in out["logprobs"].tolist()] for out in self.loss_fn_outputs]


@dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=Metrics)
    version: int = 0  # polytinker: the adapter version the step made (durable when this arrives)


class _PathResponse(str):
    """A response that is its path: ``resp.path``, and the string itself where a path was taken."""

    type: str = ""

    def __new__(cls, path: str) -> _PathResponse:
        return super().__new__(cls, path)

    @property
    def path(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r})"


class SaveWeightsResponse(_PathResponse):
    """``save_state``'s answer: the checkpoint's path (``polytinker-ckpt://JOB/NAME``)."""

    type = "save_weights"


class SaveWeightsForSamplerResponse(_PathResponse):
    """``save_weights_for_sampler``'s answer: the version's model path (``polytinker://JOB/AGENT@V``)."""

    type = "save_weights_for_sampler"


@dataclass(frozen=True)
class LoadWeightsResponse:
    path: str | None = None
    model_id: str | None = None  # the job the weights were loaded into
    version: int = 0  # polytinker: the job's adapter version after the load
    type: Literal["load_weights"] = "load_weights"


@dataclass(frozen=True)
class ModelData:
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclass(frozen=True)
class GetInfoResponse:
    model_data: ModelData
    model_id: str  # the job id
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"


@dataclass(frozen=True)
class SupportedModel:
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


@dataclass(frozen=True)
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]


# --- sampling ---------------------------------------------------------------------------------------
def check_seed(seed: Any) -> int | None:
    """``seed`` if it is None or an int in [0, 2**63); ConfigError otherwise."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ConfigError(f"sampling seed must be None or an int in [0, 2**63), got {seed!r}")
    return seed


@dataclass(frozen=True)
class SamplingParams:
    """How to sample, with Tinker's defaults and meanings.

    ``max_tokens``: None takes the client's default (256); ``top_k=-1``: no top-k; ``stop``: a
    string, a list of strings, or a list of token ids; ``None`` stops at EOS only, and ``[]``
    does not stop even at EOS (sampling runs to ``max_tokens``).

    Beyond Tinker's fields, ``choices`` (polytinker's constrained sampling): the completion is
    exactly one of these token sequences (none a prefix of another, each at most ``max_tokens``
    long), drawn with probability proportional to the model's probability of the whole sequence
    to the power 1 / temperature; top_k and top_p do not apply. Empty: unconstrained."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    choices: Sequence[Sequence[int]] = ()

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or self.max_tokens < 0):
            raise ConfigError(f"SamplingParams.max_tokens must be None or >= 0, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"SamplingParams.top_k must be -1 (no limit) or >= 0, got {self.top_k}")
        split_stop(self.stop)
        object.__setattr__(self, "choices", choice_tokens(self.choices))  # hashable, as the engine's checks expect


def choice_tokens(choices: Any) -> tuple[tuple[int, ...], ...]:
    """``SamplingParams.choices`` (any sequence of token-id sequences, or None) as tuples of ints;
    ConfigError naming the field for anything else. The engine checks their sizes and prefixes."""
    try:
        return tuple(tuple(_ints(c, "SamplingParams.choices")) for c in choices or ())
    except TypeError:
        raise ConfigError(f"SamplingParams.choices must be a list of token-id lists, got {choices!r:.80}") from None


def split_stop(stop: Any) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """(stop strings, stop token ids, ignore EOS) of Tinker's ``stop``."""
    if stop is None:
        return (), (), False
    if isinstance(stop, str):
        return (stop,), (), False
    items = list(stop)
    if not items:
        return (), (), True
    if all(isinstance(s, str) for s in items):
        return tuple(items), (), False
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        return (), tuple(items), False
    raise ConfigError(f"stop must be a string, a list of strings or a list of token ids, got {stop!r}")


@dataclass(frozen=True)
class SampledSequence:
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float]  # one per token, the model's own (before temperature)
    text: str = ""  # polytinker: the tokens decoded (special tokens left out)


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # with include_prompt_logprobs: None first
    # With topk_prompt_logprobs=k: per prompt position the k likeliest tokens there as
    # (token id, logprob), best first; None first (nothing predicts the first token).
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


__all__ = [
    "DEFAULT_TARGET_MODULES",
    "MAX_SEED",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetServerCapabilitiesResponse",
    "LoadWeightsResponse",
    "LossFnType",
    "Metrics",
    "ModelData",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "StopReason",
    "SupportedModel",
    "TensorData",
    "TensorDtype",
    "check_seed",
    "split_stop",
    "tinker_metric_name",
    "tinker_metrics",
    "to_tensor_data",
]
