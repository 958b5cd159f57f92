"""What the client sends and answers, converted at its edge.

- ``to_datum``: the stack's ``polytinker.engine.types.Datum`` (what the scheduler's messages carry
  to the learner) from ``polytinker.types.Datum`` (Tinker's shape, also the SDK's own objects or a
  dict of that shape) or from an engine ``Datum``. Tinker's RL datums carry no ``weights``: a
  position counts where its advantage is non-zero.
- ``prompt_tokens``: the token ids of a prompt (a list, or a ``ModelInput``).
- ``to_sampling_params``: the stack's ``polytinker.engine.types.SamplingParams`` from
  ``polytinker.types.SamplingParams`` (Tinker's defaults and meanings, and polytinker's
  ``choices``; the SDK's own objects too), from an engine ``SamplingParams`` or a dict of its fields (polytinker's).
- ``fb_output``: a ``ForwardBackwardOutput`` from the scheduler's answer.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from polytinker.engine.types import Datum, SamplingParams
from polytinker.errors import ConfigError
from polytinker.types import ForwardBackwardOutput, TensorData, check_seed, choice_tokens, split_stop, tinker_metrics

DEFAULT_MAX_TOKENS = 256  # Tinker's max_tokens=None: as many as the HTTP front door gives by default
OUTPUT_TYPE = "ArrayRecord"  # Tinker's loss_fn_output_type for per-datum arrays


# --- data ---------------------------------------------------------------------------------------
def to_datum(d: Any) -> Datum:
    """An engine ``Datum`` (plain ints and floats, ready for the wire) from an engine ``Datum`` (or
    any object with its fields), or from Tinker's shape: ``model_input`` (token ids, or an object
    with ``to_ints()``) and ``loss_fn_inputs`` (``target_tokens``, ``weights``, and ``advantages`` /
    ``logprobs`` for the RL losses), as an object or a dict."""

    def get(key: str) -> Any:
        return d.get(key) if isinstance(d, dict) else getattr(d, key, None)

    if get("model_input") is not None:
        return _tinker_datum(get("model_input"), get("loss_fn_inputs") or {})

    def opt(v: Any) -> list[float] | None:
        return None if v is None else [float(x) for x in v]

    return Datum(
        [int(t) for t in get("input_tokens")],
        [int(t) for t in get("target_tokens_T")],
        [float(w) for w in get("weights_T")],
        opt(get("advantages_T")),
        opt(get("sampling_logprobs_T")),
    )


def _flat(key: str, v: Any) -> list[Any]:
    """The values of one loss input (TensorData, numpy, torch, a ModelInput or a list), 1-D."""
    if hasattr(v, "to_ints"):
        return list(v.to_ints())
    values = v.tolist() if hasattr(v, "tolist") else list(v)
    if any(isinstance(x, list | tuple) for x in values):
        raise ConfigError(f"loss_fn_inputs[{key!r}] must be one-dimensional (one value per target token)")
    return values


def _tinker_datum(model_input: Any, inputs: Mapping[str, Any]) -> Datum:
    def floats(key: str) -> list[float] | None:
        v = inputs.get(key)
        return None if v is None else [float(x) for x in _flat(key, v)]

    tokens = prompt_tokens(model_input)
    if inputs.get("target_tokens") is None:
        raise TypeError("a Tinker-style datum needs loss_fn_inputs['target_tokens']")
    targets = [int(t) for t in _flat("target_tokens", inputs["target_tokens"])]
    advantages = floats("advantages")
    weights = floats("weights")
    if weights is None and advantages is not None:
        weights = [1.0 if a != 0.0 else 0.0 for a in advantages]  # Tinker's RL datums: the prompt has A = 0
    elif weights is None:
        weights = [1.0] * len(targets)
    if len(tokens) != len(targets):
        raise ConfigError(
            f"a datum's model_input has {len(tokens)} tokens and its target_tokens {len(targets)}: "
            "they must be of one length"
        )
    return Datum(list(tokens), targets, weights, advantages, floats("logprobs"))


def prompt_tokens(prompt: Any) -> tuple[int, ...]:
    """Token ids of a prompt: a sequence of ints, or an object with ``to_ints()`` (a ModelInput)."""
    if hasattr(prompt, "to_ints"):
        prompt = prompt.to_ints()
    if isinstance(prompt, str) or not all(hasattr(t, "__index__") and not isinstance(t, bool) for t in prompt):
        raise TypeError("a prompt is a list of token ids (tokenize text with the model's tokenizer first)")
    return tuple(operator.index(t) for t in prompt)


# --- sampling -----------------------------------------------------------------------------------
def to_sampling_params(params: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """The engine's ``SamplingParams`` from Tinker's ``SamplingParams`` (``polytinker.types`` or the
    SDK's), from an engine ``SamplingParams`` (or any object with ``ignore_eos`` or
    ``stop_token_ids``) or a dict of its fields, or None (polytinker's defaults). ConfigError for a
    bad seed."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        check_seed(params.seed)
        return params
    if isinstance(params, dict) or hasattr(params, "ignore_eos") or hasattr(params, "stop_token_ids"):
        return _engine_sampling(params)
    stop, stop_ids, ignore_eos = split_stop(params.stop)
    max_tokens = params.max_tokens
    top_k = params.top_k
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else int(max_tokens),
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=0 if top_k is None or int(top_k) < 0 else int(top_k),  # -1: no top-k
        stop=stop,
        stop_token_ids=stop_ids,
        seed=check_seed(params.seed),
        ignore_eos=ignore_eos,  # stop=[]: not even EOS stops
        choices=choice_tokens(getattr(params, "choices", ())),  # the SDK's objects have none
    )


def _engine_sampling(params: Any) -> SamplingParams:
    get = params.get if isinstance(params, dict) else lambda k, d: getattr(params, k, d)
    d = SamplingParams()
    max_tokens = get("max_tokens", d.max_tokens)
    top_k = get("top_k", d.top_k)
    return SamplingParams(
        max_tokens=d.max_tokens if max_tokens is None else int(max_tokens),
        temperature=float(get("temperature", d.temperature)),
        top_p=float(get("top_p", d.top_p)),
        top_k=0 if top_k is None or int(top_k) < 0 else int(top_k),
        stop=tuple(get("stop", ()) or ()),
        stop_token_ids=tuple(get("stop_token_ids", ()) or ()),
        seed=check_seed(get("seed", None)),
        ignore_eos=bool(get("ignore_eos", False)),
        choices=choice_tokens(get("choices", ())),
    )


def samples_nothing(params: Any) -> bool:
    """Tinker's ``max_tokens=0``: no sequences (with ``include_prompt_logprobs``, the prompt's scores alone)."""
    return not isinstance(params, dict | SamplingParams) and getattr(params, "max_tokens", None) == 0


# --- results ------------------------------------------------------------------------------------
def fb_output(loss: float, logprobs: Sequence[Sequence[float]], metrics: Mapping[str, Any]) -> ForwardBackwardOutput:
    """Tinker's ForwardBackwardOutput: per-datum ``logprobs`` TensorData, metrics under Tinker's names."""
    outputs = [{"logprobs": TensorData(list(lp), "float32", [len(lp)])} for lp in logprobs]
    out = tinker_metrics(metrics)
    out["loss:sum"] = float(loss)
    if "loss:tokens" in out:
        out.setdefault("tokens:sum", out["loss:tokens"])
    return ForwardBackwardOutput(OUTPUT_TYPE, outputs, out)


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "fb_output",
    "prompt_tokens",
    "samples_nothing",
    "to_datum",
    "to_sampling_params",
]
