"""The Tinker API's JSON bodies checked at the door, before anything is queued or stored.

Each route names a spec, ``{field: check}``; a check gets the field's value (None when absent)
and where it is (``lora_config.rank``) and raises a ConfigError (a 400) that names the field and
says what it must be. Fields polytinker does not read (``type``, ``tags``, ...) pass unchecked.
The scheduler checks its messages again; these checks keep a bad body from reaching it at all,
and from turning into a 500 on the way (a string where a number goes, a NaN, a count in the
millions). ``vocab_size`` bounds token ids by the base model's embedding.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from polytinker.engine.learner.config import LossConfig
from polytinker.engine.models import ModelConfig, resolve_model, served_name
from polytinker.engine.types import LOSS_FNS, MAX_SAMPLES, MAX_TOP_K
from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway.wire import MAX_INT32
from polytinker.scheduler.service.messages import MAX_TTL_S

Check = Callable[[Any, str], None]
Spec = dict[str, Check]

MAX_ID_CHARS = 256  # model, session, sampler and request ids (the gateway's own are < 64)
MAX_PATH_CHARS = 1024  # tinker:// paths, base model names
MAX_SAMPLE_TOKENS = 1 << 16  # as the engine's SamplingParams allows
MAX_STOPS = 64
MAX_STOP_CHARS = 1000
MAX_METADATA_KEYS = 64
MAX_METADATA_CHARS = 16_384  # one value, as JSON


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(where: str, what: str, value: Any) -> NoReturn:
    raise ConfigError(f"{where} must be {what}, got {_show(value)}")


def text(max_chars: int = MAX_ID_CHARS, *, required: bool = False) -> Check:
    def check(value: Any, where: str) -> None:
        if value is None and not required:
            return
        if not isinstance(value, str) or len(value) > max_chars:
            _fail(where, f"a string of at most {max_chars} characters", value)

    return check


def whole(lo: int, hi: int, *, required: bool = False, hint: str = "") -> Check:
    def check(value: Any, where: str) -> None:
        if value is None and not required:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            _fail(where, f"a whole number in {lo}..{hi}{hint}", value)

    return check


def number(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in the range (``lo_open``/``hi_open``: that end excluded)."""
    low, high = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    what = f"a finite number in {low}{lo}, {hi}{high}"

    def check(value: Any, where: str) -> None:
        if value is None:
            return
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            _fail(where, what, value)

    _NUMBERS.add(check)
    return check


# The checks number() made (all at import): a field they check that is sent as null is refused
# rather than taken as absent, for the SDK serializes NaN and infinities as null (_field).
_NUMBERS: set[Check] = set()


def _field(obj: dict[str, Any], name: str, check: Check, where: str) -> None:
    """Run ``check`` on ``obj[name]`` (None when absent)."""
    if name in obj and obj[name] is None and check in _NUMBERS:
        _fail(where, "a finite number (the SDK sends NaN and infinities as null)", None)
    check(obj.get(name), where)


def flag(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, bool):
        _fail(where, "true or false", value)


def fields(spec: Spec, *, required: bool = False) -> Check:
    """An object whose fields ``spec`` checks."""

    def check(value: Any, where: str) -> None:
        if value is None and not required:
            return
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for name, inner in spec.items():
            _field(value, name, inner, f"{where}.{name}")

    return check


def texts(max_items: int, max_chars: int) -> Check:
    def check(value: Any, where: str) -> None:
        if value is None:
            return
        if not isinstance(value, list) or len(value) > max_items:
            _fail(where, f"a list of at most {max_items} strings", value)
        for i, item in enumerate(value):
            text(max_chars, required=True)(item, f"{where}[{i}]")

    return check


def metadata(value: Any, where: str) -> None:
    """User metadata as the SDK sends it: string keys, JSON values, bounded."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        _fail(where, f"an object of at most {MAX_METADATA_KEYS} entries", value)
    for key, item in value.items():
        if len(key) > MAX_ID_CHARS:
            _fail(f"{where} key", f"at most {MAX_ID_CHARS} characters", key)
        if not isinstance(item, str) and len(json.dumps(item)) > MAX_METADATA_CHARS:
            _fail(f"{where}.{key}", f"at most {MAX_METADATA_CHARS} characters of JSON", item)
        if isinstance(item, str) and len(item) > MAX_METADATA_CHARS:
            _fail(f"{where}.{key}", f"at most {MAX_METADATA_CHARS} characters", item)


def stop(value: Any, where: str) -> None:
    """Tinker's ``stop``: a string, a list of strings, or a list of token ids."""
    if value is None or (isinstance(value, str) and len(value) <= MAX_STOP_CHARS):
        return
    what = f"a string, or a list of at most {MAX_STOPS} strings or of at most {MAX_STOPS} token ids"
    if not isinstance(value, list) or len(value) > MAX_STOPS:
        _fail(where, what, value)
    if all(isinstance(s, str) for s in value):
        for i, s in enumerate(value):
            if not 0 < len(s) <= MAX_STOP_CHARS:
                _fail(f"{where}[{i}]", f"a string of 1..{MAX_STOP_CHARS} characters", s)
    elif all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        for i, s in enumerate(value):
            whole(0, MAX_INT32)(s, f"{where}[{i}]")
    else:
        _fail(where, what, value)


def check_body(body: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """``body`` once every field of ``spec`` passed its check."""
    for name, check in spec.items():
        _field(body, name, check, name)
    return body


def check_tokens(tokens: Any, where: str, vocab: int | None) -> None:
    """Token ids in the base model's vocabulary (``vocab``; None: unknown here, ids in int32)."""
    limit = vocab if vocab is not None else MAX_INT32 + 1
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < limit), None)
    if bad is not None:
        _fail(f"{where}[{bad}]", f"a token id in 0..{limit - 1}", tokens[bad])


# --- forward_backward's data ---------------------------------------------------------------------
TARGETS = "target_tokens"
FLOAT_INPUTS = ("weights", "advantages", "logprobs")  # what the losses read besides the targets
RL_INPUTS = ("advantages", "logprobs")  # what every loss but cross_entropy reads


def _array_fail(where: str, what: str, arr: np.ndarray) -> NoReturn:
    raise ConfigError(f"{where} must be {what}, got a {arr.dtype} tensor of shape {list(arr.shape)}")


def _check_ids(arr: np.ndarray, where: str, vocab: int | None) -> None:
    limit = vocab if vocab is not None else MAX_INT32 + 1
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        bad = int(np.flatnonzero((arr < 0) | (arr >= limit))[0])
        _fail(f"{where}[{bad}]", f"a token id in 0..{limit - 1}", int(arr[bad]))


def check_datum(d: dict[str, Any], i: int, vocab: int | None, rl_loss: str | None) -> None:
    """One decoded datum (``_proto.decode_forward_backward``): its tokens in the vocabulary, each
    loss input one finite value per token, and what ``rl_loss`` (a loss other than cross
    entropy, None for none) reads present."""
    where = f"data[{i}]"
    tokens: np.ndarray = d["tokens"]
    n = len(tokens)
    if n == 0:
        raise ConfigError(f"{where}.model_input must hold at least one token")
    _check_ids(tokens, f"{where}.model_input", vocab)
    inputs: dict[str, np.ndarray] = d["loss_fn_inputs"]
    for name in (TARGETS, *(RL_INPUTS if rl_loss else ())):
        if name not in inputs:
            why = f" for loss_fn {rl_loss!r}" if name != TARGETS else ""
            raise ConfigError(f"{where}.loss_fn_inputs.{name} is missing: it takes one value per input token{why}")
    for name in (TARGETS, *FLOAT_INPUTS):
        arr = inputs.get(name)
        if arr is None:
            continue
        at = f"{where}.loss_fn_inputs.{name}"
        if arr.ndim != 1 or len(arr) != n:
            _array_fail(at, f"one value per input token ({n}, one-dimensional)", arr)
        if name == TARGETS:
            if arr.dtype.kind not in "iu":
                _array_fail(at, "token ids (an integer tensor)", arr)
            _check_ids(arr, at, vocab)
        elif not np.isfinite(arr).all():
            bad = int(np.flatnonzero(~np.isfinite(arr))[0])
            _fail(f"{at}[{bad}]", "a finite number", float(arr[bad]))


_ANY_NUMBER = number(-math.inf)


def check_loss(loss_fn: str, config: dict[str, Any]) -> dict[str, float] | None:
    """``loss_fn`` one of polytinker's losses and ``config`` (the SDK's ``loss_fn_config``) one the
    learner takes: known names, finite numbers, in range; the config as the learner reads it."""
    if loss_fn not in LOSS_FNS:
        _fail("loss_fn", f"one of {', '.join(LOSS_FNS)}", loss_fn)
    for key in config:
        if isinstance(config[key], str):
            raise NotBuiltError(f"loss_fn_config.{key}: text values are not built (numbers are)")
        _field(config, key, _ANY_NUMBER, f"loss_fn_config.{key}")
    try:
        LossConfig.from_mapping(config)
    except ConfigError as exc:
        raise ConfigError(f"loss_fn_config: {exc}") from None
    return {k: float(v) for k, v in config.items()} or None


def served_base_model(served: tuple[str, ...], name: Any) -> str:
    """The served base model ``name`` names, by its own name or its hub id (``models.model_names``:
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` is ``smollm2-135m-instruct``); a ConfigError for a model
    not served. With nothing listed as served (a gateway told no model), ``name`` as it is."""
    if not isinstance(name, str) or not name:
        raise ConfigError("base_model must be named")
    found = next((m for m in served if served_name(m, name)), None)
    if served and found is None:
        raise ConfigError(f"base model {name!r} is not served here; get_server_capabilities lists {list(served)}")
    return found or name


@functools.lru_cache(maxsize=64)
def vocab_size(base_model: str) -> int | None:
    """The number of token ids ``base_model``'s embedding holds, from its config.json where this
    machine has the model; None where it has not (nothing is fetched for it)."""
    try:
        config = json.loads((resolve_model(base_model, ModelConfig(offline=True)) / "config.json").read_text())
    except Exception:  # not on this machine (a gateway in front of a remote scheduler): ids in int32
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


# --- the routes' specs ------------------------------------------------------------------------------
SEQ_ID = whole(0, MAX_INT32)
MODEL_ID = text(required=True)
SESSION_ID = text(required=True)
TTL = whole(1, int(MAX_TTL_S))
PATH = text(MAX_PATH_CHARS)
NAME = text(128)  # the scheduler checks the characters of a checkpoint name

CREATE_SESSION: Spec = {
    "tags": texts(256, 256),
    "user_metadata": metadata,
    "sdk_version": text(64),
    "project_id": text(),
    "display_name": text(1000),
}
FINISH_SESSION: Spec = {"reason": fields({"type": text(32)}), "detail": text(65_536)}
HEARTBEAT: Spec = {"session_id": SESSION_ID}
MODEL: Spec = {"model_id": MODEL_ID}
LORA: Spec = {
    "rank": whole(1, 1024, required=True),
    "seed": whole(-(1 << 63), (1 << 63) - 1),
    "train_mlp": flag,
    "train_attn": flag,
    "train_unembed": flag,
}
CREATE_MODEL: Spec = {
    "session_id": SESSION_ID,
    "model_seq_id": SEQ_ID,
    "base_model": text(MAX_PATH_CHARS, required=True),
    "lora_config": fields(LORA),
    "user_metadata": metadata,
    "optimizer_config": fields({"type": text(32)}),
}
ADAM: Spec = {
    "learning_rate": number(0),
    "beta1": number(0, 1, hi_open=True),
    "beta2": number(0, 1, hi_open=True),
    "eps": number(0, lo_open=True),
    "weight_decay": number(0),
    "grad_clip_norm": number(0),
}
OPTIM_STEP: Spec = {
    "model_id": MODEL_ID,
    "seq_id": SEQ_ID,
    "adam_params": fields(ADAM),
    "optim_params": fields(ADAM),
    "optimizer_params": fields({"type": text(32)}),
}
SAVE: Spec = {
    "model_id": MODEL_ID,
    "path": NAME,
    "seq_id": SEQ_ID,
    "sampling_session_seq_id": SEQ_ID,
    "ttl_seconds": TTL,
    "user_metadata": metadata,
}
SAVE_EXTERNAL: Spec = {**SAVE, "path": text(128, required=True), "age_encryption_recipients": texts(10, 16_384)}
LOAD: Spec = {
    "model_id": text(),
    "seq_id": SEQ_ID,
    "session_id": text(),
    "model_seq_id": SEQ_ID,
    "user_metadata": metadata,
    "path": text(MAX_PATH_CHARS, required=True),
    "optimizer": flag,
    "weights_access_token": text(4096),
}
WEIGHTS_INFO: Spec = {"tinker_path": PATH}
COPY: Spec = {
    "session_id": text(),
    "model_seq_id": SEQ_ID,
    "destination_project_id": text(),
    "source_path": text(MAX_PATH_CHARS, required=True),
    "ttl_seconds": TTL,
}
SET_TTL: Spec = {"ttl_seconds": TTL}
CREATE_SAMPLER: Spec = {
    "session_id": SESSION_ID,
    "sampling_session_seq_id": SEQ_ID,
    "base_model": PATH,
    "model_path": PATH,
}
SAMPLING: Spec = {
    "max_tokens": whole(1, MAX_SAMPLE_TOKENS, hint=" (max_tokens=1 scores the prompt in one prefill)"),
    "seed": whole(0, (1 << 63) - 1),
    "stop": stop,
    "temperature": number(0),
    "top_k": whole(-1, MAX_INT32),
    "top_p": number(0, 1, lo_open=True),
}
ASAMPLE: Spec = {
    "num_samples": whole(1, MAX_SAMPLES),
    "sampling_params": fields(SAMPLING),
    "base_model": PATH,
    "model_path": PATH,
    "sampling_session_id": text(),
    "seq_id": SEQ_ID,
    "prompt_logprobs": flag,
    "topk_prompt_logprobs": whole(0, MAX_TOP_K),
    "topk_sample_logprobs": whole(0, MAX_INT32),
    "prompt_alt_tokens_k": whole(0, MAX_INT32),
    "prompt_logprobs_last_n": whole(0, MAX_INT32),
    "record_stability_info": flag,
}
REQUEST: Spec = {"request_id": text(required=True)}

__all__ = [
    "ADAM",
    "ASAMPLE",
    "CREATE_MODEL",
    "MAX_INT32",
    "check_body",
    "check_datum",
    "check_loss",
    "check_tokens",
    "served_base_model",
    "vocab_size",
]
