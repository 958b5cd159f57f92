"""The RPC envelope: version, message type, request id, kind (docs/wire-protocol.md).

A message from a client (DEALER) is ``[header, body, *buffers]``; the server's ROUTER adds the
peer identity in front. ``header`` is a msgpack array ``[version, type, request_id, kind]``;
``body, *buffers`` are what :func:`polytinker.transport.codec.encode` makes of the payload.
PING, PONG and CANCEL carry the header only.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import traceback
from enum import IntEnum, StrEnum
from typing import Any

import msgpack
import zmq

from polytinker.errors import ProtocolError, RemoteError

PROTOCOL_VERSION = 1
MAX_KIND_LEN = 256
_MAX_ID = (1 << 64) - 1


class MsgType(IntEnum):
    REQUEST = 1  # client -> server: run handler `kind`, answer with REPLY or ERROR
    REPLY = 2  # server -> client: the handler's return value
    ERROR = 3  # server -> client: the request failed; body is an error map
    TELL = 4  # client -> server: run handler `kind`, no answer (not even on error)
    PING = 5  # client -> server: heartbeat
    PONG = 6  # server -> client: heartbeat answer
    CANCEL = 7  # client -> server: the client gave up on request_id; nothing more is answered for it


class ErrorCode(StrEnum):
    HANDLER = "handler"  # the handler raised; `type` and `traceback` say what
    MALFORMED = "malformed"  # the header or body could not be decoded
    UNKNOWN_KIND = "unknown_kind"  # no handler for `kind`
    BAD_PAYLOAD = "bad_payload"  # the payload is not the message type registered for `kind`
    TOO_LARGE = "too_large"  # over max_body_bytes / max_frames / max_message_bytes
    VERSION = "version"  # protocol version not spoken by this server
    UNENCODABLE = "unencodable"  # the handler's return value cannot go on the wire


_VALID_TYPES = frozenset(int(t) for t in MsgType)


_PACK_U8 = struct.Struct(">BB").pack
_PACK_U16 = struct.Struct(">BH").pack
_PACK_U32 = struct.Struct(">BI").pack
_PACK_U64 = struct.Struct(">BQ").pack
_HEADER_START = {int(t): bytes((0x94, PROTOCOL_VERSION, int(t))) for t in MsgType}  # fixarray of 4, version, type
_packed_kinds: dict[str, bytes] = {}


def pack_header(mtype: MsgType | int, request_id: int, kind: str) -> bytes:
    """``msgpack.packb([PROTOCOL_VERSION, mtype, request_id, kind])``, byte for byte, built from
    cached pieces (this runs twice on every round trip)."""
    packed_kind = _packed_kinds.get(kind)
    if packed_kind is None:
        packed_kind = msgpack.packb(kind)
        if len(_packed_kinds) < 4096:
            _packed_kinds[kind] = packed_kind
    if request_id < 0x80:
        rid = _FIXINTS[request_id]
    elif request_id < 0x100:
        rid = _PACK_U8(0xCC, request_id)
    elif request_id < 0x10000:
        rid = _PACK_U16(0xCD, request_id)
    elif request_id < 0x100000000:
        rid = _PACK_U32(0xCE, request_id)
    else:
        rid = _PACK_U64(0xCF, request_id)
    return _HEADER_START[mtype] + rid + packed_kind


_FIXINTS = [bytes((i,)) for i in range(0x80)]


PING_HEADER = pack_header(MsgType.PING, 0, "")
PONG_HEADER = pack_header(MsgType.PONG, 0, "")


_SNDMORE = int(zmq.SNDMORE)
# The compiled send under pyzmq's Python-level Socket.send (which only adds routing_id/group for
# draft sockets): one interpreted frame less per frame sent.
_send: Any = zmq.backend.Socket.send
# pyzmq copies a frame under this size even when asked not to: such bytes are sent copying, directly.
COPY_BELOW = zmq.COPY_THRESHOLD


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int) -> None:
    """``send_multipart(frames, flags, copy=False)`` without its per-call checks (a few us each
    way, which is most of a round trip here). Small ``bytes`` frames (identity, header, msgpack
    body) go by pyzmq's copying send, which skips the memoryview and tracker that a zero-copy send
    of a buffer under ``zmq.COPY_THRESHOLD`` makes before copying it anyway; the rest go zero-copy."""
    last = len(frames) - 1
    more = flags | _SNDMORE
    for i, frame in enumerate(frames):
        _send(sock, frame, more if i < last else flags, type(frame) is bytes and len(frame) < COPY_BELOW)


def recv_frames(sock: zmq.Socket, flags: int) -> list[zmq.Frame]:
    """``recv_multipart(flags, copy=False)``, lean likewise; raises zmq.Again when nothing waits."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


class HeaderError(ProtocolError):
    """A header that cannot be served; ``code`` goes into the error reply."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED) -> None:
        super().__init__(message)
        self.code = code


def parse_header(buf: Any) -> tuple[int, int, str]:
    """``(type, request_id, kind)`` of a header frame; raises HeaderError when it is not one."""
    try:
        h = msgpack.unpackb(buf, max_str_len=MAX_KIND_LEN, max_array_len=8, max_bin_len=0, max_map_len=0)
    except Exception as exc:
        raise HeaderError(f"header is not msgpack: {type(exc).__name__}: {exc}") from exc
    if type(h) is not list or len(h) != 4:
        raise HeaderError("header must be a msgpack array [version, type, request_id, kind]")
    version, mtype, rid, kind = h
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise HeaderError(f"protocol version {version!r} is not spoken here (this side speaks {PROTOCOL_VERSION})",
                          ErrorCode.VERSION)  # fmt: skip
    if type(mtype) is not int or mtype not in _VALID_TYPES:
        raise HeaderError(f"unknown message type {mtype!r}")
    if type(rid) is not int or not 0 <= rid <= _MAX_ID:
        raise HeaderError(f"request id must be an unsigned 64-bit integer, got {rid!r}")
    if type(kind) is not str:
        raise HeaderError(f"kind must be a string, got {type(kind).__name__}")
    return mtype, rid, kind


def error_body(code: ErrorCode, exc: BaseException | None = None, message: str = "") -> bytes:
    """The msgpack body of an ERROR reply."""
    return msgpack.packb(
        {
            "code": str(code),
            "type": type(exc).__name__ if exc is not None else "",
            "message": message or (str(exc) if exc is not None else ""),
            "traceback": "".join(traceback.format_exception(exc)) if exc is not None else "",
        }
    )


def error_from_body(body: Any, kind: str) -> Exception:
    """The exception a client raises for an ERROR reply's decoded body."""
    if not isinstance(body, dict):
        return ProtocolError(f"{kind!r}: malformed error reply")
    code = str(body.get("code", ""))
    message = str(body.get("message", ""))
    if code == ErrorCode.HANDLER:
        return RemoteError(
            message, remote_type=str(body.get("type", "")), remote_traceback=str(body.get("traceback", ""))
        )
    return ProtocolError(f"the server rejected {kind!r} ({code}): {message}")


class RateLimitedLog:
    """Logs the first bad message at WARNING, then at most one summary per ``period_s``; every
    one at DEBUG. A flood of garbage must not become a flood of log lines."""

    def __init__(self, log: logging.Logger, period_s: float = 5.0) -> None:
        self._log = log
        self._period_s = period_s
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args: Any) -> None:
        self._log.debug(msg, *args)
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._next = self._suppressed, 0, now + self._period_s
        extra = f" ({suppressed} more since the last report)" if suppressed else ""
        self._log.warning(msg + extra, *args)


__all__ = [
    "COPY_BELOW",
    "PING_HEADER",
    "PONG_HEADER",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "HeaderError",
    "MsgType",
    "RateLimitedLog",
    "error_body",
    "error_from_body",
    "pack_header",
    "parse_header",
    "recv_frames",
    "send_frames",
]
