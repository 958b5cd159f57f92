"""Domain vocabulary of the model runtime (engines and learners).

- ``AdapterName``: the name of a LoRA adapter (one per learning agent, usually).
- ``AdapterRef``: an adapter name and a version; ``None`` as a request's adapter means the base model.
- ``LoraConfig``: rank, alpha, target modules of an adapter.
- ``SamplingParams``: how to sample each sequence (max_tokens, temperature, top_p, top_k, stop, seed, choices).
- ``SampleRequest`` / ``SampleResult`` / ``SampledSequence``: one request to an engine (a prompt and how
  many sequences to draw from it) and its answer.
- ``FinishReason``: why a sequence stopped.
- ``Datum``: one training example in Tinker's shape (model input tokens and per-token loss inputs).
- ``LossFnName``: the built-in losses.

``SamplingParams`` and ``Datum`` are also what the scheduler's messages carry (registered there
as ``sched.sampling_params`` and ``sched.datum``): one vocabulary from the client library through
the scheduler to the workers; ``polytinker.types`` is the Tinker-shaped public one the client
converts from.

An adapter version's tensors in memory (``AdapterWeights``, packed in one flat buffer that a
``TensorLayout`` names and shapes) live in ``polytinker.engine.adapter_weights``.

Shapes in names: ``_T`` is per token.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args

from polytinker.errors import ConfigError
from polytinker.transport.messages import register_message

AdapterName = str
TopTokens = list[tuple[int, float]]  # the likeliest next tokens at one position: (token id, logprob), best first
# compute_logprobs_topk's answer: per sequence its logprobs, and per sequence and position its TopTokens.
ScoredTopK = tuple[list[list[float]], list[list[TopTokens]]]
LossFnName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LOSS_FNS: tuple[str, ...] = get_args(LossFnName)  # the same names, to check a value against
MAX_SAMPLE_TOKENS = 1 << 16  # the most tokens one sample may ask for
MAX_SAMPLES = 1024  # the most sequences one sample call may ask for (split into engine batches)
MAX_STOPS = 64  # stop strings, and stop token ids, of one sample
MAX_STOP_CHARS = 1024
MAX_CHOICES = 1024  # the most completions a constrained sample may choose among (SamplingParams.choices)
MAX_CHOICE_TOKENS = 256  # the longest of them: an answer, scored whole for every choice

# The modules Tinker's train_attn / train_mlp / train_unembed put LoRA on; the default is the first two.
ATTN_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULE = "lm_head"
DEFAULT_TARGET_MODULES: tuple[str, ...] = ATTN_MODULES + MLP_MODULES


@dataclass(frozen=True)
class AdapterRef:
    """One version of one adapter. Versions count optimizer steps: 0 is the freshly initialised adapter."""

    name: AdapterName
    version: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("AdapterRef.name must be a non-empty string")
        if self.version < 0:
            raise ConfigError(f"AdapterRef.version must be >= 0, got {self.version}")

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class LoraConfig:
    """Shape of a LoRA adapter."""

    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ConfigError(f"LoraConfig.rank must be positive, got {self.rank}")
        if not self.target_modules:
            raise ConfigError("LoraConfig.target_modules must name at least one module")


class FinishReason(StrEnum):
    STOP = "stop"  # a stop string or stop token (EOS included) ended the sequence
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled or the engine failed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # keep sampling past EOS (stop_token_ids still stop): fixed-length benchmarks
    # Constrained sampling: the completion is exactly one of these token sequences (none may be a
    # prefix of another, each at most max_tokens long), drawn with probability proportional to the
    # model's probability of the whole sequence to the power 1 / temperature (greedy: the likeliest);
    # top_k and top_p do not apply. The logprobs are the model's own per token, what a learner scores
    # the same tokens with. Empty: unconstrained.
    choices: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.max_tokens <= MAX_SAMPLE_TOKENS:
            raise ConfigError(f"SamplingParams.max_tokens must be in 1..{MAX_SAMPLE_TOKENS}, got {self.max_tokens}")
        if self.choices:
            check_choices(self.choices, self.max_tokens)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"SamplingParams.seed must be in 0..2**63-1, got {self.seed}")
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ConfigError(f"SamplingParams.stop: at most {MAX_STOPS} strings of {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOPS:
            raise ConfigError(f"SamplingParams.stop_token_ids: at most {MAX_STOPS} ids")
        check_token_ids(self.stop_token_ids, "SamplingParams.stop_token_ids")


def check_choices(choices: tuple[tuple[int, ...], ...], max_tokens: int) -> None:
    """ConfigError unless ``choices`` are 1..MAX_CHOICES non-empty sequences of token ids, each at
    most ``max_tokens`` long, none a prefix of another (a row must know when it is done)."""
    ok = isinstance(choices, tuple) and len(choices) <= MAX_CHOICES
    ok = ok and all(isinstance(c, tuple) and 0 < len(c) <= min(max_tokens, MAX_CHOICE_TOKENS) for c in choices)
    ok = ok and all(type(t) is int and t >= 0 for c in choices for t in c)
    if not ok:
        raise ConfigError(
            f"SamplingParams.choices: at most {MAX_CHOICES} tuples of token ids (ints >= 0), "
            f"each 1..min(max_tokens={max_tokens}, {MAX_CHOICE_TOKENS}) long"
        )
    ordered = sorted(choices)  # a prefix sorts right before the sequences it starts
    for shorter, longer in itertools.pairwise(ordered):
        if longer[: len(shorter)] == shorter:
            raise ConfigError(
                f"SamplingParams.choices: {list(shorter)} is a prefix of {list(longer)} (end each choice "
                "with a stop token, e.g. the end of the turn)"
            )


@dataclass(frozen=True)
class SampleRequest:
    """Exactly one of ``prompt_token_ids`` and ``messages`` (chat messages, rendered with the
    model's chat template and a generation prompt). ``adapter=None`` samples the base model.
    ``num_samples`` sequences are drawn from the prompt, each as ``params`` say."""

    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    adapter: AdapterRef | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.messages is None):
            raise ConfigError("SampleRequest needs exactly one of prompt_token_ids and messages")
        if type(self.num_samples) is not int or not 0 < self.num_samples <= MAX_SAMPLES:
            raise ConfigError(f"SampleRequest.num_samples must be in 1..{MAX_SAMPLES}, got {self.num_samples!r}")


@dataclass(frozen=True)
class SampledSequence:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]  # one per token in token_ids, under the distribution sampled from
    finish_reason: FinishReason


@dataclass(frozen=True)
class SampleResult:
    prompt_token_ids: tuple[int, ...]
    sequences: tuple[SampledSequence, ...]  # num_samples of them
    adapter: AdapterRef | None = None


@dataclass
class Datum:
    """One training example, as in Tinker: the model sees ``input_tokens``; the loss reads
    ``loss_inputs`` per target position (aligned with ``target_tokens``).

    ``target_tokens_T``: the next token at each position (input shifted by one).
    ``weights_T``: 0 masks a position out (observation/prompt tokens), 1 trains it.
    ``advantages_T`` and ``sampling_logprobs_T``: for ``importance_sampling`` and ``ppo``.
    """

    input_tokens: list[int]
    target_tokens_T: list[int]
    weights_T: list[float]
    advantages_T: list[float] | None = None
    sampling_logprobs_T: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.target_tokens_T)
        if n == 0:
            raise ConfigError("Datum: a datum needs at least one target token")
        if len(self.input_tokens) != n:
            raise ConfigError(f"Datum: input_tokens has {len(self.input_tokens)} tokens, target_tokens_T {n}")
        for name in ("weights_T", "advantages_T", "sampling_logprobs_T"):
            value: Any = getattr(self, name)
            if value is not None and len(value) != n:
                raise ConfigError(f"Datum.{name} has {len(value)} entries, expected {n} (one per target token)")


@dataclass(frozen=True)
class ModelLimits:
    """What a base model can read: ids in ``[0, vocab_size)`` and at most ``max_positions``
    tokens in one sequence (0: not known). Workers read them from the model's config and report
    them when they register, so the scheduler checks requests at its door with them."""

    vocab_size: int = 0
    max_positions: int = 0

    def check_context(self, prompt_tokens: int, new_tokens: int) -> None:
        if self.max_positions and prompt_tokens + new_tokens > self.max_positions:
            raise ConfigError(
                f"{prompt_tokens} prompt tokens and max_tokens={new_tokens} exceed the model's context of "
                f"{self.max_positions} tokens"
            )


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int = 0) -> None:
    """ConfigError naming ``field`` unless every id is in ``[0, vocab_size)`` (``vocab_size`` 0:
    unknown, only ``>= 0`` is checked). min/max run at C speed over long prompts."""
    if not ids:
        return
    if not set(map(type, ids)) <= {int} and not all(hasattr(t, "__index__") and type(t) is not bool for t in ids):
        raise ConfigError(f"{field}: token ids must be integers")
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size and high >= vocab_size):
        bad = low if low < 0 else high
        limit = f"0..{vocab_size - 1}" if vocab_size else ">= 0"
        raise ConfigError(
            f"{field}: token id {bad} at position {list(ids).index(bad)} is out of range (the model's ids are {limit})"
        )


def check_finite(values: Sequence[float] | None, field: str) -> None:
    """ConfigError naming ``field`` when one of ``values`` is NaN or infinite: one such number
    in a loss input makes every weight of the adapter NaN after the step."""
    if values is not None and not all(map(math.isfinite, values)):
        bad = next(v for v in values if not math.isfinite(v))
        raise ConfigError(f"{field} holds a non-finite number ({bad})")


def check_data(data: Sequence[Datum], loss_fn: str = "cross_entropy", vocab_size: int = 0) -> None:
    """ConfigError naming the datum and the field of the first value a learner must not read:
    a token id out of range, a non-finite weight, advantage or logprob, or a policy loss's input
    missing. The scheduler runs it at its door (``vocab_size`` once a worker told it the model's)
    and a learner before it touches the model."""
    if loss_fn not in LOSS_FNS:
        raise ConfigError(f"loss_fn must be one of {LOSS_FNS}, got {loss_fn!r}")
    policy_loss = loss_fn != "cross_entropy"
    for i, d in enumerate(data):
        check_token_ids(d.input_tokens, f"data[{i}].input_tokens", vocab_size)
        check_token_ids(d.target_tokens_T, f"data[{i}].target_tokens", vocab_size)
        check_finite(d.weights_T, f"data[{i}].weights")
        check_finite(d.advantages_T, f"data[{i}].advantages")
        check_finite(d.sampling_logprobs_T, f"data[{i}].logprobs")
        if policy_loss and (d.advantages_T is None or d.sampling_logprobs_T is None):
            raise ConfigError(f"data[{i}]: loss_fn {loss_fn!r} needs advantages and logprobs on every datum")


def need(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless ``cond``: the one-line checks of messages' ``__post_init__``."""
    if not cond:
        raise ConfigError(msg)


MAX_TOP_K = 20  # as vLLM's engines serve at most by default (max_logprobs)


def check_top_k(k: int) -> None:
    need(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_TOP_K, f"top_k must be in 0..{MAX_TOP_K}")


MAX_LOSS_CONFIG = 16  # keys of loss_fn_config


def check_loss_config(config: dict[str, float] | None) -> None:
    """ConfigError unless ``config`` is None or at most MAX_LOSS_CONFIG names of finite numbers."""
    if config is None:
        return
    if not isinstance(config, dict) or len(config) > MAX_LOSS_CONFIG:
        raise ConfigError(f"loss_fn_config: at most {MAX_LOSS_CONFIG} finite numbers")
    for name, value in config.items():
        if not (isinstance(name, str) and isinstance(value, int | float) and math.isfinite(value)):
            raise ConfigError(f"loss_fn_config[{str(name)[:64]!r}] must be a finite number")


# The one training example and the sampling parameters of the whole stack travel as values in
# messages (the scheduler's, its clients' and its workers'): registered where they are defined,
# so every process that has the types can encode and decode them.
register_message("sched.datum", Datum)
register_message("sched.sampling_params", SamplingParams)

__all__ = [
    "ATTN_MODULES",
    "DEFAULT_TARGET_MODULES",
    "LOSS_FNS",
    "MAX_TOP_K",
    "MLP_MODULES",
    "UNEMBED_MODULE",
    "AdapterName",
    "AdapterRef",
    "Datum",
    "FinishReason",
    "LoraConfig",
    "LossFnName",
    "ModelLimits",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "ScoredTopK",
    "TopTokens",
    "check_data",
    "check_finite",
    "check_loss_config",
    "check_token_ids",
    "check_top_k",
    "need",
]
