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
import itertools
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from polytinker.errors import ProtocolError
from polytinker.transport import messages
from polytinker.transport._plain_depth import check_plain_depth
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.protocol import describe

EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_MESSAGE = 3
_MAX_DIMS = 64
_EXT_COPIES = 8
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
# Reused messages (messages.register_message(reused=True)), encoded by value and decoded by their
# bytes: a value sent with every adapter version (its 420-tensor layout) is packed, unpacked and
# checked once. Bounded; smaller values encode and decode faster than they hash.
# Keyed by the decoder's TransportConfig too: a value is only handed out under the limits it was
# checked against. At most 16 values of at most 256 KiB each: what a hostile peer can pin is small.
_REUSE_MIN_BYTES = 1024
_REUSE_MAX_BYTES = 256 * 1024
_REUSE_MAX_ENTRIES = 16


class _Reused:
    """A bounded map (oldest out first) shared by every thread's encodes and decodes."""

    def __init__(self) -> None:
        self._items: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        try:
            with self._lock:
                return self._items.get(key)
        except TypeError:  # an unhashable field: such a value is not remembered
            return None

    def put(self, key: Any, value: Any) -> None:
        try:
            hash(key)
        except TypeError:
            return
        with self._lock:
            if len(self._items) >= _REUSE_MAX_ENTRIES:
                self._items.pop(next(iter(self._items)))
            self._items[key] = value


_encoded_reused = _Reused()  # value -> its ExtType
_decoded_reused = _Reused()  # (config, ext bytes) -> the value


@functools.lru_cache(maxsize=8)
def _reused_prefixes(names: tuple[str, ...]) -> tuple[bytes, ...]:
    """What a reused message's ext bytes begin with: the header of ``[name, fields]`` (a 2-array)
    and the name, each in msgpack's shortest form (as msgpack-python writes them). Only such ext
    bytes are looked up in the memo: hashing every typed message's bytes to find out cost up to
    60 us for 256 KiB, at each level of nesting."""
    return tuple(b"\x92" + msgpack.packb(name, use_bin_type=True) for name in names)


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
    cfg = config or DEFAULT_CONFIG
    enc = _Encoder(cfg.inline_max_bytes, cfg.max_depth)
    try:
        body = msgpack.packb(obj, default=enc.default, use_bin_type=True)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"cannot encode {type(obj).__name__}: {type(exc).__name__}: {exc}") from exc
    return [body, *enc.buffers]


def decode(frames: Sequence[Frame], *, config: TransportConfig | None = None, arrays: bool = True) -> Any:
    """Decode frames made by :func:`encode` (or a peer following docs/wire-protocol.md).

    ``arrays=False`` refuses numpy arrays and torch tensors (ext 1 and 2): a receiver that takes
    none never builds one, and never imports torch for a hostile peer. Nesting deeper than
    ``config.max_depth`` is refused before it is decoded further. Any malformed input raises
    ProtocolError; nothing else escapes."""
    cfg = config or DEFAULT_CONFIG
    if not frames:
        raise ProtocolError("no frames to decode")
    if len(frames) > cfg.max_frames + 1:
        raise ProtocolError(f"{len(frames) - 1} buffer frames, more than max_frames={cfg.max_frames}")
    if len(frames) == 1:
        fast = _decode_plain(_as_buffer(frames[0]), cfg)
        if fast is not _NOT_PLAIN:
            return fast
    bufs = [_as_buffer(f) for f in frames]
    if len(bufs[0]) > cfg.max_body_bytes:
        raise ProtocolError(f"msgpack body of {len(bufs[0])} bytes exceeds max_body_bytes={cfg.max_body_bytes}")
    decoder = _Decoder(bufs, cfg, arrays)
    try:
        obj = decoder.unpack(bufs[0])
        check_depth(obj, cfg.max_depth)
        return obj
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack and numpy raise many types on hostile bytes
        raise ProtocolError(f"malformed message body: {type(exc).__name__}: {describe(exc)}") from exc
    finally:
        # The decoder and its unpack partial (whose ext_hook is the decoder's) form a cycle: break
        # it, so the frames go as soon as nothing decoded from them is left, not at the next
        # garbage collection (a 20 MB frame per adapter version piled up until then).
        decoder.close()


class _HasExt(Exception):
    """Raised by the plain decoder's ext hook: the body needs the full decoder."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _HasExt


_NOT_PLAIN = object()
_PLAIN_MAX = 64 * 1024


def _decode_plain(body: bytes | bytearray | memoryview, cfg: TransportConfig) -> Any:
    """A small body without ext values, decoded without building a _Decoder (most requests and
    answers: a round trip decodes two); ``_NOT_PLAIN`` when it needs the full decoder. msgpack's
    own limits (no string, array or map longer than the body) are within the config's, since the
    body is smaller than each of them."""
    if len(body) > _PLAIN_MAX or len(body) > cfg.max_body_bytes or len(body) > cfg.max_container_len:
        return _NOT_PLAIN
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
    except _HasExt:
        return _NOT_PLAIN
    except Exception as exc:  # msgpack raises many types on hostile bytes
        raise ProtocolError(f"malformed message body: {type(exc).__name__}: {describe(exc)}") from exc
    if type(obj) is dict or type(obj) is list:
        check_plain_depth(obj, body, cfg.max_depth)
    return obj


# Containers the depth check descends into (typed messages too; tuples are what they turn lists into).
_NESTED = frozenset({list, tuple, dict})
_SEQUENCES = frozenset({list, tuple})


def check_depth(obj: Any, limit: int) -> None:
    """Raise ProtocolError when arrays, maps and typed messages nest deeper than ``limit`` in ``obj``.

    Iterative (no recursion: the point is to bound stack), and cheap on flat data: the element
    types of a container are collected at C speed and only containers among them are visited."""
    if type(obj) not in _NESTED and messages.message_name(type(obj)) is None:
        return
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ProtocolError(f"values nest deeper than max_depth={limit}")
        t = type(node)
        children: Any = node.values() if t is dict else node if t in _NESTED else messages.to_fields(node).values()
        kinds = set(map(type, children))
        if kinds.isdisjoint(_NESTED) and all(messages.message_name(k) is None for k in kinds):
            continue
        if kinds <= _SEQUENCES and depth + 1 <= limit:
            # A list of lists (token ids, shapes, logprobs): when the grandchildren hold no
            # container, the whole level is checked at C speed instead of child by child.
            below = set(map(type, itertools.chain.from_iterable(children)))
            if below.isdisjoint(_NESTED) and all(messages.message_name(k) is None for k in below):
                continue
        stack.extend(
            (c, depth + 1) for c in children if type(c) in _NESTED or messages.message_name(type(c)) is not None
        )


def _as_buffer(frame: Frame) -> bytes | bytearray | memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    raise ProtocolError(f"a frame must be bytes, memoryview or zmq.Frame, got {type(frame).__name__}")


class _Encoder:
    __slots__ = ("buffers", "depth", "inline_max", "max_depth")

    def __init__(self, inline_max: int, max_depth: int) -> None:
        self.buffers: list[memoryview] = []
        self.inline_max = inline_max
        self.depth = 0
        self.max_depth = max_depth

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
            reused = messages.is_reused(type(obj))
            known = _encoded_reused.get(obj) if reused else None
            if known is not None:
                return known
            if self.depth >= self.max_depth:  # each level is a nested packb: bound the stack it takes
                raise ProtocolError(f"typed messages nest deeper than max_depth={self.max_depth}")
            self.depth += 1
            try:
                inner = msgpack.packb([name, messages.to_fields(obj)], default=self.default, use_bin_type=True)
            finally:
                self.depth -= 1
            ext = msgpack.ExtType(EXT_MESSAGE, inner)
            if reused and _REUSE_MIN_BYTES <= len(inner) <= _REUSE_MAX_BYTES:
                _encoded_reused.put(obj, ext)
            return ext
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
    """One decode: the message's buffer frames, and how deep its typed messages nest so far."""

    __slots__ = ("arrays", "bufs", "cfg", "depth", "ext_budget", "unpack")

    def __init__(self, bufs: list[bytes | bytearray | memoryview], cfg: TransportConfig, arrays: bool) -> None:
        self.bufs = bufs
        self.arrays = arrays
        self.depth = 0
        # msgpack hands each ext value's data over as a copy, so a message nested in a message copies
        # its bytes once per level: bound the copies at _EXT_COPIES times the body (a real payload's
        # messages nest a few levels; a hostile one would otherwise cost depth x body in memory).
        self.ext_budget = _EXT_COPIES * len(bufs[0]) + 4096
        self.cfg = cfg
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

    def close(self) -> None:
        self.unpack = None  # type: ignore[assignment]
        self.bufs = []

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_MESSAGE:
            # The one place decoding recurses (a message's fields are a msgpack value of their own):
            # count the levels before going down, so a hostile body cannot exhaust the C stack.
            if self.depth >= self.cfg.max_depth:
                raise ProtocolError(f"typed messages nest deeper than max_depth={self.cfg.max_depth}")
            self.ext_budget -= len(data)
            if self.ext_budget < 0:
                raise ProtocolError(f"typed messages nest more than {_EXT_COPIES} levels deep around most of the body")
            memo = _REUSE_MIN_BYTES <= len(data) <= _REUSE_MAX_BYTES and data.startswith(
                _reused_prefixes(messages.reused_names())
            )
            known = _decoded_reused.get((self.cfg, data)) if memo else None
            if known is not None:
                return known
            self.depth += 1
            try:
                parts = self.unpack(data)
            finally:
                self.depth -= 1
            if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], str)):
                raise ProtocolError("message ext must hold [name, fields]")
            obj = messages.from_fields(parts[0], parts[1])
            if memo and messages.is_reused(type(obj)):
                _decoded_reused.put((self.cfg, data), obj)
            return obj
        if code in (EXT_NDARRAY, EXT_TENSOR) and not self.arrays:
            raise ProtocolError("this message may not carry arrays or tensors (ext types 1 and 2)")
        if code == EXT_NDARRAY:
            name, shape, buf = self._array_parts(data)
            dt = _NP_DTYPES.get(name)
            if dt is None:
                raise ProtocolError(f"unknown array dtype {name!r}")
            return self._checked(np.frombuffer, buf, dt, shape)
        if code == EXT_TENSOR:
            return self._tensor(data)
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

    def _checked(self, make: Any, buf: Any, dtype: Any, shape: list[int], itemsize: int | None = None) -> Any:
        count = extent = 1
        for d in shape:
            count *= d
            extent *= max(d, 1)
        size = itemsize if itemsize is not None else dtype.itemsize
        if extent * size > self.cfg.max_message_bytes:
            # An empty array of huge dimensions holds no bytes, but its strides overflow.
            raise ProtocolError(f"array of shape {shape} spans more than max_message_bytes")
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


__all__ = ["EXT_MESSAGE", "EXT_NDARRAY", "EXT_TENSOR", "check_depth", "decode", "encode"]
