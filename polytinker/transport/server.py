"""``RpcServer``: one I/O thread owns the ROUTER socket; handlers run on a pool of handler threads
(or, ``async def`` ones, on the server's asyncio loop).

The I/O thread is the only thread that touches the socket. It reads every message, answers PING
at once (never behind a handler), honours CANCEL, refuses what it cannot serve (bad header,
unknown kind, over the size limits) and hands each request to the pool through a FIFO queue. A
handler thread decodes the payload (depth and size bounded by the codec), runs the handler,
encodes the answer and leaves it in the outbox; a wake-up pipe tells the I/O thread to send it.
Nothing a message holds can end a thread: every failure becomes an ERROR answer (the error's
code, type, message and an id under which the server logs the traceback), and a failure while
building that answer is caught too.

CANCEL (docs/wire-protocol.md): a queued request is dropped without running; a running handler
sees ``current_call().cancelled`` turn true (a coroutine handler is cancelled: CancelledError at
its next await); either way no answer is sent for that request.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from polytinker.errors import ConfigError, TransportError
from polytinker.transport import auth
from polytinker.transport._calls import CallContext, HandlerRunner
from polytinker.transport._wakeup import WakePipe
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.messages import message_type, takes_arrays
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

# Plain ints: pyzmq's flag enums cost an enum operation each time they are combined or tested.
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
# Message types as plain ints too: an IntEnum member costs a class attribute lookup per use.
_PING, _CANCEL, _REQUEST, _TELL = (int(t) for t in (MsgType.PING, MsgType.CANCEL, MsgType.REQUEST, MsgType.TELL))

_current: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("polytinker_rpc_call", default=None)


def current_call() -> CallContext | None:
    """Inside a handler (sync or async): the request it serves; None elsewhere."""
    return _current.get()


def peer_user_id() -> str:
    """Inside a handler of a Curve server: the Z85 public key the requester was admitted with
    (ZAP's user id); '' on a server without Curve or outside a handler."""
    call = _current.get()
    return call.peer_user_id if call is not None else ""


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
    """Serve ``handlers`` (kind -> callable taking the decoded payload; plain or ``async def``) on
    ``address``.

    Without ``curve`` the address must be loopback, ipc or inproc unless ``insecure=True``.
    ``arrays``: whether requests of kinds without a registered message type may carry numpy
    arrays and torch tensors (a registered type says so itself: ``@message(kind, arrays=True)``).
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
        arrays: bool = True,
    ) -> None:
        auth.check_bind_address(address, curve, insecure)
        for kind, handler in handlers.items():
            if not isinstance(kind, str) or not kind:
                raise ConfigError(f"handler kinds must be non-empty strings, got {kind!r}")
            if not callable(handler):
                raise ConfigError(f"the handler of {kind!r} is not callable: {handler!r}")
        self._requested = normalize_address(address)
        self._handlers = dict(handlers)
        self._async_kinds = frozenset(k for k, h in self._handlers.items() if _is_async(h))
        self._cfg = config or DEFAULT_CONFIG
        # Kinds served by the handler-thread pool (the rest: coroutines on the loop, or all on the
        # I/O thread with handler_threads=0).
        self._pooled = frozenset(self._handlers) - self._async_kinds if self._cfg.handler_threads else frozenset()
        self._arrays = {k: _kind_takes_arrays(k, arrays) for k in self._handlers}
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._address: str | None = None
        self._sock: zmq.Socket | None = None
        self._started = False
        self._stopping = False
        self._zap_domain: str | None = None
        self._waker = WakePipe()
        self._outbox: collections.deque[list[Any]] = collections.deque()  # answers for the I/O thread
        self._bad = RateLimitedLog(log)
        # Requests that may still be cancelled (queued or running), by (peer identity, request id).
        # No lock: each use is one dict operation (atomic under the GIL); see _forget.
        self._calls: dict[tuple[bytes, int], CallContext] = {}
        self._runner = HandlerRunner(self._cfg, _current, self._send_answer, self._forget, self._bad)
        self._io_thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aloop_thread: threading.Thread | None = None
        self._atasks: set[asyncio.Task[Any]] = set()

    @property
    def address(self) -> str:
        if self._address is None:
            raise TransportError("RpcServer.address is known once start() has bound the socket")
        return self._address

    def start(self) -> RpcServer:
        if self._started:
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
        self._started = True
        if self._async_kinds:
            loop = self._aloop = asyncio.new_event_loop()
            self._aloop_thread = threading.Thread(
                target=loop.run_forever, name=f"polytinker-server-async {self._address}", daemon=True
            )
            self._aloop_thread.start()
        self._io_thread = threading.Thread(target=self._io_loop, name=f"polytinker-server {self._address}", daemon=True)
        self._io_thread.start()
        log.debug("serving %s (kinds: %s)", self._address, ", ".join(sorted(self._handlers)))
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving; requests still queued are dropped, running handlers finish in the
        background (their answers are dropped), coroutine handlers are cancelled."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        self._runner.stop()
        self._waker.wake()
        if self._io_thread is not None:
            self._io_thread.join(timeout_s)
            if self._io_thread.is_alive():
                log.warning("server %s: the I/O thread did not stop in %.1f s", self._address, timeout_s)
        self._stop_async(timeout_s)
        self._release_zap()
        self._waker.close()

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _release_zap(self) -> None:
        if self._zap_domain is not None:
            auth.zap_unregister(self._ctx, self._zap_domain)
            self._zap_domain = None

    # --- the I/O thread ----------------------------------------------------------------------

    def _io_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        waker = self._waker.fd
        items = [(sock, _POLLIN), (waker, _POLLIN)]
        try:
            while not self._stopping:
                readable = False
                for item, _ in zmq.zmq_poll(items, -1):  # type: ignore[arg-type]  # fds too
                    if item is sock:
                        readable = True
                    else:  # the waker: drained before the outbox is read, so an answer queued later wakes us again
                        self._waker.drain()
                if readable:
                    self._read(sock)
                self._flush(sock)
        except zmq.ZMQError as exc:
            if not self._stopping:
                log.error("server %s: its socket failed (%s); it serves no more", self._address, exc)
        finally:
            sock.close(linger=0)

    def _read(self, sock: zmq.Socket) -> None:
        """One message per wake-up: the poll is level-triggered, so the next one wakes it again at
        once, and the answers ready meanwhile go out in between. (Asking ZMQ_EVENTS whether another
        waits costs about as much as that poll, and the lone request of a quiet client would pay it.)"""
        try:
            frames = recv_frames(sock, _NOBLOCK)
        except zmq.Again:  # the poll was wrong: nothing to read after all
            return
        try:
            self._route(frames)
        except Exception as exc:  # the server must outlive any one message
            self._bad("unexpected error while routing a message, serving on: %r", exc, key="route", exc_info=exc)

    def _flush(self, sock: zmq.Socket) -> None:
        outbox = self._outbox
        while outbox:
            frames = outbox.popleft()
            try:
                send_frames(sock, frames, _NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: the answer is lost
                log.debug("answer dropped: %s", exc)

    def _send_answer(self, frames: list[Any]) -> None:
        """From any thread: queue an answer (``[identity, header, body, ...]``) for the I/O thread."""
        if self._stopping:
            return
        self._outbox.append(frames)
        self._waker.wake()

    def _route(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) < 2:
            self._reject(ident, 0, "", HeaderError("empty message: a header frame is required"))
            return
        try:
            mtype, rid, kind = parse_header(frames[1].bytes)
        except HeaderError as exc:
            self._reject(ident, 0, "", exc)
            return
        if mtype in (_REQUEST, _TELL):
            self._dispatch(ident, mtype, rid, kind, frames[2:])
        elif mtype == _PING:
            self._outbox.append([ident, PONG_HEADER])
        elif mtype == _CANCEL:
            call = self._calls.get((ident, rid))
            if call is not None:
                self._cancel(call)
        else:
            self._reject(ident, rid, kind, HeaderError(f"a server does not accept {MsgType(mtype).name} messages"))

    def _dispatch(self, ident: bytes, mtype: int, rid: int, kind: str, body: list[zmq.Frame]) -> None:
        reply = mtype == _REQUEST
        handler = self._handlers.get(kind)
        if handler is None:
            self._reject(ident, rid, kind, HeaderError(f"no handler for kind {kind!r}", ErrorCode.UNKNOWN_KIND), reply)
            return
        if not body:
            self._reject(ident, rid, kind, HeaderError("a request needs a body frame"), reply)
            return
        cfg = self._cfg
        total = len(body[0]) if len(body) == 1 else sum(map(len, body))
        if len(body) > cfg.max_frames + 1 or len(body[0]) > cfg.max_body_bytes or total > cfg.max_message_bytes:
            err = HeaderError(
                f"message of {total} bytes in {len(body)} frames exceeds max_body_bytes={cfg.max_body_bytes} / "
                f"max_frames={cfg.max_frames} / max_message_bytes={cfg.max_message_bytes}",
                ErrorCode.TOO_LARGE,
            )
            self._reject(ident, rid, kind, err, reply)
            return
        call = CallContext(ident, rid, kind, handler, body, reply, self._arrays[kind], total)
        threaded = kind in self._pooled
        if threaded and not self._runner.has_room(total):
            err = HeaderError(
                f"the server holds max_queued_bytes={cfg.max_queued_bytes} of requests already; retry later",
                ErrorCode.BUSY,
            )
            self._reject(ident, rid, kind, err, reply)
            return
        if reply:
            self._calls[(ident, rid)] = call
        if threaded:
            self._runner.submit(call)
        elif kind in self._async_kinds:
            assert self._aloop is not None
            self._aloop.call_soon_threadsafe(self._start_async, call)
        else:
            self._runner.run(call)  # on this thread: handlers that never block, by the config's choice

    def _reject(self, ident: bytes, rid: int, kind: str, exc: HeaderError, reply: bool = True) -> None:
        self._bad("rejected a message (%s): %s", exc.error_code, exc, key=exc.error_code)
        if reply:
            self._outbox.append([ident, pack_header(MsgType.ERROR, rid, kind), error_body(exc.error_code, exc)])

    def _cancel(self, call: CallContext) -> None:
        call.cancelled = True
        task = call.task
        if task is not None and self._aloop is not None:
            self._aloop.call_soon_threadsafe(task.cancel)
        log.debug("request %d (%r) cancelled by its client", call.request_id, call.kind)

    def fail_call(self, call: CallContext, exc: BaseException) -> bool:
        """Answer a request whose handler is still running with the error ``exc``, now, from any
        thread (a watchdog whose deadline for the handler has passed; the handler gets the call
        from ``current_call()``). The handler's own answer is dropped when it comes, and the
        handler thread it holds is replaced in the pool (while at most ``handler_threads`` are
        stuck so). False when the call was answered already (or is a tell): nothing is sent."""
        if self._stopping or not self._runner.fail(call, exc):
            return False
        self._forget(call)
        return True

    def _forget(self, call: CallContext) -> None:
        key = (call.ident, call.request_id)
        other = self._calls.pop(key, None)
        if other is not None and other is not call:  # a client that reused an id replaced it: keep that
            self._calls.setdefault(key, other)

    # --- coroutine handlers: the server's asyncio loop ---------------------------------------

    def _start_async(self, call: CallContext) -> None:
        if call.cancelled or self._stopping:
            self._forget(call)
            return
        assert self._aloop is not None
        task = self._aloop.create_task(self._run_async(call))
        call.task = task
        self._atasks.add(task)
        task.add_done_callback(self._atasks.discard)

    async def _run_async(self, call: CallContext) -> None:
        try:
            out = await self._runner.acall(call)
            if out is not None and not call.cancelled and self._runner.claim(call):
                self._send_answer([call.ident, *out])
        except asyncio.CancelledError:
            if not (call.cancelled or self._stopping):
                raise
        finally:
            self._forget(call)

    def _stop_async(self, timeout_s: float) -> None:
        loop, thread = self._aloop, self._aloop_thread
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = list(self._atasks)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout_s)
        except Exception as exc:  # a handler that ignores cancellation: leave it to the daemon thread
            log.warning("server %s: coroutine handlers did not stop: %r", self._address, exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()


def _kind_takes_arrays(kind: str, untyped: bool) -> bool:
    cls = message_type(kind)
    return untyped if cls is None else takes_arrays(cls)


def _is_async(handler: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(handler):
        return True
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(type(handler).__call__)


__all__ = ["CallContext", "Handler", "RpcServer", "current_call", "peer_user_id"]
