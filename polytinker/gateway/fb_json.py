"""A ``forward_backward`` or ``forward`` request sent as JSON, decoded into what the protobuf body
decodes into (``_proto.decode_forward_backward``), so both go through the same checks after
(``fb_request``: either body, decoded and checked at the door).

The tinker SDK sends JSON where the server does not advertise protobuf (``proto_write_fwdbwd`` in
the client config; releases before 0.25 read it), and 0.22's ``TrainingClient.forward`` always
posts JSON to ``/api/v1/forward``. The shape, as those releases write it::

    {"model_id": "...", "seq_id": 3,
     "forward_backward_input" (or "forward_input" at /forward): {
         "loss_fn": "cross_entropy", "loss_fn_config": {"name": 1.0} | absent,
         "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [...]}]},
                   "loss_fn_inputs": {"target_tokens": {"data": [...], "dtype": "int64", "shape": [n]}}}]}}

Counts are checked before anything is built, and every value's type before numpy sees it: a
``true``, a string or a nested list where a number goes is a ConfigError naming it, as is a
``null`` among a float tensor's values (the SDK writes NaN and infinities as null).
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import numpy as np

from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway import _proto, checks
from polytinker.gateway._proto import MAX_DATUM_TOKENS, MAX_DIMS
from polytinker.gateway.checks import Spec, check_body, fields, text
from polytinker.gateway.tinker_backend import Tenant, TinkerBackend, tinker_datum
from polytinker.scheduler.service.messages import MAX_DATA

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_DTYPES = {"int64": np.int64, "float32": np.float32}
# One tensor holds at most one value per token of its datum (a loss input), so a datum's bound
# bounds it; shapes with more dimensions than that are refused by the datum checks after.
MAX_TENSOR_VALUES = MAX_DATUM_TOKENS


def _fail(where: str, what: str, value: Any) -> NoReturn:
    text = repr(value)
    raise ConfigError(f"{where} must be {what}, got {text if len(text) <= 80 else text[:77] + '...'}")


def _spec(input_field: str) -> Spec:
    """The request's plain fields; ``data`` and ``loss_fn_config`` are read below, counted first."""
    return {
        "model_id": checks.MODEL_ID,
        "seq_id": checks.SEQ_ID,
        input_field: fields({"loss_fn": text(required=True)}, required=True),
    }


def _ints(values: Any, where: str, lo: int, hi: int, what: str) -> np.ndarray:
    if not isinstance(values, list) or len(values) > MAX_TENSOR_VALUES:
        _fail(where, f"a list of at most {MAX_TENSOR_VALUES} whole numbers", values)
    bad = next((i for i, x in enumerate(values) if type(x) is not int or not lo <= x <= hi), None)
    if bad is not None:
        _fail(f"{where}[{bad}]", what, values[bad])
    return np.asarray(values, dtype=np.int64)


def _floats(values: Any, where: str) -> np.ndarray:
    if not isinstance(values, list) or len(values) > MAX_TENSOR_VALUES:
        _fail(where, f"a list of at most {MAX_TENSOR_VALUES} numbers", values)
    bad = next((i for i, x in enumerate(values) if type(x) not in (int, float) or not math.isfinite(x)), None)
    if bad is not None:
        hint = " (the SDK sends NaN and infinities as null)" if values[bad] is None else ""
        _fail(f"{where}[{bad}]", f"a finite number{hint}", values[bad])
    return np.asarray(values, dtype=np.float32)


def _tensor(value: Any, where: str) -> np.ndarray:
    """A ``TensorData``: dense, int64 or float32, its values matching its shape."""
    if not isinstance(value, dict):
        _fail(where, "a tensor: {'data': [...], 'dtype': 'int64' or 'float32', 'shape': [...]}", value)
    if value.get("sparse_crow_indices") is not None or value.get("sparse_col_indices") is not None:
        raise ConfigError(f"{where} must be dense (sparse CSR inputs are not supported)")
    dtype = value.get("dtype")
    if dtype not in _DTYPES:
        _fail(f"{where}.dtype", "'int64' or 'float32'", dtype)
    data = value.get("data")
    if dtype == "int64":
        arr = _ints(data, f"{where}.data", *_INT64, "a whole number in signed 64 bits")
    else:
        arr = _floats(data, f"{where}.data")
    shape = value.get("shape")
    if shape is None:
        return arr
    _ints(shape, f"{where}.shape", 0, MAX_TENSOR_VALUES, f"a dimension in 0..{MAX_TENSOR_VALUES}")
    if len(shape) > MAX_DIMS or math.prod(shape) != arr.size:
        raise ConfigError(f"{where}: the tensor's shape {shape[: MAX_DIMS + 1]} does not hold its {arr.size} elements")
    return arr.reshape(shape)


def _tokens(model_input: Any, where: str) -> np.ndarray:
    """A datum's ``ModelInput`` as int32 token ids, counted before any is kept."""
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        _fail(where, "a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}", model_input)
    parts: list[np.ndarray] = []
    count = 0
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            if kind is None:
                _fail(f"{where}.chunks[{j}]", "a chunk object", chunk)
            raise ConfigError(f"{where}: model input chunks of type {kind!r} are not supported (text tokens only)")
        tokens = chunk.get("tokens")
        count += len(tokens) if isinstance(tokens, list) else 0
        if count > MAX_DATUM_TOKENS:
            raise ConfigError(f"{where} must hold at most {MAX_DATUM_TOKENS} tokens")
        # Range checked against the vocabulary after (checks.check_datum); here only int32, as in protobuf.
        ids = _ints(tokens, f"{where}.chunks[{j}].tokens", *_INT32, "a token id (a whole number)")
        parts.append(ids.astype(np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _datum(d: Any, i: int) -> dict[str, Any]:
    where = f"data[{i}]"
    if not isinstance(d, dict):
        _fail(where, "a Datum object: {'model_input': ..., 'loss_fn_inputs': {...}}", d)
    inputs = d.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict) or len(inputs) > 64:
        _fail(f"{where}.loss_fn_inputs", "an object of at most 64 named tensors", inputs)
    return {
        "tokens": _tokens(d.get("model_input"), f"{where}.model_input"),
        "loss_fn_inputs": {str(k): _tensor(v, f"{where}.loss_fn_inputs.{k}") for k, v in inputs.items()},
    }


def decode_forward_backward_json(body: dict[str, Any], *, forward_only: bool) -> dict[str, Any]:
    """A JSON ``ForwardBackwardRequest`` (``forward_only``: a ``ForwardRequest``, from ``/forward``)
    as ``_proto.decode_forward_backward`` answers a protobuf one."""
    input_field = "forward_input" if forward_only else "forward_backward_input"
    check_body(body, _spec(input_field))
    fb = body[input_field]
    data = fb.get("data")
    if not isinstance(data, list) or not 0 < len(data) <= MAX_DATA:
        count = len(data) if isinstance(data, list) else data
        raise ConfigError(f"{input_field}.data must be a list of 1..{MAX_DATA} datums, got {count!r}")
    config = fb.get("loss_fn_config")
    if config is not None and (not isinstance(config, dict) or len(config) > 64):
        _fail(f"{input_field}.loss_fn_config", "an object of at most 64 named numbers", config)
    if "loss_fn_config_v2" in fb:
        raise NotBuiltError("loss_fn_config_v2 in a JSON body is not built (the SDK sends it as protobuf)")
    return {
        "model_id": body["model_id"],
        "seq_id": int(body.get("seq_id") or 0),
        "loss_fn": fb["loss_fn"],
        "loss_fn_config": dict(config or {}),
        "forward_only": forward_only,
        "data": [_datum(d, i) for i, d in enumerate(data)],
    }


def fb_request(backend: TinkerBackend, t: Tenant, body: bytes | dict[str, Any], forward: bool) -> dict[str, Any]:
    """A forward_backward's body (protobuf bytes, or parsed JSON: ``fb_json``; ``forward``: the
    ``/forward`` route's), decoded and checked at the door: its loss and loss config, and each datum
    against the run's base model (errors name ``data[i]...``); then ``datums``, the data as
    polytinker's datums."""
    if isinstance(body, bytes):
        req = _proto.decode_forward_backward(body)
        req["forward_only"] = req["forward_only"] or forward
    else:
        req = decode_forward_backward_json(body, forward_only=forward)
    req["loss_fn_config"] = checks.check_loss(req["loss_fn"], req["loss_fn_config"])
    vocab = checks.vocab_size(backend.model(t, req["model_id"]).base_model)
    rl_loss = None if req["loss_fn"] == "cross_entropy" else req["loss_fn"]  # a forward computes it too
    for i, d in enumerate(req["data"]):
        checks.check_datum(d, i, vocab, rl_loss)
    req["datums"] = [tinker_datum(d) for d in req["data"]]
    return req


__all__ = ["decode_forward_backward_json", "fb_request"]
