"""msgpack codec with out-of-band arrays: ``encode(obj) -> frames`` and ``decode(frames) -> obj``.

Frame 0 is the msgpack body. Arrays and tensors larger than ``TransportConfig.inline_max_bytes``
travel as their own raw frames (frames 1, 2, ...), referenced from the body by an ext value; the
frame is the array's memory itself (no copy on send with ``copy=False``), and decode wraps the
received buffer with ``np.frombuffer`` / ``torch.frombuffer`` (no copy on receive).

Types: None, bool, int (-2**63 .. 2**64-1), float, str, bytes, list, tuple (arrives as a list),
dict (keys: str, int, float, bool, None, bytes), numpy arrays and scalars of every numeric dtype,
torch tensors (CPU; others are moved to the CPU; non-contiguous ones made contiguous; bfloat16 and
float8 included), ``Enum`` members (their value) and dataclasses registered with ``@message``.
Nothing is ever unpickled: anything else raises ProtocolError on encode.

Ext types (see docs/wire-protocol.md): 1 numpy array, 2 torch tensor, 3 registered message.
Decoded arrays and tensors share the frame's memory: numpy ones are read-only; torch cannot mark
a tensor read-only, so treat received tensors as read-only too (``.clone()`` before writing).
"""

from __future__ import annotations

import enum
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from polytinker.errors import ProtocolError
from polytinker.transport import messages
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig

EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_MESSAGE = 3
_MAX_DIMS = 64
_MAX_DIM = 1 << 62

# Wire dtype names (shared by numpy and torch) -> numpy dtype, all little-endian.
_NP_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_NP_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _NP_DTYPES.items()}
# bool's byte order is "|": make native-order lookups work too.
_NP_NAMES.update({np.dtype(name): name for name in _NP_DTYPES})

Frame = bytes | bytearray | memoryview | zmq.Frame

# torch.frombuffer warns when the buffer is read-only (received frames are); the caller is told
# in the module docstring instead. torch reports it with a file name, not a module, so the filter
# matches on torch's exact message.
warnings.filterwarnings("ignore", message="The given buffer is not writable, and PyTorch", category=UserWarning)


# Values msgpack packs by itself (no ext types, no buffers): encoded without an _Encoder.
_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
_SMALL = 4096  # bytes and str up to this long go through the thread's own Packer (its buffer stays small)
_local = threading.local()


def encode(obj: Any, *, config: TransportConfig | None = None) -> list[bytes | memoryview]:
    """Encode ``obj``: ``[msgpack body, *raw buffers]``. The buffers alias the arrays' memory,
    so do not modify an array until the frames are sent."""
    t = type(obj)
    if t in _PLAIN:
        try:
            if (t is not bytes and t is not str) or len(obj) <= _SMALL:
                # msgpack.packb makes a Packer (and its buffer) per call; a thread's own is reused.
                try:
                    packer = _local.packer
                except AttributeError:
                    packer = _local.packer = msgpack.Packer(use_bin_type=True, buf_size=4 * _SMALL)
                return [packer.pack(obj)]
            return [msgpack.packb(obj, use_bin_type=True)]
        except Exception as exc:  # an int out of 64-bit range
            raise ProtocolError(f"cannot encode {t.__name__}: {type(exc).__name__}: {exc}") from exc
    enc = _Encoder((config or DEFAULT_CONFIG).inline_max_bytes)
    try:
        body = msgpack.packb(obj, default=enc.default, use_bin_type=True)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"cannot encode {type(obj).__name__}: {type(exc).__name__}: {exc}") from exc
    return [body, *enc.buffers]


def decode(frames: Sequence[Frame], *, config: TransportConfig | None = None) -> Any:
    """Decode frames made by :func:`encode` (or a peer following docs/wire-protocol.md).

    Any malformed input raises ProtocolError; nothing else escapes."""
    cfg = config or DEFAULT_CONFIG
    if len(frames) == 1:  # the common case, on every round trip: no buffer frames
        frame = frames[0]
        # msgpack reads a zmq.Frame through the buffer protocol: no memoryview to make (.buffer)
        return body_decoder(cfg)(frame if type(frame) is zmq.Frame else _as_buffer(frame))
    if not frames:
        raise ProtocolError("no frames to decode")
    if len(frames) > cfg.max_frames + 1:
        raise ProtocolError(f"{len(frames) - 1} buffer frames, more than max_frames={cfg.max_frames}")
    bufs = [_as_buffer(f) for f in frames]
    if len(bufs[0]) > cfg.max_body_bytes:
        raise ProtocolError(f"msgpack body of {len(bufs[0])} bytes exceeds max_body_bytes={cfg.max_body_bytes}")
    try:
        if len(bufs) == 1:
            return _single(cfg).unpack(bufs[0])
        return _Decoder(bufs, cfg).unpack(bufs[0])
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack and numpy raise many types on hostile bytes
        raise ProtocolError(f"malformed message body: {type(exc).__name__}: {exc}") from exc


def body_decoder(config: TransportConfig | None = None) -> Callable[[Any], Any]:
    """``decode`` of a message without buffer frames, as a function of the body (bytes, memoryview
    or zmq.Frame): made once per config, it is what a round trip calls, with the least around it."""
    cfg = config or DEFAULT_CONFIG
    entry = _BODY.get(id(cfg))
    if entry is not None and entry[0] is cfg:
        return entry[1]
    limit = min(cfg.max_container_len, cfg.max_body_bytes)
    hook = _single(cfg).ext_hook
    unpackb = msgpack.unpackb

    def decode_body(buf: Any) -> Any:
        try:
            if len(buf) <= limit:  # msgpack bounds every str, bin, ext, array and map by len(buf) itself
                return unpackb(buf, raw=False, strict_map_key=False, ext_hook=hook)
            if len(buf) > cfg.max_body_bytes:
                raise ProtocolError(f"msgpack body of {len(buf)} bytes exceeds max_body_bytes={cfg.max_body_bytes}")
            return _single(cfg).unpack(buf)
        except ProtocolError:
            raise
        except Exception as exc:  # msgpack and numpy raise many types on hostile bytes
            raise ProtocolError(f"malformed message body: {type(exc).__name__}: {exc}") from exc

    if len(_BODY) >= 64:
        _BODY.clear()
    _BODY[id(cfg)] = (cfg, decode_body)
    return decode_body


_BODY: dict[int, tuple[TransportConfig, Callable[[Any], Any]]] = {}

# Decoders of single-frame bodies, by id of their config (a decoder holds no per-message state: an
# array ext that names a buffer frame finds none and is malformed, as it must be).
_SINGLE: dict[int, tuple[TransportConfig, _Decoder]] = {}


def _single(cfg: TransportConfig) -> _Decoder:
    """The decoder of bodies without buffer frames, made once per config."""
    entry = _SINGLE.get(id(cfg))
    if entry is None or entry[0] is not cfg:
        if len(_SINGLE) >= 64:
            _SINGLE.clear()
        entry = _SINGLE[id(cfg)] = (cfg, _Decoder([b""], cfg))
    return entry[1]


def _as_buffer(frame: Frame) -> bytes | bytearray | memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    raise ProtocolError(f"a frame must be bytes, memoryview or zmq.Frame, got {type(frame).__name__}")


class _Encoder:
    __slots__ = ("buffers", "inline_max")

    def __init__(self, inline_max: int) -> None:
        self.buffers: list[memoryview] = []
        self.inline_max = inline_max

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return msgpack.ExtType(EXT_NDARRAY, self._array(obj, None))
        torch = sys.modules.get("torch")  # never import torch just to find out obj is not a tensor
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(obj, torch)
        if isinstance(obj, np.generic):
            return obj.item()
        name = messages.message_name(type(obj))
        if name is not None:
            inner = msgpack.packb([name, messages.to_fields(obj)], default=self.default, use_bin_type=True)
            return msgpack.ExtType(EXT_MESSAGE, inner)
        if isinstance(obj, enum.Enum):
            return obj.value
        raise ProtocolError(
            f"cannot encode a {type(obj).__qualname__}: the codec carries None, bool, int, float, str, bytes, "
            "list, tuple, dict, numpy arrays, torch tensors and @message dataclasses (never pickles)"
        )

    def _array(self, arr: np.ndarray, wire_name: str | None) -> bytes:
        if wire_name is None:
            wire_name = _NP_NAMES.get(arr.dtype)
            if wire_name is None:
                if arr.dtype.byteorder == ">" and arr.dtype.newbyteorder("<") in _NP_NAMES:
                    arr = arr.astype(arr.dtype.newbyteorder("<"))
                    wire_name = _NP_NAMES[arr.dtype]
                else:
                    raise ProtocolError(f"numpy dtype {arr.dtype} is not supported on the wire (numeric only)")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        data: int | bytes
        if arr.nbytes <= self.inline_max:
            data = arr.tobytes()
        else:
            self.buffers.append(arr.reshape(-1).view(np.uint8).data)
            data = len(self.buffers)
        return msgpack.packb([wire_name, list(arr.shape), data], use_bin_type=True)

    def _tensor(self, t: Any, torch: Any) -> msgpack.ExtType:
        wire_name, carrier = _torch_tables(torch)[0].get(t.dtype, (None, None))
        if wire_name is None or t.layout != torch.strided:
            raise ProtocolError(f"torch tensor of dtype {t.dtype} / layout {t.layout} is not supported on the wire")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        if carrier is not None:  # numpy has no such dtype: ship the same bytes as an int type
            t = t.view(carrier)
        return msgpack.ExtType(EXT_TENSOR, self._array(t.numpy(), wire_name))


class _Decoder:
    __slots__ = ("bufs", "unpack")

    def __init__(self, bufs: list[bytes | bytearray | memoryview], cfg: TransportConfig) -> None:
        self.bufs = bufs
        n = cfg.max_body_bytes
        self.unpack = functools.partial(
            msgpack.unpackb,
            raw=False,
            strict_map_key=False,
            ext_hook=self.ext_hook,
            max_str_len=n,
            max_bin_len=n,
            max_ext_len=n,
            max_array_len=cfg.max_container_len,
            max_map_len=cfg.max_container_len,
        )

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_NDARRAY:
            name, shape, buf = self._array_parts(data)
            dt = _NP_DTYPES.get(name)
            if dt is None:
                raise ProtocolError(f"unknown array dtype {name!r}")
            return self._checked(np.frombuffer, buf, dt, shape)
        if code == EXT_TENSOR:
            return self._tensor(data)
        if code == EXT_MESSAGE:
            parts = self.unpack(data)
            if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], str)):
                raise ProtocolError("message ext must hold [name, fields]")
            return messages.from_fields(parts[0], parts[1])
        raise ProtocolError(f"unknown msgpack ext type {code}")

    def _array_parts(self, data: bytes) -> tuple[str, list[int], Any]:
        parts = msgpack.unpackb(data, raw=False, max_array_len=_MAX_DIMS + 3)
        if not (isinstance(parts, list) and len(parts) == 3):
            raise ProtocolError("array ext must hold [dtype, shape, data]")
        name, shape, ref = parts
        if not (isinstance(name, str) and isinstance(shape, list) and len(shape) <= _MAX_DIMS):
            raise ProtocolError("array ext: dtype must be a string and shape a list of at most 64 sizes")
        if not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
            raise ProtocolError(f"array ext: bad shape {shape!r}")
        if type(ref) is int:
            if not 1 <= ref < len(self.bufs):
                raise ProtocolError(f"array ext refers to frame {ref}, but the message has {len(self.bufs)} frames")
            return name, shape, self.bufs[ref]
        if isinstance(ref, bytes):
            return name, shape, ref
        raise ProtocolError("array ext: data must be a frame index or inline bytes")

    @staticmethod
    def _checked(make: Any, buf: Any, dtype: Any, shape: list[int], itemsize: int | None = None) -> Any:
        count = 1
        for d in shape:
            count *= d
        size = itemsize if itemsize is not None else dtype.itemsize
        nbytes = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if count * size != nbytes:
            raise ProtocolError(f"array of shape {shape} needs {count * size} bytes, the data holds {nbytes}")
        return make(buf, dtype=dtype).reshape(shape)

    def _tensor(self, data: bytes) -> Any:
        import torch  # only a peer that sends tensors makes us pay for importing torch

        name, shape, buf = self._array_parts(data)
        dt = _torch_tables(torch)[1].get(name)
        if dt is None:
            raise ProtocolError(f"unknown tensor dtype {name!r}")
        if len(buf) == 0:
            return self._checked(lambda b, dtype: torch.empty(0, dtype=dtype), buf, dt, shape, dt.itemsize)
        return self._checked(torch.frombuffer, buf, dt, shape, dt.itemsize)


_TORCH_TABLES: tuple[dict[Any, tuple[str, Any]], dict[str, Any]] | None = None


def _torch_tables(torch: Any) -> tuple[dict[Any, tuple[str, Any]], dict[str, Any]]:
    """(torch dtype -> (wire name, carrier dtype or None), wire name -> torch dtype), built once."""
    global _TORCH_TABLES
    if _TORCH_TABLES is None:
        names = [*_NP_DTYPES, "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
        to_wire: dict[Any, tuple[str, Any]] = {}
        for name in names:
            dt = getattr(torch, name, None)
            if dt is None:
                continue
            carrier = None if name in _NP_DTYPES else (torch.int16 if dt.itemsize == 2 else torch.uint8)
            to_wire[dt] = (name, carrier)
        _TORCH_TABLES = (to_wire, {name: dt for dt, (name, _) in to_wire.items()})
    return _TORCH_TABLES


__all__ = ["EXT_MESSAGE", "EXT_NDARRAY", "EXT_TENSOR", "body_decoder", "decode", "encode"]
