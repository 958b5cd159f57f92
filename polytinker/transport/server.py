"""``RpcServer``: a ROUTER socket served by one I/O thread, handlers run in a thread pool.

The I/O thread reads messages, answers heartbeats itself (so a busy pool never makes the server
look dead), rejects what it cannot serve with an error reply, and hands requests to the pool.
Workers decode the payload, run the handler and encode the reply. One thread at a time touches
the socket, the holder of ``_sock_lock``: a worker sends its reply itself when the lock is free
(no thread hand-off), else leaves it in a queue and wakes the I/O thread through a pipe. The I/O
thread sleeps on the pipe and the socket's ``ZMQ_FD`` without holding the lock.
"""

from __future__ import annotations

import collections
import logging
import select
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from polytinker.errors import ConfigError, ProtocolError, TransportError
from polytinker.transport import auth
from polytinker.transport._wakeup import WakePipe
from polytinker.transport._workers import Workers
from polytinker.transport.codec import decode, encode
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.messages import message_type
from polytinker.transport.protocol import (
    PONG_HEADER,
    ErrorCode,
    HeaderError,
    MsgType,
    RateLimitedLog,
    error_body,
    pack_header,
    parse_header,
    recv_frames,
    send_frames,
)

log = logging.getLogger("polytinker.transport.server")
Handler = Callable[[Any], Any]
_peer = threading.local()


def peer_user_id() -> str:
    """Inside a handler of a Curve server: the Z85 public key the requester was admitted with
    (ZAP's user id); '' on a server without Curve."""
    return str(getattr(_peer, "user_id", ""))


def _user_id(frame: Any) -> str:
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, AttributeError):
        return ""


_BATCH = 256  # messages read per wake-up before replies are flushed
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


def normalize_address(address: str) -> str:
    """``tcp://host:0`` means any free port, as ``tcp://host:*`` does for ZeroMQ."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    return address


def apply_limits(sock: zmq.Socket, cfg: TransportConfig) -> None:
    sock.linger = 0
    sock.sndhwm = cfg.sndhwm
    sock.rcvhwm = cfg.rcvhwm
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)


class RpcServer:
    """Serve ``handlers`` (kind -> callable taking the decoded payload) on ``address``.

    Without ``curve`` the address must be loopback, ipc or inproc unless ``insecure=True``.
    ``.address`` is the bound endpoint (``tcp://127.0.0.1:0`` picks a free port)."""

    def __init__(
        self,
        address: str,
        handlers: Mapping[str, Handler],
        *,
        config: TransportConfig | None = None,
        curve: auth.ServerCurve | None = None,
        insecure: bool = False,
        context: zmq.Context | None = None,
    ) -> None:
        auth.check_bind_address(address, curve, insecure)
        for kind in handlers:
            if not isinstance(kind, str) or not kind:
                raise ConfigError(f"handler kinds must be non-empty strings, got {kind!r}")
        self._requested = normalize_address(address)
        self._handlers = dict(handlers)
        self._cfg = config or DEFAULT_CONFIG
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._address: str | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._pool: Workers | None = None
        self._sock_lock = threading.Lock()  # held by whichever thread uses the socket
        self._zap_domain: str | None = None
        self._replies: collections.deque[list[Any]] = collections.deque()
        self._waker: WakePipe | None = None  # made by start(); workers may still wake us after stop()
        self._stopping = False
        self._bad = RateLimitedLog(log)

    @property
    def address(self) -> str:
        if self._address is None:
            raise TransportError("RpcServer.address is known once start() has bound the socket")
        return self._address

    def start(self) -> RpcServer:
        if self._thread is not None:
            return self
        sock = self._ctx.socket(zmq.ROUTER)
        apply_limits(sock, self._cfg)
        if self._curve is not None:
            sock.curve_server = True
            sock.curve_secretkey = self._curve.secret_key
            sock.curve_publickey = self._curve.public_key
            self._zap_domain = auth.zap_register(self._ctx, self._curve.allowed_clients)
            sock.zap_domain = self._zap_domain.encode()
        try:
            sock.bind(self._requested)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._release_zap()
            raise TransportError(f"cannot bind {self._requested}: {exc}") from exc
        self._address = sock.last_endpoint.decode()
        self._sock = sock
        self._waker = WakePipe()
        if self._cfg.handler_threads > 0:
            self._pool = Workers(self._cfg.handler_threads, "polytinker-handler")
        self._thread = threading.Thread(target=self._loop, name=f"polytinker-server {self._address}", daemon=True)
        self._thread.start()
        log.debug("serving %s (kinds: %s)", self._address, ", ".join(sorted(self._handlers)))
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving; requests still queued are dropped, running handlers finish in the background."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.stop()
        self._release_zap()
        if self._waker is not None:
            self._waker.close()

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _release_zap(self) -> None:
        if self._zap_domain is not None:
            auth.zap_unregister(self._ctx, self._zap_domain)
            self._zap_domain = None

    def _wake(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    # --- I/O thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        waiter = select.poll()  # poll(), not select(): no limit on fd numbers in a busy process
        assert self._waker is not None
        waiter.register(self._waker.fd, select.POLLIN)
        waiter.register(int(sock.getsockopt(zmq.FD)), select.POLLIN)
        ready = False
        try:
            while not self._stopping:
                if not ready:
                    waiter.poll()
                with self._sock_lock:
                    if self._stopping or sock.closed:
                        break
                    try:
                        ready = self._io_round(sock)
                    except zmq.ZMQError:  # the socket itself failed: nothing left to serve
                        log.exception("server %s: socket error, stopping", self._address)
                        break
        finally:
            with self._sock_lock:
                sock.close(linger=0)

    def _io_round(self, sock: zmq.Socket) -> bool:
        """Read what waits (up to a batch), flush queued replies; True if more input already waits."""
        assert self._waker is not None
        self._waker.drain()
        events = sock.getsockopt
        more = bool(int(events(zmq.EVENTS)) & _POLLIN)
        n = 0
        while more and n < _BATCH:
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                self._on_message(frames)
            except Exception:  # the server must outlive any one message
                log.exception("unexpected error while routing a message; serving on")
            more = bool(int(events(zmq.EVENTS)) & _POLLIN)
        if self._replies:
            self._flush(sock)
            # ZMQ_FD only signals edges: input may already wait behind the sends just made.
            more = bool(int(events(zmq.EVENTS)) & _POLLIN)
        return more

    def _flush(self, sock: zmq.Socket) -> None:
        replies = self._replies
        while replies:
            try:
                send_frames(sock, replies.popleft(), _NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: the reply is lost
                log.debug("reply dropped: %s", exc)

    def _send_reply(self, frames: list[Any]) -> None:
        """From a worker: send on the socket itself. The I/O thread never blocks while it holds
        the lock, so the wait is short, and no thread hand-off is needed."""
        with self._sock_lock:
            sock = self._sock
            if sock is None or sock.closed:
                return
            self._replies.append(frames)
            self._flush(sock)
            more = int(sock.getsockopt(zmq.EVENTS)) & _POLLIN
        if more:
            self._wake()  # input arrived meanwhile and our send may have swallowed its ZMQ_FD edge

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0]
        if len(frames) < 2:
            self._reject(ident, 0, "", HeaderError("empty message: a header frame is required"))
            return
        try:
            mtype, rid, kind = parse_header(frames[1].buffer)
        except HeaderError as exc:
            self._reject(ident, 0, "", exc)
            return
        if mtype == MsgType.PING:
            self._replies.append([ident, PONG_HEADER])
        elif mtype == MsgType.REQUEST or mtype == MsgType.TELL:
            self._dispatch(ident, mtype, rid, kind, frames[2:])
        elif mtype != MsgType.CANCEL:  # CANCEL: the handler runs anyway; the client drops the reply
            self._reject(ident, rid, kind, HeaderError(f"a server does not accept {MsgType(mtype).name} messages"))

    def _dispatch(self, ident: zmq.Frame, mtype: int, rid: int, kind: str, body: list[zmq.Frame]) -> None:
        reply = mtype == MsgType.REQUEST
        handler = self._handlers.get(kind)
        if handler is None:
            err = HeaderError(f"no handler for kind {kind!r}", ErrorCode.UNKNOWN_KIND)
            self._reject(ident, rid, kind, err, reply)
            return
        cfg = self._cfg
        if not body:
            self._reject(ident, rid, kind, HeaderError("a request needs a body frame"), reply)
            return
        if (
            len(body) > cfg.max_frames + 1
            or len(body[0]) > cfg.max_body_bytes
            or (len(body) > 1 and sum(len(f) for f in body) > cfg.max_message_bytes)
        ):
            err = HeaderError(
                f"message of {sum(len(f) for f in body)} bytes in {len(body)} frames exceeds max_body_bytes="
                f"{cfg.max_body_bytes} / max_frames={cfg.max_frames} / max_message_bytes={cfg.max_message_bytes}",
                ErrorCode.TOO_LARGE,
            )
            self._reject(ident, rid, kind, err, reply)
            return
        if self._pool is None:  # handler_threads=0: run here, on the I/O thread
            out = self._call(reply, rid, kind, handler, body)
            if out is not None:
                self._replies.append([ident, *out])
        else:
            self._pool.submit(self._run, ident, reply, rid, kind, handler, body)

    def _reject(self, ident: zmq.Frame, rid: int, kind: str, exc: HeaderError, reply: bool = True) -> None:
        self._bad("rejected a message (%s): %s", exc.code, exc)
        if reply:
            self._replies.append([ident, pack_header(MsgType.ERROR, rid, kind), error_body(exc.code, exc)])

    # --- worker threads ------------------------------------------------------------------------

    def _run(self, ident: zmq.Frame, reply: bool, rid: int, kind: str, handler: Handler, body: list[zmq.Frame]) -> None:
        out = self._call(reply, rid, kind, handler, body)
        if out is not None:
            self._send_reply([ident, *out])

    def _call(self, reply: bool, rid: int, kind: str, handler: Handler, body: list[zmq.Frame]) -> list[Any] | None:
        """Frames of the answer (without the identity), or None for a tell."""
        try:
            payload = decode(body, config=self._cfg)
        except ProtocolError as exc:
            self._bad("undecodable %s payload: %s", kind, exc)
            return self._error(reply, rid, kind, ErrorCode.MALFORMED, exc)
        expected = message_type(kind)
        if expected is not None and type(payload) is not expected:
            bad = ProtocolError(f"kind {kind!r} takes a {expected.__qualname__}, got {type(payload).__qualname__}")
            self._bad("%s", bad)
            return self._error(reply, rid, kind, ErrorCode.BAD_PAYLOAD, bad)
        _peer.user_id = _user_id(body[0]) if self._curve is not None else ""
        try:
            result = handler(payload)
        except Exception as exc:
            if reply:
                log.debug("handler %r raised %s: %s", kind, type(exc).__name__, exc)
            else:
                log.exception("handler %r raised on a tell (no one to answer)", kind)
            return self._error(reply, rid, kind, ErrorCode.HANDLER, exc)
        if not reply:
            return None
        try:
            return [pack_header(MsgType.REPLY, rid, kind), *encode(result, config=self._cfg)]
        except ProtocolError as exc:
            log.error("handler %r returned a value that cannot be sent: %s", kind, exc)
            return self._error(reply, rid, kind, ErrorCode.UNENCODABLE, exc)

    @staticmethod
    def _error(reply: bool, rid: int, kind: str, code: ErrorCode, exc: BaseException) -> list[Any] | None:
        if not reply:
            return None
        return [pack_header(MsgType.ERROR, rid, kind), error_body(code, exc)]


__all__ = ["Handler", "RpcServer", "peer_user_id"]
