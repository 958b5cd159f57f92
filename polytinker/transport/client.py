"""``RpcClient`` (thread-safe, futures) and ``AsyncRpcClient`` (asyncio) over one DEALER socket.

One thread at a time owns the socket, the holder of ``_io_lock``. A blocking ``call()`` takes the
lock when it is free and drives the socket itself until its reply is in (leader/followers: no
thread hand-off on the hot path, which in CPython costs more than the network round trip); it
first waits for the reply in a blocking receive bounded by ``ZMQ_RCVTIMEO`` (5 ms; only while no
other thread has queued a call lately), cheaper than polling, then polls the socket and the
wake-up pipe. Otherwise, and for ``call_async``, ``send_oneway`` and ``AsyncRpcClient``, the
caller encodes its payload in its own thread and hands the frames over through a queue and a
wake-up pipe to the I/O thread, which waits for the pipe or the socket's ``ZMQ_FD`` without
holding the lock.

Whoever holds the lock sends queued requests, matches replies to request ids, enforces deadlines,
pings the server every ``heartbeat_interval_s`` and, after ``heartbeat_liveness`` intervals of
silence, fails the pending calls with PeerDeadError and replaces the socket (a restarted server
on the same address is then reached again, inproc too). A call cancelled by its caller or by its
timeout is cancelled on the server too (CANCEL, docs/wire-protocol.md).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import select
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq
from zmq.backend import zmq_poll

from polytinker.errors import PeerDeadError, ProtocolError, RequestTimeout, TransportError
from polytinker.transport import auth
from polytinker.transport._wakeup import WakePipe
from polytinker.transport.codec import body_decoder, decode, encode
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.protocol import (
    COPY_BELOW,
    PING_HEADER,
    HeaderError,
    MsgType,
    error_from_body,
    pack_header,
    parse_header,
    recv_frames,
    send_frames,
)
from polytinker.transport.server import apply_limits

log = logging.getLogger("polytinker.transport.client")
_BATCH = 256
_REQUEST = int(MsgType.REQUEST)
_TELL = int(MsgType.TELL)
_CANCEL = int(MsgType.CANCEL)
_REPLY_START = pack_header(MsgType.REPLY, 0, "")[:3]  # fixarray of 4, version, REPLY
# A leader waits this long for its answer in a blocking receive (ZMQ_RCVTIMEO) before it polls
# the socket and the wake-up pipe, cheaper than a poll (shorter timeouts fire often on a loaded
# machine, and each costs more than it saves). Another thread's call, tell or cancel could wait
# that long behind it, so a leader waits so only when no other thread has queued one for _QUIET_S.
_FAST_WAIT_MS = 5
_QUIET_S = 0.1
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_send: Any = zmq.backend.Socket.send  # compiled, under pyzmq's Python-level send (see protocol.send_frames)
_recv = zmq.backend.Socket.recv
_monotonic = time.monotonic
_get_ident = threading.get_ident


class _Pending:
    __slots__ = ("future", "kind", "timeout_s")

    def __init__(self, future: Future[Any] | _Slot, kind: str, timeout_s: float | None) -> None:
        self.future = future
        self.kind = kind
        self.timeout_s = timeout_s


class _Slot:
    """The answer of a blocking call whose own thread drives the socket: set and read by that one
    thread only, so none of a Future's locking is needed."""

    __slots__ = ("_done", "_exc", "_value")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None

    def set_result(self, value: Any) -> None:
        self._value, self._done = value, True

    def set_exception(self, exc: BaseException) -> None:
        self._exc, self._done = exc, True

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def result(self) -> Any:
        if self._exc is not None:
            raise self._exc
        return self._value


def _settle(fut: Future[Any] | _Slot, value: Any = None, exc: BaseException | None = None) -> None:
    """Resolve ``fut`` unless the caller cancelled it meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass


class RpcClient:
    """Calls into one ``RpcServer``. Thread-safe: any thread may call, many calls may be in flight."""

    def __init__(
        self,
        address: str,
        *,
        config: TransportConfig | None = None,
        curve: auth.ClientCurve | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._address = address
        self._cfg = config or DEFAULT_CONFIG
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._ops: collections.deque[tuple[Any, ...]] = collections.deque()
        self._last_op = 0.0  # when another thread last queued an op (monotonic)
        self._closed = False
        self._waker = WakePipe()
        self._io_lock = threading.Lock()  # held by whichever thread drives the socket
        self._io_owner: int | None = None  # that thread's id, to refuse a blocking call that would deadlock
        self._st = _LoopState(self._cfg)
        self._decode_body = body_decoder(self._cfg)
        self._sock = self._connect()  # here, so a bad address fails in the caller's thread
        self._thread = threading.Thread(target=self._loop, name=f"polytinker-client {address}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def call_async(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Future[Any]:
        """Send a request; the future resolves to the reply or raises RemoteError, ProtocolError,
        RequestTimeout or PeerDeadError. ``future.cancel()`` abandons the call: the server is sent
        CANCEL, so a request it has not started is dropped and a running handler can see it
        (``current_call().cancelled``); a timeout sends CANCEL too."""
        fut: Future[Any] = Future()
        op = self._request(kind, payload, self._cfg.request_timeout_s if timeout_s is None else timeout_s, fut)
        rid = op[1]

        def on_done(f: Future[Any]) -> None:
            if f.cancelled() and not self._closed:
                self._ops.append((_CANCEL, rid, kind, None, None, None))
                self._last_op = time.monotonic()
                self._wake()

        fut.add_done_callback(on_done)
        self._ops.append(op)
        self._last_op = time.monotonic()
        self._wake()
        return fut

    def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        """Send a request and wait for its reply (see :meth:`call_async` for the errors)."""
        lock = self._io_lock
        if not lock.acquire(False):  # another thread drives the socket
            if self._io_owner == _get_ident():
                raise TransportError(
                    "a blocking call() from a callback of this client's futures would wait for itself; "
                    "use call_async() there"
                )
            return self.call_async(kind, payload, timeout_s=timeout_s).result()
        self._io_owner = _get_ident()
        st = self._st
        try:  # lead: drive the socket from this thread until the reply is in
            if self._closed:
                raise TransportError(f"the client of {self._address} is closed")
            frames = encode(payload, config=self._cfg)
            rid = next(self._ids)
            # The deadline of this call is this thread's to keep (not in the heap the I/O thread serves).
            now = _monotonic()
            t = self._cfg.request_timeout_s if timeout_s is None else timeout_s
            deadline = None if t is None else now + t
            if self._ops or st.backlog:
                slot = _Slot()
                self._ops.append((_REQUEST, rid, kind, frames, slot, None))
                self._send_queued(st)
            else:
                header = pack_header(_REQUEST, rid, kind)
                sock = self._sock
                try:
                    if len(frames) == 1:
                        # Copying sends of small bytes: cheaper in pyzmq (see protocol.send_frames).
                        _send(sock, header, _SNDMORE_NOBLOCK, True)
                        _send(sock, frames[0], _NOBLOCK, len(frames[0]) < COPY_BELOW)
                    else:
                        send_frames(sock, [header, *frames], _NOBLOCK)
                except zmq.Again:  # no peer yet, or its queue is full (a message goes whole or not at all)
                    slot = _Slot()
                    st.pending[rid] = _Pending(slot, kind, None)
                    st.backlog.append((_REQUEST, rid, kind, frames, slot, None))
                except zmq.ZMQError as exc:
                    raise TransportError(f"cannot send {kind!r} to {self._address}: {exc}") from exc
                else:
                    # Until this thread lets go of the lock nobody else reads the socket, so the call
                    # joins the pending ones only if the fast wait does not bring its answer.
                    got: list[Any] | None = None
                    if now - self._last_op > _QUIET_S:
                        # The answer mostly comes within a millisecond: wait for it in a blocking
                        # receive (bounded by RCVTIMEO), cheaper than polling the socket and the pipe.
                        # Frames come zero-copy; the header is then copied out as bytes to compare.
                        try:
                            frame = _recv(sock, 0, False)
                        except zmq.Again:
                            pass
                        else:
                            st.last_recv = _monotonic()
                            st.alive = True
                            st.awaiting_pong = False
                            head = frame.bytes
                            got = [head]
                            if frame.more:  # a Frame's own flag: cheaper than asking the socket (RCVMORE)
                                frame = _recv(sock, 0, False)
                                if not frame.more and head == _REPLY_START + header[3:]:  # header and body
                                    return self._decode_body(frame)
                                got.append(frame)
                                while frame.more:
                                    frame = _recv(sock, 0, False)
                                    got.append(frame)
                                if head == _REPLY_START + header[3:]:
                                    return decode(got[1:], config=self._cfg)
                    slot = _Slot()
                    st.pending[rid] = _Pending(slot, kind, None)
                    if got is not None:
                        self._on_reply(st, got)
            while not slot._done and not self._closed:
                timeout_ms = st.poll_timeout_ms()
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if st.pending.pop(rid, None) is not None:
                            self._send_cancel(rid, kind)
                        slot.set_exception(RequestTimeout(f"{kind!r} got no reply within {t} s"))
                        break
                    timeout_ms = min(timeout_ms, int(left * 1000) + 1)
                self._io_step(st, timeout_ms, slot)
        finally:
            self._io_owner = None
            lock.release()
            if st.pending or self._ops or self._closed:
                self._wake()  # the I/O thread takes over the other calls
        if not slot._done:
            raise TransportError(f"the client of {self._address} was closed during the call")
        return slot.result()

    def _request(self, kind: str, payload: Any, timeout_s: float | None, fut: Future[Any] | _Slot) -> tuple[Any, ...]:
        """The op of a request; ``timeout_s`` is what the I/O thread enforces (None: nothing)."""
        if self._closed:
            raise TransportError(f"the client of {self._address} is closed")
        return (_REQUEST, next(self._ids), kind, encode(payload, config=self._cfg), fut, timeout_s)

    def send_oneway(self, kind: str, payload: Any = None) -> None:
        """A tell: the server runs the handler and answers nothing, not even on error."""
        if self._closed:
            raise TransportError(f"the client of {self._address} is closed")
        self._ops.append((_TELL, next(self._ids), kind, encode(payload, config=self._cfg), None, None))
        self._last_op = time.monotonic()
        self._wake()

    def close(self) -> None:
        """Fail the pending calls with TransportError and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(5.0)
        self._waker.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        self._waker.wake()

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        apply_limits(sock, self._cfg)
        sock.rcvtimeo = _FAST_WAIT_MS  # only the leader's first wait blocks; every other receive is NOBLOCK
        if self._curve is not None:
            sock.curve_secretkey = self._curve.secret_key
            sock.curve_publickey = self._curve.public_key
            sock.curve_serverkey = self._curve.server_public_key
        try:
            sock.connect(self._address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {self._address}: {exc}") from exc
        return sock

    # --- I/O thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        st = self._st
        ready = False
        try:
            while not self._closed:
                if not ready:
                    self._wait(st)
                with self._io_lock:
                    if self._closed:
                        break
                    self._io_owner = threading.get_ident()
                    try:
                        self._io_step(st, 0)
                        # ZMQ_FD only signals edges: a message may already wait behind the last send.
                        ready = bool(st.watching() and int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
                    except Exception:  # keep serving the other calls
                        log.exception("client I/O thread of %s: unexpected error", self._address)
                        ready = False
                    finally:
                        self._io_owner = None
        finally:
            with self._io_lock:
                st.fail_all(TransportError(f"the client of {self._address} is closed"))
                self._sock.close(linger=0)

    def _wait(self, st: _LoopState) -> None:
        """Sleep, without the lock, until the pipe, the socket (when an answer is due) or a timer."""
        waiter = select.poll()  # poll(), not select(): no limit on fd numbers in a busy process
        waiter.register(self._waker.fd, select.POLLIN)
        if st.watching():
            waiter.register(int(self._sock.getsockopt(zmq.FD)), select.POLLIN)
        waiter.poll(st.poll_timeout_ms())

    def _io_step(self, st: _LoopState, timeout_ms: int, until: _Slot | None = None) -> None:
        """One round of socket work; the caller holds ``_io_lock``. A leader passes its own call
        as ``until`` and stops reading once that is answered (the rest waits for the next round)."""
        if self._ops or st.backlog:
            self._send_queued(st)
        sock = self._sock
        for item, _ in zmq_poll(st.poll_items(sock, self._waker.fd), timeout_ms):
            if item is sock:
                for _ in range(_BATCH):
                    try:
                        frames = recv_frames(sock, _NOBLOCK)
                    except zmq.Again:
                        break
                    self._received(st, frames)
                    if until is not None and until._done:
                        break
            else:
                self._waker.drain()
                self._send_queued(st)
        now = time.monotonic()
        if now >= st.next_ping:
            st.next_ping = now + self._cfg.heartbeat_interval_s
            try:
                self._sock.send(PING_HEADER, zmq.NOBLOCK)
                st.awaiting_pong = True
            except zmq.Again:
                pass  # queue full towards a silent peer: liveness will tell
        if st.deadlines and st.deadlines[0][0] <= now:
            for rid, kind in st.expire(now):
                self._send_cancel(rid, kind)
        if now - st.last_recv > self._cfg.dead_after_s:
            self._peer_died(st, now)

    def _send_queued(self, st: _LoopState) -> None:
        # Requests that found no peer (EAGAIN: e.g. an inproc server that went away) wait in the
        # backlog until a peer appears, their deadline passes or the peer is declared dead.
        backlog = st.backlog
        while backlog:
            if not self._send_one(st, backlog[0], retry=True):
                break
            backlog.popleft()
        ops = self._ops
        while ops:
            op = ops.popleft()
            if backlog or not self._send_one(st, op, retry=False):
                backlog.append(op)

    def _received(self, st: _LoopState, frames: list[zmq.Frame]) -> None:
        st.last_recv = time.monotonic()
        st.alive = True
        st.awaiting_pong = False
        self._on_reply(st, frames)

    def _send_cancel(self, rid: int, kind: str) -> None:
        """Tell the server we gave up on ``rid`` (best effort: a full queue drops it)."""
        try:
            self._sock.send(pack_header(_CANCEL, rid, kind), _NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("CANCEL of %d (%r) not sent: %s", rid, kind, exc)

    def _send_one(self, st: _LoopState, op: tuple[Any, ...], retry: bool) -> bool:
        """False when the socket cannot take it now (no peer or queue full)."""
        mtype, rid, kind, frames, fut, timeout_s = op
        if mtype == _CANCEL:  # only for a request sent and not yet answered
            if st.pending.pop(rid, None) is not None:
                self._send_cancel(rid, kind)
            return True
        if fut is not None:
            if fut.cancelled() or (retry and rid not in st.pending):
                return True  # cancelled, timed out or failed meanwhile: drop it
            if not retry:
                st.add(rid, _Pending(fut, kind, timeout_s))
        try:
            send_frames(self._sock, [pack_header(mtype, rid, kind), *frames], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            st.pending.pop(rid, None)
            if fut is not None:
                _settle(fut, exc=TransportError(f"cannot send {kind!r} to {self._address}: {exc}"))
        return True

    def _on_reply(self, st: _LoopState, frames: list[zmq.Frame]) -> None:
        try:
            head = frames[0]
            mtype, rid, kind = parse_header(head)
        except HeaderError as exc:
            log.warning("dropped a malformed message from %s: %s", self._address, exc)
            return
        if mtype == MsgType.PONG:
            return
        pending = st.pending.pop(rid, None)
        if pending is None:
            if mtype == MsgType.ERROR:  # an error we cannot match (e.g. our header was unreadable)
                log.warning("error reply from %s for no pending call: %s", self._address, _try_decode(frames[1:]))
            return
        try:
            body = decode(frames[1:], config=self._cfg)
        except ProtocolError as exc:
            _settle(pending.future, exc=exc)
            return
        if mtype == MsgType.REPLY:
            _settle(pending.future, body)
        elif mtype == MsgType.ERROR:
            _settle(pending.future, exc=error_from_body(body, pending.kind))
        else:
            _settle(pending.future, exc=ProtocolError(f"unexpected {MsgType(mtype).name} in reply to {kind!r}"))

    def _peer_died(self, st: _LoopState, now: float) -> None:
        if st.alive or st.pending:
            log.warning("%s is silent for %.1f s: failing %d pending calls, reconnecting",
                        self._address, now - st.last_recv, len(st.pending))  # fmt: skip
        st.fail_all(PeerDeadError(f"{self._address} did not answer heartbeats for {self._cfg.dead_after_s:.1f} s"))
        st.alive = st.awaiting_pong = False
        self._sock.close(linger=0)
        self._sock = self._connect()
        st.poller = None
        st.last_recv = now


def _try_decode(frames: list[zmq.Frame]) -> Any:
    try:
        return decode(frames)
    except ProtocolError as exc:
        return exc


class _LoopState:
    """What the client I/O thread tracks: pending calls, their deadlines, heartbeat times."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self.pending: dict[int, _Pending] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.backlog: collections.deque[tuple[Any, ...]] = collections.deque()
        now = time.monotonic()
        self.last_recv = now
        self.next_ping = now
        self.alive = False
        self.awaiting_pong = False
        self.poller: list[tuple[Any, int]] | None = None  # zmq_poll items: the socket and the wake pipe

    def watching(self) -> bool:
        """Whether something is due from the server (an answer or a PONG)."""
        return bool(self.pending or self.backlog or self.awaiting_pong)

    def poll_items(self, sock: zmq.Socket, wake_r: int) -> list[tuple[Any, int]]:
        if self.poller is None or self.poller[0][0] is not sock:
            self.poller = [(sock, zmq.POLLIN), (wake_r, zmq.POLLIN)]
        return self.poller

    def add(self, rid: int, p: _Pending) -> None:
        self.pending[rid] = p
        if p.timeout_s is not None:
            heapq.heappush(self.deadlines, (time.monotonic() + p.timeout_s, rid))
            if len(self.deadlines) > 2 * len(self.pending) + 1024:  # drop deadlines of answered calls
                self.deadlines = [d for d in self.deadlines if d[1] in self.pending]
                heapq.heapify(self.deadlines)

    def poll_timeout_ms(self) -> int:
        wake_at = min(self.next_ping, self.last_recv + self.cfg.dead_after_s)
        if self.deadlines:
            wake_at = min(wake_at, self.deadlines[0][0])
        if self.backlog:
            wake_at = min(wake_at, time.monotonic() + 0.01)  # retry the requests that found no peer
        return max(0, int((wake_at - time.monotonic()) * 1000) + 1)

    def expire(self, now: float) -> list[tuple[int, str]]:
        """Fail the calls whose deadline passed; their (request id, kind), to cancel."""
        dl = self.deadlines
        out = []
        while dl and dl[0][0] <= now:
            _, rid = heapq.heappop(dl)
            p = self.pending.pop(rid, None)
            if p is not None:
                _settle(p.future, exc=RequestTimeout(f"{p.kind!r} got no reply within {p.timeout_s} s"))
                out.append((rid, p.kind))
        return out

    def fail_all(self, exc: Exception) -> None:
        pending, self.pending, self.deadlines = self.pending, {}, []
        self.backlog.clear()
        for p in pending.values():
            _settle(p.future, exc=exc)


class AsyncRpcClient:
    """The asyncio face of :class:`RpcClient`: the same calls, awaitable. Cancelling the awaiting
    task abandons the call and cancels it on the server (CANCEL)."""

    def __init__(
        self,
        address: str,
        *,
        config: TransportConfig | None = None,
        curve: auth.ClientCurve | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._client = RpcClient(address, config=config, curve=curve, context=context)

    @property
    def address(self) -> str:
        return self._client.address

    def call_async(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> asyncio.Future[Any]:
        """An asyncio future of the reply (call from inside a running loop)."""
        return asyncio.wrap_future(self._client.call_async(kind, payload, timeout_s=timeout_s))

    async def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        return await self.call_async(kind, payload, timeout_s=timeout_s)

    async def send_oneway(self, kind: str, payload: Any = None) -> None:
        self._client.send_oneway(kind, payload)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> AsyncRpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncRpcClient", "RpcClient"]
