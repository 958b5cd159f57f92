"""The RPC envelope: version, message type, request id, kind (docs/wire-protocol.md).

A message from a client (DEALER) is ``[header, body, *buffers]``; the server's ROUTER adds the
peer identity in front. ``header`` is a msgpack array ``[version, type, request_id, kind]``;
``body, *buffers`` are what :func:`polytinker.transport.codec.encode` makes of the payload.
PING, PONG and CANCEL carry the header only.
"""

from __future__ import annotations

import logging
import re
import secrets
import struct
import threading
import time
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
    """Why a request failed. The transport's own codes say the server refused the message itself;
    a handler's error travels as ``handler`` or, for the errors callers act on, the code its class
    declares (``PolytinkerError.code``: ``auth``, ``overloaded``, ... see polytinker.errors)."""

    HANDLER = "handler"  # the handler raised; `type`, `message` and `error_id` say what
    MALFORMED = "malformed"  # the header or body could not be decoded
    UNKNOWN_KIND = "unknown_kind"  # no handler for `kind`
    BAD_PAYLOAD = "bad_payload"  # the payload is not the message type registered for `kind`
    TOO_LARGE = "too_large"  # over max_body_bytes / max_frames / max_message_bytes
    BUSY = "busy"  # the server holds max_queued_bytes of requests already: retry later
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
_COPY_BELOW = zmq.COPY_THRESHOLD


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send one message: small ``bytes`` frames copied (cheaper in libzmq than tracking them),
    buffers zero-copy (``copy=False``: the array's memory goes out as it is)."""
    last = len(frames) - 1
    more = int(flags) | _SNDMORE
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags, copy=type(frame) is bytes and len(frame) < _COPY_BELOW)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one whole message, zero-copy (``recv_multipart(copy=False)``, without its
    ZMQ_RCVMORE query per frame: a received Frame says itself whether more follow). ``flags``
    apply to the first frame (the rest of a message arrives with it)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


class HeaderError(ProtocolError):
    """A message that cannot be served; ``error_code`` goes into the error reply."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED) -> None:
        super().__init__(message)
        self.error_code = code


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


MAX_ERROR_MESSAGE = 2000  # characters of an error's message that go on the wire


def describe(exc: BaseException) -> str:
    """``str(exc)``, bounded, and never raising: str() of a value a hostile peer built may raise
    (RecursionError, or anything its own __str__ does), and the error path must not fail again."""
    try:
        text = str(exc)
    except BaseException:
        text = f"(the {type(exc).__name__} cannot be printed)"
    return text if len(text) <= MAX_ERROR_MESSAGE else text[:MAX_ERROR_MESSAGE] + "..."


# An absolute filesystem path: a "/" that starts a word (not the "//" of a URL's scheme such as
# ``tinker://JOB/AGENT``, not inside a name like TENANT/JOB), not one of the HTTP gateway's own
# routes (``/v1/...``, ``/api/v1/...``), ending before trailing punctuation; or a file:// URL. What
# a server's error says about its own disk is for its log, not for a peer of another tenant.
_PATH_CHAR = r"[^\s'\"`,;()<>\[\]{}]"
_SERVER_PATH = re.compile(
    rf"file://{_PATH_CHAR}*[^\s'\"`,;()<>\[\]{{}}:.]"
    rf"|(?<![\w/.~-])~?/(?!/|v1/|api/v1/){_PATH_CHAR}*[^\s'\"`,;()<>\[\]{{}}:.]"
)
PATH_WORD = "<server path>"


def scrub_paths(text: str) -> str:
    """``text`` with every absolute filesystem path replaced by ``PATH_WORD``."""
    return _SERVER_PATH.sub(PATH_WORD, text) if "/" in text else text


def new_error_id() -> str:
    """The id a failed request's answer and the server's log line share."""
    return secrets.token_hex(6)


def error_body(
    code: ErrorCode | str, exc: BaseException | None = None, message: str = "", *, error_id: str = "", trace: str = ""
) -> bytes:
    """The msgpack body of an ERROR reply: code, type, message (without server paths), error id
    (and a traceback only when the server is configured to expose it). Built from bounded strings
    only: it cannot fail."""
    return msgpack.packb(
        {
            "code": str(code),
            "type": type(exc).__name__ if exc is not None else "",
            "message": scrub_paths(message or (describe(exc) if exc is not None else "")),
            "error_id": error_id,
            "traceback": trace,
        }
    )


def handler_error_code(exc: BaseException) -> str:
    """The wire code of an exception a handler raised: its class's ``code`` (polytinker errors that
    callers act on declare one, see polytinker.errors), else ``handler``. A ``RemoteError`` passed
    on (a worker's error, relayed by the scheduler) keeps the code its own server gave it, so the
    caller still gets the error's type (a learner's ConfigError stays a ConfigError)."""
    code = exc.code if isinstance(exc, RemoteError) else getattr(type(exc), "code", "")
    return code if isinstance(code, str) and code and code not in _TRANSPORT_CODES else ErrorCode.HANDLER


_TRANSPORT_CODES = frozenset(str(c) for c in ErrorCode if c is not ErrorCode.HANDLER)


def error_from_body(body: Any, kind: str) -> Exception:
    """The exception a client raises for an ERROR reply's decoded body: ProtocolError when the
    server refused the message itself, else RemoteError with the error's code, type and id."""
    if not isinstance(body, dict):
        return ProtocolError(f"{kind!r}: malformed error reply")
    code = str(body.get("code", ""))[:64]
    message = str(body.get("message", ""))[: 2 * MAX_ERROR_MESSAGE]
    if code in _TRANSPORT_CODES:
        return ProtocolError(f"the server rejected {kind!r} ({code}): {message}")
    return RemoteError(
        message,
        remote_type=str(body.get("type", ""))[:128],
        remote_traceback=str(body.get("traceback", "")),
        code=code or ErrorCode.HANDLER,
        error_id=str(body.get("error_id", ""))[:64],
    )


_REPLY, _ERROR = int(MsgType.REPLY), int(MsgType.ERROR)  # plain ints: an enum member is a lookup per use


def reply_value(mtype: int, body: Any, kind: str) -> Any:
    """What an answer to ``kind`` means, its body decoded: a REPLY's body; an ERROR raises its
    error (``error_from_body``); any other message type raises ProtocolError. Every client reads
    answers through this (the I/O thread, a caller socket, the in-process DirectClient)."""
    if mtype == _REPLY:
        return body
    if mtype == _ERROR:
        raise error_from_body(body, kind)
    raise ProtocolError(f"unexpected {MsgType(mtype).name} in reply to {kind!r}")


class RateLimitedLog:
    """Logs the first line of each ``key`` at ``level``, then at most one per ``period_s`` with a
    count of those suppressed meanwhile; every one at DEBUG. A flood of garbage, or a handler that
    fails on every call, must not become a flood of log lines. Keys are kept for at most
    ``max_keys`` distinct values (then they share one budget), so a hostile peer cannot grow it."""

    max_keys = 256

    def __init__(self, log: logging.Logger, period_s: float = 5.0, level: int = logging.WARNING) -> None:
        self._log = log
        self._period_s = period_s
        self._level = level
        self._next: dict[Any, float] = {}
        self._suppressed: dict[Any, int] = {}
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args: Any, key: Any = None, exc_info: BaseException | None = None) -> None:
        self._log.debug(msg, *args)
        now = time.monotonic()
        with self._lock:
            if key not in self._next and len(self._next) >= self.max_keys:
                key = None
            if now < self._next.get(key, 0.0):
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            suppressed = self._suppressed.pop(key, 0)
            self._next[key] = now + self._period_s
        extra = f" ({suppressed} more like it since the last report)" if suppressed else ""
        try:
            self._log.log(self._level, msg + extra, *args, exc_info=exc_info)
        except RecursionError:  # formatting a traceback of a very deep failure
            self._log.log(self._level, msg + extra + " (traceback too deep to print)", *args)


__all__ = [
    "PATH_WORD",
    "PING_HEADER",
    "PONG_HEADER",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "HeaderError",
    "MsgType",
    "RateLimitedLog",
    "describe",
    "error_body",
    "error_from_body",
    "handler_error_code",
    "new_error_id",
    "pack_header",
    "parse_header",
    "recv_frames",
    "reply_value",
    "scrub_paths",
    "send_frames",
]
