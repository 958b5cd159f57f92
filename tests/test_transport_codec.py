"""Codec: round trips of every supported type, zero-copy of large arrays, hostile input."""

from __future__ import annotations

import dataclasses
import enum
import math

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from polytinker.errors import ConfigError, ProtocolError
from polytinker.transport import TransportConfig, decode, encode, message
from polytinker.transport.codec import EXT_NDARRAY


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@message("test.codec.point")
@dataclasses.dataclass(frozen=True)
class Point:
    xs: tuple[int, ...]
    color: Color
    extra: object = None

    def __post_init__(self) -> None:
        if len(self.xs) > 100:
            raise ConfigError("too many")


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, True)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=50)
    | st.binary(max_size=50)
)
_keys = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10) | st.binary(max_size=10)
_NUMERIC = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
_NUMERIC += ["float16", "float32", "float64", "complex64", "complex128"]
_arrays = st.sampled_from(_NUMERIC).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
)
_values = st.recursive(
    _scalars | _arrays,
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner) | st.dictionaries(_keys, inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_round_trip_of_plain_values_and_arrays(value):
    assert _same(value, decode(encode(value)))


_TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_TORCH_DTYPES += [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(_TORCH_DTYPES),
    shape=st.lists(st.integers(0, 70), max_size=3),
    seed=st.integers(0, 2**31),
    transpose=st.booleans(),
)
def test_round_trip_of_torch_tensors(dtype, shape, seed, transpose):
    gen = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=gen) * 100).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous: made contiguous on the wire
    out = decode(encode({"t": t}))["t"]
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_float8_and_grad_tensors_round_trip():
    f8 = torch.randn(3000).to(torch.float8_e4m3fn)
    assert torch.equal(decode(encode(f8)).view(torch.uint8), f8.view(torch.uint8))
    w = torch.randn(4, 4, requires_grad=True)
    assert torch.equal(decode(encode(w)), w.detach())


@settings(max_examples=100, deadline=None)
@given(xs=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20), color=st.sampled_from(Color), extra=_values)
def test_round_trip_of_registered_messages(xs, color, extra):
    p = Point(tuple(xs), color, {"inner": Point((1,), Color.RED, extra)})
    out = decode(encode([p]))[0]
    assert type(out) is Point and out.xs == p.xs and out.color is color
    assert _same(extra, out.extra["inner"].extra)


def test_tuples_arrive_as_lists_and_numpy_scalars_as_python():
    assert decode(encode((1, (2, 3)))) == [1, [2, 3]]
    assert decode(encode([np.int64(3), np.float32(1.5), np.bool_(True)])) == [3, 1.5, True]


def test_big_endian_arrays_arrive_little_endian():
    a = np.arange(10, dtype=">i4")
    out = decode(encode(a))
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, a)


def test_large_tensor_is_not_copied_on_encode_or_decode():
    t = torch.randn(16 << 20)  # 64 MiB
    frames = encode({"w": t})
    assert len(frames) == 2 and len(frames[0]) < 100
    assert np.frombuffer(frames[1], np.uint8).ctypes.data == t.data_ptr()  # the frame is the tensor's memory
    out = decode(frames)["w"]
    assert out.data_ptr() == t.data_ptr()  # decode wraps the frame, no copy
    a = np.ones((4096, 4096), np.float32)
    assert np.shares_memory(decode(encode(a)), a)


def test_large_tensor_is_not_copied_through_a_socket():
    """Sent with copy=False over inproc, the receiver's array is the sender's memory."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://test-codec-zero-copy")
        b.connect("inproc://test-codec-zero-copy")
        t = torch.randn(16 << 20)
        a.send_multipart(encode(t), copy=False)
        out = decode(b.recv_multipart(copy=False))
        assert out.data_ptr() == t.data_ptr() and torch.equal(out, t)
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_a_received_body_frame_decodes_as_it_came_and_owns_nothing_of_it():
    """A single zmq.Frame (as a socket hands it over) decodes without a memoryview around it; bytes
    in the value are copies, and a malformed or oversized frame is a ProtocolError."""
    value = {"tokens": [1, 2, 3], "blob": b"x" * 100, "text": "hi"}
    frame = zmq.Frame(encode(value)[0])
    out = decode([frame])
    assert out == value
    del frame  # the decoded value must not depend on the frame's memory
    assert out["blob"] == b"x" * 100
    with pytest.raises(ProtocolError):
        decode([zmq.Frame(b"\x92\x01")])
    with pytest.raises(ProtocolError, match="max_body_bytes"):
        decode([zmq.Frame(msgpack.packb(b"x" * 2000))], config=TransportConfig(max_body_bytes=1000))


def test_small_arrays_travel_inline():
    frames = encode({"ids": np.arange(16)}, config=TransportConfig(inline_max_bytes=1024))
    assert len(frames) == 1
    assert len(encode(np.arange(16), config=TransportConfig(inline_max_bytes=0))) == 2


@pytest.mark.parametrize("value", [object(), {1, 2}, 2**64, lambda: 0, np.array(["a"]), Point])
def test_unsupported_values_raise_protocol_error(value):
    with pytest.raises(ProtocolError):
        encode(value)


def _ext_array(dtype: str, shape: list, data: object) -> bytes:
    return msgpack.packb(msgpack.ExtType(EXT_NDARRAY, msgpack.packb([dtype, shape, data])))


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1"],  # never-used msgpack byte
        [b"\x92\x01"],  # truncated array
        [_ext_array("float32", [4], 1)],  # refers to a frame that is not there
        [_ext_array("float32", [4], 1), b"\0" * 15],  # wrong size
        [_ext_array("object", [1], b"\0" * 8)],  # a dtype that is not on the wire
        [_ext_array("float32", [-1], b"")],
        [_ext_array("float32", "x", b"")],
        [msgpack.packb(msgpack.ExtType(3, msgpack.packb(["no.such.message", {}])))],
        [msgpack.packb(msgpack.ExtType(3, msgpack.packb(["test.codec.point", {"xs": list(range(101))}])))],
        [msgpack.packb(msgpack.ExtType(3, msgpack.packb(["test.codec.point", {"nope": 1}])))],
        [msgpack.packb(msgpack.ExtType(99, b""))],
        [msgpack.packb({(1, 2): 3}, use_bin_type=True)],
    ],
)
def test_malformed_input_raises_protocol_error(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def test_size_limits_hold():
    cfg = TransportConfig(max_body_bytes=1000, max_frames=2, max_container_len=10)
    with pytest.raises(ProtocolError, match="max_body_bytes"):
        decode([msgpack.packb(b"x" * 2000)], config=cfg)
    with pytest.raises(ProtocolError, match="max_frames"):
        decode([msgpack.packb(1), b"", b"", b""], config=cfg)
    with pytest.raises(ProtocolError):
        decode([msgpack.packb(list(range(11)))], config=cfg)
    assert decode([msgpack.packb(list(range(10)))], config=cfg) == list(range(10))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cuda_tensors_arrive_on_the_cpu(dtype):
    t = (torch.randn(64, 256, device="cuda") * 10).to(dtype)
    for x in (t, t.t()):
        out = decode(encode({"x": x}))["x"]
        assert out.device.type == "cpu" and out.dtype == dtype and torch.equal(out, x.cpu())


def test_decoded_frames_are_released_without_waiting_for_the_garbage_collector() -> None:
    """A decode leaves nothing behind that holds its frames: they go as soon as the caller drops
    what was decoded (a reference cycle kept every frame until a collection: 20 MB per adapter
    version that the next allocation could not reuse)."""
    import gc
    import weakref

    array = np.arange(1 << 16, dtype=np.float32)
    frames = encode({"x": array})
    backing = np.frombuffer(bytearray(frames[1]), dtype=np.uint8)  # the received frame's memory
    alive = weakref.ref(backing)
    gc.disable()
    try:
        out = decode([frames[0], memoryview(backing)])
        assert np.array_equal(out["x"], array)
        del out, backing
        assert alive() is None
    finally:
        gc.enable()


# -- reused messages: a value sent again and again is packed and unpacked once


@message("test.codec.reused_shape", reused=True)
@dataclasses.dataclass(frozen=True)
class ReusedShape:
    names: str
    dims: tuple[int, ...]


def test_a_reused_message_decodes_once_and_a_changed_one_anew():
    value = ReusedShape("w" * 2000, tuple(range(300)))
    first, second = decode(encode([value])), decode(encode([value]))
    assert first == second == [value]
    assert first[0] is second[0]  # the same immutable instance for the same bytes
    changed = ReusedShape("w" * 2000, (*range(299), 7))
    assert decode(encode([changed])) == [changed]
    assert decode(encode([value]))[0].dims[-1] == 299


def test_a_reused_value_is_handed_out_only_under_the_limits_it_was_checked_against():
    value = ReusedShape("w" * 2000, tuple(range(300)))
    frames = encode(value)
    assert decode(frames) == value
    with pytest.raises(ProtocolError):
        decode(frames, config=TransportConfig(max_container_len=10))


def test_only_frozen_messages_without_arrays_may_be_reused():
    with pytest.raises(ConfigError, match="frozen dataclass without arrays"):
        message("test.codec.reused_mutable", reused=True)(
            dataclasses.dataclass(type("Mutable", (), {"__annotations__": {"x": int}}))
        )
    with pytest.raises(ConfigError, match="frozen dataclass without arrays"):
        message("test.codec.reused_arrays", reused=True, arrays=True)(ReusedShape)


@message("test.codec.reused_list", reused=True)
@dataclasses.dataclass(frozen=True)
class ReusedList:
    items: list[int]


def test_a_reused_message_with_an_unhashable_field_still_round_trips():
    value = ReusedList(list(range(600)))
    assert decode(encode(value)) == decode(encode(value)) == ReusedList(list(range(600)))


def test_only_reused_messages_are_looked_up_in_the_memo(monkeypatch):
    from polytinker.transport import codec

    looked_up = []
    real_get = codec._decoded_reused.get
    monkeypatch.setattr(codec._decoded_reused, "get", lambda key: looked_up.append(key) or real_get(key))
    other = Point(xs=tuple(range(50)), color=Color.RED, extra="w" * 2000)  # memo-sized, not reused
    assert decode(encode(other)) == decode(encode(other))
    assert looked_up == []
    assert decode(encode(ReusedShape("w" * 2000, (1,)))) == ReusedShape("w" * 2000, (1,))
    assert len(looked_up) == 1
