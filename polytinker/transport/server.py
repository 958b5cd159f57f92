"""``RpcServer``: a ROUTER socket served by one leader thread at a time, handlers on the thread
that read them, on handler threads, or (``async def`` handlers) on the server's asyncio loop.

One thread at a time leads: it holds ``_sock_lock``, waits for the next message (in a blocking
receive while no other thread can have an answer to send, else in ``zmq_poll`` on the socket and a
wake-up pipe), reads messages, answers heartbeats itself, rejects what it cannot serve with an
error reply and honours CANCEL. A request that finds the server idle (or of a kind whose last such
run took under _QUICK_S) runs right there, on the leader, with no thread hand-off (the leader
lets go of the socket lock meanwhile); a watch thread
that sees one handler run longer than ``handler_takeover_s`` makes another thread the leader, so
heartbeats and other requests wait at most about that long, and the old leader answers and joins
the followers when its handler returns. A request that arrives while others are waiting behind it
on the socket, or while the pool is busy, is queued for a handler thread instead (FIFO, so one
handler thread serves in order). A handler thread sends its answer itself when the socket lock is
free, else leaves it in a queue and wakes the leader through the pipe.

Coroutine handlers (``async def``) run on an asyncio loop in a thread of the server's own, as many
at a time as are in flight (``handler_threads`` does not limit them).

CANCEL (docs/wire-protocol.md): a queued request is dropped without running; a running handler
sees ``current_call().cancelled`` turn true (a coroutine handler is cancelled: CancelledError at
its next await); either way no answer is sent for that request.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import errno
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq
from zmq.backend import zmq_poll

from polytinker.errors import ConfigError, ProtocolError, TransportError
from polytinker.transport import auth
from polytinker.transport._wakeup import WakePipe
from polytinker.transport.codec import body_decoder, decode, encode
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
    send_frames,
)

log = logging.getLogger("polytinker.transport.server")
Handler = Callable[[Any], Any]

_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_REQUEST = int(MsgType.REQUEST)
_TELL = int(MsgType.TELL)
_PING = int(MsgType.PING)
_CANCEL = int(MsgType.CANCEL)
_EVENTS = int(zmq.EVENTS)
_get = zmq.backend.Socket.get  # the compiled getsockopt (pyzmq's Python-level one makes an enum of the option)
_recv = zmq.backend.Socket.recv
_PARK_AFTER_S = 0.25  # the watch thread sleeps for good after this long without a request run on the leader
# While no other thread can have an answer to send, the leader waits for the next message in a
# blocking receive (ZMQ_RCVTIMEO) this long before it polls the socket and the wake-up pipe:
# cheaper than a poll, and only stop() (which then waits at most this long) needs the pipe.
_FAST_WAIT_MS = 20
_QUICK_S = 200e-6  # a handler this quick holds the GIL for most of it anyway: no thread would run it sooner


class CallContext:
    """The request a handler is serving: ``current_call()`` inside a handler returns it."""

    __slots__ = (
        "_body",
        "_cancelled",
        "_handler",
        "_ident",
        "_is_async",
        "_key",
        "_reply",
        "_task",
        "kind",
        "request_id",
    )

    def __init__(self, ident: bytes, rid: int, kind: str, handler: Handler, body: list[zmq.Frame], reply: bool):
        self._ident = ident
        self.request_id = rid
        self.kind = kind
        self._handler = handler
        self._body = body
        self._reply = reply
        self._cancelled = False
        self._is_async = False
        self._task: asyncio.Task[Any] | None = None
        self._key: tuple[bytes, int] | None = None  # set while CANCEL can find it in RpcServer._calls

    @property
    def cancelled(self) -> bool:
        """True once the client sent CANCEL for this request: its answer will be dropped, so a
        long handler may stop early (return anything, or raise)."""
        return self._cancelled

    @property
    def peer_user_id(self) -> str:
        """On a Curve server, the Z85 public key the requester was admitted with; else ''."""
        try:
            return str(self._body[0].get("User-Id"))
        except (zmq.ZMQError, AttributeError, IndexError):
            return ""


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
        for kind, handler in handlers.items():
            if not isinstance(kind, str) or not kind:
                raise ConfigError(f"handler kinds must be non-empty strings, got {kind!r}")
            if not callable(handler):
                raise ConfigError(f"the handler of {kind!r} is not callable: {handler!r}")
        self._requested = normalize_address(address)
        self._handlers = dict(handlers)
        self._async_handlers = frozenset(k for k, h in self._handlers.items() if _is_async(h))
        self._cfg = config or DEFAULT_CONFIG
        self._decode_body = body_decoder(self._cfg)
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._address: str | None = None
        self._sock: zmq.Socket | None = None
        self._started = False
        self._sock_lock = threading.Lock()  # held by the leader (while it polls too) or a thread sending
        self._zap_domain: str | None = None
        self._replies: collections.deque[list[Any]] = collections.deque()
        self._waker: WakePipe | None = None  # made by start(); handlers may still wake us after stop()
        self._stopping = False
        self._bad = RateLimitedLog(log)
        # Requests that may still be cancelled (queued or running), by (peer identity, request id).
        self._calls: dict[tuple[bytes, int], CallContext] = {}
        # Leader/followers, all under _cv: the leader's term, the queue, thread and handler counts.
        # Taken as the plain lock where nobody waits (a Condition's own __enter__ is interpreted).
        self._state_lock = threading.Lock()
        self._cv = threading.Condition(self._state_lock)
        self._term = 0  # the leader leads while this is the term it started with
        self._vacant = False  # the watch took the lead from a stuck leader: the next follower leads
        self._tasks: collections.deque[CallContext] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._running = 0  # sync handlers running, on the leader included
        self._inline: CallContext | None = None  # the request the leader is running itself
        self._quick: dict[str, bool] = {}  # kind -> its last run on the leader took under _QUICK_S
        self._pool = self._cfg.handler_threads
        self._takeover = self._cfg.handler_takeover_s if self._pool > 0 else 0.0
        self._watch_thread: threading.Thread | None = None
        self._watch_event = threading.Event()
        self._watch_parked = False
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
        sock.rcvtimeo = _FAST_WAIT_MS  # for the leader's fast wait; every other receive is NOBLOCK
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
        self._started = True
        if self._async_handlers:
            loop = self._aloop = asyncio.new_event_loop()
            self._aloop_thread = threading.Thread(
                target=loop.run_forever, name=f"polytinker-server-async {self._address}", daemon=True
            )
            self._aloop_thread.start()
        if self._takeover > 0:
            self._watch_thread = threading.Thread(
                target=self._watch, name=f"polytinker-server-watch {self._address}", daemon=True
            )
            self._watch_thread.start()
        self._term = 1
        with self._cv:
            self._spawn(lead=True)
        log.debug("serving %s (kinds: %s)", self._address, ", ".join(sorted(self._handlers)))
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving; requests still queued are dropped, running handlers finish in the
        background (their answers are dropped), coroutine handlers are cancelled."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        self._wake()
        with self._cv:
            self._cv.notify_all()
        self._watch_event.set()
        if self._watch_thread is not None:
            self._watch_thread.join(timeout_s)
        if self._sock_lock.acquire(timeout=timeout_s):  # the leader lets go once the pipe wakes it
            try:
                if self._sock is not None:
                    self._sock.close(linger=0)
            finally:
                self._sock_lock.release()
        else:
            log.warning("server %s: the socket is still in use after %.1f s; left open", self._address, timeout_s)
        self._stop_async(timeout_s)
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

    # --- threads: leader and followers ------------------------------------------------------

    def _spawn(self, lead: bool) -> None:
        """Start a server thread (the caller holds ``_cv``)."""
        self._threads += 1
        term = self._term if lead else None
        name = f"polytinker-server {self._address}" if lead else f"polytinker-handler {self._address}"
        threading.Thread(target=self._thread_main, args=(term,), name=name, daemon=True).start()

    def _thread_main(self, term: int | None) -> None:
        try:
            while True:
                if term is not None:
                    self._lead(term)
                term = self._follow()
                if term is None:
                    return
        except BaseException:
            log.exception("server %s: a server thread failed", self._address)
            raise
        finally:
            with self._cv:
                self._threads -= 1

    def _follow(self) -> int | None:
        """Run queued requests until this thread is to lead (its term) or to exit (None)."""
        cv = self._cv
        while True:
            with cv:
                while True:
                    if self._stopping:
                        return None
                    if self._vacant:
                        self._vacant = False
                        return self._term
                    if self._tasks and self._running < self._pool:
                        call = self._tasks.popleft()
                        if call._cancelled:
                            self._forget(call)
                            continue
                        self._running += 1
                        break
                    self._idle += 1
                    cv.wait()
                    self._idle -= 1
            try:
                self._run(call)
            finally:
                with self._state_lock:
                    self._running -= 1

    def _submit(self, call: CallContext) -> None:
        """Queue a request for a handler thread (the caller holds ``_cv``)."""
        self._tasks.append(call)
        self._provision()

    def _provision(self) -> None:
        """Wake or start followers for the queued requests and a vacant lead (the caller holds
        ``_cv``). A notified follower counts as idle until it runs, so it is the queue's length,
        not a count of notifications, that says whether another thread is needed."""
        need = len(self._tasks) + self._vacant
        if self._idle:
            self._cv.notify(min(need, self._idle))
        if need > self._idle and (self._threads <= self._pool or (self._vacant and not self._idle)):
            self._spawn(lead=False)

    def _watch(self) -> None:
        """Make another thread the leader when the leader's own handler runs too long."""
        tick = self._takeover / 2  # a call seen at two ticks in a row has run for (tick, 2 * tick]
        park_after = max(2, int(_PARK_AFTER_S / tick))
        seen: CallContext | None = None
        quiet = 0
        while not self._stopping:
            if quiet >= park_after:  # idle: sleep until the leader runs a request itself
                self._watch_parked = True
                if self._inline is None:
                    self._watch_event.wait()
                self._watch_event.clear()
                self._watch_parked = False
                quiet = 0
            time.sleep(tick)
            call = self._inline
            if call is None:
                quiet += 1
                seen = None
                continue
            quiet = 0
            if call is not seen:
                seen = call
                continue
            with self._cv:
                if self._inline is not call or self._stopping:
                    continue
                self._inline = None
                self._register(call)  # the new leader may read its CANCEL
                self._term += 1  # the stuck leader finds its term over when its handler returns
                self._vacant = True
                self._provision()  # a woken follower looks at the vacancy first
            seen = None
            log.debug("server %s: %r runs long; another thread took over the socket", self._address, call.kind)

    def _lead(self, term: int) -> None:
        sock = self._sock
        waker = self._waker
        assert sock is not None and waker is not None
        lock = self._sock_lock
        items: list[Any] = [(sock, _POLLIN), (waker.fd, _POLLIN)]
        lock.acquire()
        held = True
        try:
            while self._term == term and not self._stopping and not sock.closed:
                if self._replies:
                    self._flush(sock)
                frames = None
                # No answer can come from another thread (one queues its answer before it leaves
                # _calls, so the order of these two checks matters): the fast wait.
                if not self._calls and not self._replies:
                    try:
                        frames = _recv_message(sock, 0)
                    except zmq.Again:
                        pass
                    except zmq.ZMQError:  # the socket itself failed: nothing left to serve
                        log.exception("server %s: socket error, stopping", self._address)
                        return
                if frames is None:
                    try:
                        ready = zmq_poll(items, -1)
                    except zmq.ZMQError as exc:
                        if exc.errno == errno.EINTR:
                            continue
                        log.exception("server %s: poll failed, stopping", self._address)
                        return
                    for what, _ in ready:
                        if what is sock:
                            try:  # noqa: SIM105 (hot path)
                                frames = _recv_message(sock, _NOBLOCK)
                            except zmq.Again:
                                pass
                        else:
                            waker.drain()
                    if frames is None:
                        continue
                try:
                    call = self._on_message(sock, frames)
                except Exception:  # the server must outlive any one message
                    log.exception("unexpected error while routing a message; serving on")
                    continue
                if call is None:
                    continue
                lock.release()  # handler threads that finish meanwhile send their answers themselves
                held = False
                still, out = self._run_inline(call, term)
                if not still:
                    if out is not None:
                        self._send_reply(out)
                    self._forget(call)  # after the answer is queued: the new leader polls for it
                    return
                lock.acquire()
                held = True
                if call._key is not None:
                    self._forget(call)
                if out is not None and not sock.closed:
                    _send_now(sock, out)
        finally:
            if held:
                lock.release()

    def _flush(self, sock: zmq.Socket) -> None:
        replies = self._replies
        while replies:
            try:
                send_frames(sock, replies.popleft(), _NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: the reply is lost
                log.debug("reply dropped: %s", exc)

    def _send_reply(self, frames: list[Any]) -> None:
        """From a thread that is not the leader: send when the socket is free, else queue the
        answer and wake the leader (which holds the lock while it sleeps in poll)."""
        lock = self._sock_lock
        if lock.acquire(blocking=False):
            try:
                sock = self._sock
                if sock is None or sock.closed:
                    return
                self._replies.append(frames)
                self._flush(sock)
            finally:
                lock.release()
        else:
            self._replies.append(frames)
            self._wake()

    # --- the leader: routing ----------------------------------------------------------------

    def _on_message(self, sock: zmq.Socket, frames: list[Any]) -> CallContext | None:
        """Route one message; returns a request the leader is to run itself."""
        ident = frames[0]
        if len(frames) < 2:
            self._reject(sock, ident, 0, "", HeaderError("empty message: a header frame is required"))
            return None
        try:
            mtype, rid, kind = parse_header(frames[1])
        except HeaderError as exc:
            self._reject(sock, ident, 0, "", exc)
            return None
        if mtype in (_REQUEST, _TELL):
            return self._dispatch(sock, ident, mtype, rid, kind, frames[2:])
        if mtype == _PING:
            _send_now(sock, [ident, PONG_HEADER])
        elif mtype == _CANCEL:
            call = self._calls.get((ident, rid))
            if call is not None:
                self._cancel(call)
        else:
            err = HeaderError(f"a server does not accept {MsgType(mtype).name} messages")
            self._reject(sock, ident, rid, kind, err)
        return None

    def _dispatch(
        self, sock: zmq.Socket, ident: bytes, mtype: int, rid: int, kind: str, body: list[zmq.Frame]
    ) -> CallContext | None:
        reply = mtype == _REQUEST
        handler = self._handlers.get(kind)
        if handler is None:
            err = HeaderError(f"no handler for kind {kind!r}", ErrorCode.UNKNOWN_KIND)
            self._reject(sock, ident, rid, kind, err, reply)
            return None
        cfg = self._cfg
        if not body:
            self._reject(sock, ident, rid, kind, HeaderError("a request needs a body frame"), reply)
            return None
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
            self._reject(sock, ident, rid, kind, err, reply)
            return None
        call = CallContext(ident, rid, kind, handler, body, reply)
        if kind in self._async_handlers:
            call._is_async = True
            self._register(call)
            assert self._aloop is not None
            self._aloop.call_soon_threadsafe(self._start_async, call)
            return None
        if self._pool == 0:  # handler_threads=0: every handler runs here
            return call
        # Run it here unless more input waits (keep reading; the pool runs this one meanwhile). A kind
        # whose last run here was quick runs here anyway: a burst of those is served as fast one by
        # one, and reading ZMQ_EVENTS costs about as much as such a handler.
        here = self._takeover > 0 and (self._quick.get(kind, False) or not int(_get(sock, _EVENTS)) & _POLLIN)
        with self._state_lock:
            if here and self._running < self._pool and not self._tasks:
                # Not registered for CANCEL: no other thread reads the socket until a takeover,
                # and the watch registers it then.
                self._running += 1
                self._inline = call
                if self._watch_parked:
                    self._watch_event.set()
                return call
            self._register(call)
            self._submit(call)
        return None

    def _reject(
        self, sock: zmq.Socket, ident: bytes, rid: int, kind: str, exc: HeaderError, reply: bool = True
    ) -> None:
        self._bad("rejected a message (%s): %s", exc.code, exc)
        if reply:
            _send_now(sock, [ident, pack_header(MsgType.ERROR, rid, kind), error_body(exc.code, exc)])

    def _cancel(self, call: CallContext) -> None:
        call._cancelled = True
        task = call._task
        if task is not None and self._aloop is not None:
            self._aloop.call_soon_threadsafe(task.cancel)
        log.debug("request %d (%r) cancelled by its client", call.request_id, call.kind)

    def _register(self, call: CallContext) -> None:
        """Make ``call`` findable by CANCEL (requests only: a tell cannot be cancelled)."""
        if call._reply:
            key = call._key = (call._ident, call.request_id)
            self._calls[key] = call

    def _forget(self, call: CallContext) -> None:
        key = call._key
        if key is not None and self._calls.get(key) is call:  # a client that reused an id may have replaced it
            del self._calls[key]

    # --- running handlers -------------------------------------------------------------------

    def _run_inline(self, call: CallContext, term: int) -> tuple[bool, list[Any] | None]:
        """Run ``call`` on the leader, without the socket lock: (still the leader, answer frames)."""
        if self._pool == 0:
            out = self._call(call)
            still = not self._stopping
        else:
            t0 = time.perf_counter()
            out = self._call(call)
            self._quick[call.kind] = time.perf_counter() - t0 < _QUICK_S
            with self._state_lock:
                self._running -= 1
                if self._inline is call:
                    self._inline = None  # from here on the watch leaves this leader alone
                still = self._term == term and not self._stopping
                if self._tasks:  # queued behind this one while the pool was full
                    self._provision()
        if out is None or call._cancelled:
            return still, None
        return still, [call._ident, *out]

    def _run(self, call: CallContext) -> None:
        """On a handler thread. The call stays in ``_calls`` until its answer is sent or queued,
        so that the leader does not sit in its fast wait meanwhile."""
        try:
            out = self._call(call)
            if out is not None and not call._cancelled:
                self._send_reply([call._ident, *out])
        finally:
            self._forget(call)

    def _call(self, call: CallContext) -> list[Any] | None:
        """Frames of the answer (without the identity), or None for a tell."""
        ok, payload = self._payload(call)
        if not ok:
            return payload  # type: ignore[no-any-return]
        token = _current.set(call)
        try:
            result = call._handler(payload)
        except BaseException as exc:  # SystemExit too: the thread must go on serving
            return self._handler_error(call, exc)
        finally:
            _current.reset(token)
        return self._answer(call, result)

    def _payload(self, call: CallContext) -> tuple[bool, Any]:
        """``(True, payload)``, or ``(False, error frames)`` (None for a tell) when it cannot be served."""
        kind = call.kind
        body = call._body
        try:
            payload = self._decode_body(body[0]) if len(body) == 1 else decode(body, config=self._cfg)
        except ProtocolError as exc:
            self._bad("undecodable %s payload: %s", kind, exc)
            return False, self._error(call, ErrorCode.MALFORMED, exc)
        expected = message_type(kind)
        if expected is not None and type(payload) is not expected:
            bad = ProtocolError(f"kind {kind!r} takes a {expected.__qualname__}, got {type(payload).__qualname__}")
            self._bad("%s", bad)
            return False, self._error(call, ErrorCode.BAD_PAYLOAD, bad)
        return True, payload

    def _handler_error(self, call: CallContext, exc: BaseException) -> list[Any] | None:
        if call._reply:
            log.debug("handler %r raised %s: %s", call.kind, type(exc).__name__, exc)
        else:
            log.exception("handler %r raised on a tell (no one to answer)", call.kind, exc_info=exc)
        return self._error(call, ErrorCode.HANDLER, exc)

    def _answer(self, call: CallContext, result: Any) -> list[Any] | None:
        if not call._reply:
            return None
        try:
            return [pack_header(MsgType.REPLY, call.request_id, call.kind), *encode(result, config=self._cfg)]
        except ProtocolError as exc:
            log.error("handler %r returned a value that cannot be sent: %s", call.kind, exc)
            return self._error(call, ErrorCode.UNENCODABLE, exc)

    @staticmethod
    def _error(call: CallContext, code: ErrorCode, exc: BaseException) -> list[Any] | None:
        if not call._reply:
            return None
        return [pack_header(MsgType.ERROR, call.request_id, call.kind), error_body(code, exc)]

    # --- coroutine handlers: the server's asyncio loop -------------------------------------

    def _start_async(self, call: CallContext) -> None:
        if call._cancelled or self._stopping:
            self._forget(call)
            return
        assert self._aloop is not None
        task = self._aloop.create_task(self._run_async(call))
        call._task = task
        self._atasks.add(task)
        task.add_done_callback(self._atasks.discard)

    async def _run_async(self, call: CallContext) -> None:
        try:
            out = await self._acall(call)
            if out is not None and not call._cancelled and not self._stopping:
                self._send_reply([call._ident, *out])
        finally:
            self._forget(call)

    async def _acall(self, call: CallContext) -> list[Any] | None:
        ok, payload = self._payload(call)
        if not ok:
            return payload  # type: ignore[no-any-return]
        _current.set(call)  # the task runs in a copy of the context: this stays with it
        try:
            result = await call._handler(payload)
        except asyncio.CancelledError:
            if call._cancelled or self._stopping:
                return None
            raise
        except Exception as exc:
            return self._handler_error(call, exc)
        return self._answer(call, result)

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


def _recv_message(sock: zmq.Socket, flags: int) -> list[Any]:
    """``[identity, header, *body frames]`` of the next message (raises zmq.Again, as ``flags``
    say): the identity and the header as bytes (both are small), the body and buffer frames
    zero-copy. A ROUTER puts the identity in front of every message, and a message has at least
    one frame, so the header always follows; it is received as a Frame, whose ``more`` is a field
    read, where asking the socket for ZMQ_RCVMORE costs about a microsecond in pyzmq."""
    ident = _recv(sock, flags, True)
    head = _recv(sock, 0, False)
    out: list[Any] = [ident, head.bytes]
    if head.more:
        frame = _recv(sock, 0, False)
        out.append(frame)
        while frame.more:
            frame = _recv(sock, 0, False)
            out.append(frame)
    return out


def _send_now(sock: zmq.Socket, frames: list[Any]) -> None:
    try:
        send_frames(sock, frames, _NOBLOCK)
    except zmq.ZMQError as exc:  # peer gone or its queue full: the answer is lost
        log.debug("reply dropped: %s", exc)


def _is_async(handler: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(handler):
        return True
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(type(handler).__call__)


__all__ = ["CallContext", "Handler", "RpcServer", "current_call", "peer_user_id"]
