"""The protobuf messages of the Tinker HTTP API that the SDK sends or expects as protobuf.

The SDK posts ``forward_backward`` (and ``forward``) as ``application/x-protobuf`` and asks for
``SampleResponse`` and ``ForwardBackwardOutput`` results in that format; every other body is
JSON. The schema below is the wire contract (message and field numbers), declared here and built
into message classes with protobuf's public descriptor API, so polytinker neither runs ``protoc``
nor imports the SDK's generated module.

Bounds: the caller limits the body's size before decoding (``GatewayConfig.max_body_bytes``);
protobuf's parser limits nesting depth itself, and nothing in this schema recurses.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from polytinker.errors import ConfigError
from polytinker.scheduler.service.messages import MAX_DATA

_PACKAGE = "polytinker.tinker_wire"
_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}

# name -> [(field number, field name, type, repeated, oneof)]; a type not in _TYPES is a message
# or enum of this schema. "map:K:V" fields are map entries (repeated nested KEntry messages).
_SCHEMA: dict[str, list[tuple[int, str, str, bool, str]]] = {
    "SparseCsr": [
        (1, "values", "bytes", False, ""),
        (2, "crow_indices", "bytes", False, ""),
        (3, "col_indices", "bytes", False, ""),
    ],
    "Tensor": [
        (1, "dense", "bytes", False, "encoding"),
        (2, "sparse_csr", "SparseCsr", False, "encoding"),
        (3, "dtype", "enum:DType", False, ""),
        (4, "shape", "int64", True, ""),
    ],
    "BatchedTensor": [
        (1, "data", "bytes", False, ""),
        (2, "offsets", "bytes", False, ""),
        (3, "dtype", "enum:DType", False, ""),
        (4, "trailing_shape", "int64", True, ""),
    ],
    "ArrayRecord": [
        (1, "type_tag", "string", False, ""),
        (2, "fields", "map:string:BatchedTensor", True, ""),
        (3, "num_datums", "int64", False, ""),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", "string", False, ""),
        (2, "loss_fn_outputs", "ArrayRecord", True, ""),
        (3, "metrics", "map:string:double", True, ""),
    ],
    "LossConfigValue": [(1, "number", "double", False, "value"), (2, "text", "string", False, "value")],
    "ForwardBackwardRequest": [
        (1, "model_id", "string", False, ""),
        (2, "seq_id", "int32", False, ""),
        (3, "data", "Datum", True, ""),
        (4, "loss_fn", "string", False, ""),
        (5, "loss_fn_config", "map:string:double", True, ""),
        (6, "forward_only", "bool", False, ""),
        (7, "loss_fn_config_v2", "map:string:LossConfigValue", True, ""),
    ],
    "Datum": [(1, "model_input", "Chunk", True, ""), (2, "loss_fn_inputs", "map:string:Tensor", True, "")],
    "Chunk": [
        (1, "encoded_text", "EncodedTextChunk", False, "chunk"),
        (2, "image", "ImageChunk", False, "chunk"),
        (3, "dmel", "DmelChunk", False, "chunk"),
    ],
    "EncodedTextChunk": [(1, "tokens", "bytes", False, "")],
    "ImageChunk": [(1, "data", "bytes", False, ""), (2, "format", "string", False, "")],
    "DmelChunk": [(1, "dmel", "bytes", False, "")],
    "TopkLogprobs": [
        (1, "token_ids", "bytes", False, ""),
        (2, "logprobs", "bytes", False, ""),
        (3, "k", "uint32", False, ""),
        (4, "length", "uint32", False, ""),
    ],
    "SampledSequence": [
        (1, "stop_reason", "enum:StopReason", False, ""),
        (2, "tokens", "bytes", False, ""),
        (3, "logprobs", "bytes", False, "_logprobs"),
    ],
    "SampleResponse": [
        (1, "sequences", "SampledSequence", True, ""),
        (2, "prompt_logprobs", "bytes", False, ""),
        (3, "topk_prompt_logprobs", "TopkLogprobs", False, "_topk_prompt_logprobs"),
        (4, "prompt_cache_hit_tokens", "int32", False, ""),
    ],
}
_ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
MASK_LOGPROB = -99999.0  # the SDK reads a top-k row of token 0 at this logprob as "none here"
STOP_REASONS = {"stop": 0, "length": 1}


def _field(msg: Any, number: int, name: str, kind: str, repeated: bool, oneof_index: int | None) -> None:
    f = msg.field.add(name=name, number=number, label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if kind in _TYPES:
        f.type = _TYPES[kind]
    elif kind.startswith("enum:"):
        f.type, f.type_name = _F.TYPE_ENUM, f".{_PACKAGE}.{kind[5:]}"
    else:
        f.type, f.type_name = _F.TYPE_MESSAGE, kind if kind.startswith(".") else f".{_PACKAGE}.{kind}"
    if oneof_index is not None:
        f.oneof_index = oneof_index
        # proto3 `optional` fields are one-field oneofs named "_<field>"
        f.proto3_optional = msg.oneof_decl[oneof_index].name.startswith("_")


def _build() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(name="polytinker_tinker_wire.proto", package=_PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        e = file.enum_type.add(name=name)
        for i, v in enumerate(values):
            e.value.add(name=v, number=i)
    for name, fields in _SCHEMA.items():
        msg = file.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for number, fname, kind, repeated, oneof in fields:
            if kind.startswith("map:"):
                _, key, value = kind.split(":")
                entry = msg.nested_type.add(name=f"{fname.title().replace('_', '')}Entry")
                entry.options.map_entry = True
                _field(entry, 1, "key", key, False, None)
                _field(entry, 2, "value", value, False, None)
                kind = f".{_PACKAGE}.{name}.{entry.name}"
            idx = None
            if oneof:
                if oneof not in oneofs:
                    oneofs[oneof] = len(msg.oneof_decl)
                    msg.oneof_decl.add(name=oneof)
                idx = oneofs[oneof]
            _field(msg, number, fname, kind, repeated, idx)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}")) for n in _SCHEMA}


_CLASSES = _build()

_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
MAX_DATUM_TOKENS = 1 << 20  # one datum's sequence, well past any served model's context
MAX_DIMS = 8
MAX_ID_CHARS = 256


def _tensor(t: Any, where: str) -> np.ndarray:
    """A dense 1-D or N-D array from a ``Tensor``; sparse tensors are refused (no loss here reads one)."""
    if t.WhichOneof("encoding") != "dense":
        raise ConfigError(f"{where} must be dense (sparse CSR inputs are not supported)")
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise ConfigError(f"{where}: unsupported tensor dtype {t.dtype} (float32, int64 or int32)")
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise ConfigError(f"{where}: the tensor's bytes are not a whole number of its elements")
    arr = np.frombuffer(t.dense, dtype=dtype)
    shape = [int(s) for s in t.shape]
    if len(shape) > MAX_DIMS or any(s < 0 for s in shape) or (shape and math.prod(shape) != arr.size):
        raise ConfigError(f"{where}: the tensor's shape {shape[: MAX_DIMS + 1]} does not hold its {arr.size} elements")
    return arr.reshape(shape) if shape else arr


def _tokens(datum: Any, where: str) -> np.ndarray:
    """A datum's token ids, counted before any is read."""
    parts = []
    count = 0
    for chunk in datum.model_input:
        which = chunk.WhichOneof("chunk")
        if which != "encoded_text":
            raise ConfigError(f"{where}: model input chunks of type {which!r} are not supported (text tokens only)")
        raw = chunk.encoded_text.tokens
        count += len(raw) // 4
        if len(raw) % 4:
            raise ConfigError(f"{where}: encoded text tokens must be int32")
        if count > MAX_DATUM_TOKENS:
            raise ConfigError(f"{where} must hold at most {MAX_DATUM_TOKENS} tokens")
        parts.append(np.frombuffer(raw, dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """The SDK's protobuf ``ForwardBackwardRequest`` as plain values: ``model_id``, ``seq_id``,
    ``loss_fn``, ``loss_fn_config`` (name -> float or text), ``forward_only`` and ``data``, a list of
    ``{"tokens": int32 array, "loss_fn_inputs": {name: array}}``. Counts are checked before
    anything is built; ``ConfigError`` names what is malformed (``data[2].model_input``)."""
    msg = _CLASSES["ForwardBackwardRequest"]()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError (and its depth limit)
        raise ConfigError(f"the forward_backward body is not a valid protobuf message: {exc}") from None
    if not 0 < len(msg.data) <= MAX_DATA:
        raise ConfigError(f"data must hold 1..{MAX_DATA} datums, got {len(msg.data)}")
    if len(msg.model_id) > MAX_ID_CHARS or len(msg.loss_fn) > MAX_ID_CHARS:
        raise ConfigError(f"model_id and loss_fn must be at most {MAX_ID_CHARS} characters")
    data = []
    for i, datum in enumerate(msg.data):
        inputs = {k: _tensor(v, f"data[{i}].loss_fn_inputs.{k}") for k, v in datum.loss_fn_inputs.items()}
        data.append({"tokens": _tokens(datum, f"data[{i}].model_input"), "loss_fn_inputs": inputs})
    config: dict[str, Any] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return {
        "model_id": msg.model_id,
        "seq_id": int(msg.seq_id),
        "loss_fn": msg.loss_fn,
        "loss_fn_config": config,
        "forward_only": bool(msg.forward_only),
        "data": data,
    }


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float], output_type: str = "ArrayRecord"
) -> bytes:
    """``ForwardBackwardOutput``: one batched record holding each datum's 1-D float32 outputs."""
    msg = _CLASSES["ForwardBackwardOutput"](loss_fn_output_type=output_type)
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add(type_tag=output_type, num_datums=len(outputs))
    names = sorted({name for out in outputs for name in out})
    for name in names:
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32).reshape(-1) for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = DTYPE_FLOAT32
    return bytes(msg.SerializeToString())


def encode_sample_response(
    sequences: list[dict[str, Any]],
    prompt_logprobs: list[float | None] | None = None,
    topk_prompt: list[list[tuple[int, float]] | None] | None = None,
) -> bytes:
    """``SampleResponse``: each sequence's ``tokens``, ``logprobs`` (or None) and ``stop_reason``;
    ``prompt_logprobs`` (None for the first position) and the top-k prompt logprobs when asked."""
    msg = _CLASSES["SampleResponse"]()
    for s in sequences:
        seq = msg.sequences.add(stop_reason=STOP_REASONS.get(str(s.get("stop_reason")), 0))
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        if s.get("logprobs") is not None:
            seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        lp = np.asarray([np.nan if x is None else x for x in prompt_logprobs], dtype=np.float32)
        msg.prompt_logprobs = lp.tobytes()
    if topk_prompt is not None:
        k = max((len(row) for row in topk_prompt if row), default=0)
        ids = np.zeros((len(topk_prompt), k), dtype=np.int32)
        # Tinker's sentinel (token 0, logprob -99999) fills a position with no row (the first one).
        lps = np.full((len(topk_prompt), k), MASK_LOGPROB, dtype=np.float32)
        for i, row in enumerate(topk_prompt):
            for j, (tok, lp_) in enumerate(row or ()):
                ids[i, j], lps[i, j] = tok, lp_
        msg.topk_prompt_logprobs.token_ids = ids.tobytes()
        msg.topk_prompt_logprobs.logprobs = lps.tobytes()
        msg.topk_prompt_logprobs.k = k
        msg.topk_prompt_logprobs.length = len(topk_prompt)
    return bytes(msg.SerializeToString())


__all__ = ["decode_forward_backward", "encode_forward_backward_output", "encode_sample_response"]
