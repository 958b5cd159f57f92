"""``RpcClient`` (thread-safe, futures) over DEALER sockets.

A blocking ``call()`` runs on its caller's thread, on a caller socket: a DEALER of its own, taken
from a pool and given back (``_caller_sockets.py``): the caller sends, waits in a blocking receive
and decodes the answer itself, with no hand-off to another thread. ``call_async()`` and tells go
through the main socket, which one I/O thread owns: a caller encodes its payload in its own
thread, queues the request and wakes the I/O thread through a pipe; the I/O thread sends it,
matches answers to request ids and resolves the call's future. The I/O thread also enforces those
calls' deadlines, pings the server every ``heartbeat_interval_s`` and tells the caller sockets
when the server is gone.

A server is dead when its connection is gone, not when it is slow: when the connection drops
(the server's process exited or restarted; the main socket's monitor says so at once) the calls
sent over it fail with PeerDeadError, since no server will answer them, and the socket
reconnects by itself. Silence alone counts as death only past ``silence_limit_s`` (a machine that
vanished without closing its connections): ``heartbeat_liveness`` intervals, or four times the
longest the server has taken to answer a ping, whichever is longer, so a peer on a saturated
machine is waited for. Then the pending calls fail with PeerDeadError and the socket is replaced
(a restarted server on the same address is then reached again, inproc too).
A call cancelled by its caller or by its timeout is cancelled on the server too (CANCEL,
docs/wire-protocol.md). A Curve client watches its handshakes: a server that refuses its key
fails the calls with AuthError at once, instead of leaving them to time out.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from polytinker.errors import AuthError, PeerDeadError, ProtocolError, RemoteError, TransportError
from polytinker.transport import auth
from polytinker.transport._caller_sockets import CallerSockets
from polytinker.transport._pending import Pending, PendingCalls, settle
from polytinker.transport._wakeup import WakePipe
from polytinker.transport.codec import decode, encode
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.protocol import (
    PING_HEADER,
    HeaderError,
    MsgType,
    RateLimitedLog,
    pack_header,
    parse_header,
    recv_frames,
    reply_value,
    send_frames,
)
from polytinker.transport.server import apply_limits

log = logging.getLogger("polytinker.transport.client")
_BATCH = 256  # answers read in one go before the I/O thread looks at its queue again
_RETRY_S = 0.01  # how soon a request the socket could not take (no peer yet, queue full) is tried again
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
_LOST = int(zmq.EVENT_DISCONNECTED)  # the connection closed: the server's process is gone (or restarting)
# Plain ints: pyzmq's flag enums cost an enum operation each time they are combined or tested.
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


class RpcClient:
    """Calls into one ``RpcServer``. Thread-safe: any thread may call, many calls may be in flight."""

    def __init__(
        self,
        address: str,
        *,
        config: TransportConfig | None = None,
        curve: auth.ClientCurve | None = None,
        context: zmq.Context | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """``on_lost``: called (on the client's I/O thread: keep it short) when the connection to
        the server closes, e.g. to announce oneself again to a server that restarts."""
        self._address = address
        self._on_lost = on_lost
        self._cfg = config or DEFAULT_CONFIG
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._ops: collections.deque[tuple[Any, ...]] = collections.deque()  # for the I/O thread
        self._closed = False
        self._waker = WakePipe()
        self._st = PendingCalls(self._cfg)
        self._silence = RateLimitedLog(log, period_s=60.0)
        self._refused: str = ""  # why the server refused our Curve key, until a handshake succeeds
        self._sock, self._monitor = self._connect()  # here, so a bad address fails in the caller's thread
        self._caller_sockets = CallerSockets(self._caller_socket, self._cfg.idle_caller_sockets)
        self._thread = threading.Thread(target=self._loop, name=f"polytinker-client {address}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    def call_async(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Future[Any]:
        """Send a request; the future resolves to the reply or raises RemoteError, ProtocolError,
        RequestTimeout, PeerDeadError or AuthError. ``future.cancel()`` abandons the call: the server
        is sent CANCEL, so a request it has not started is dropped and a running handler can see it
        (``current_call().cancelled``); a timeout sends CANCEL too. The future's callbacks run on the
        client's I/O thread: keep them short and never block in them."""
        fut: Future[Any] = Future()
        if self._refused and not self._closed:  # a future's errors arrive through the future
            fut.set_exception(self._refusal())
            return fut
        frames, timeout = self._request(payload, timeout_s)
        rid = next(self._ids)

        def on_done(f: Future[Any]) -> None:
            if f.cancelled() and not self._closed:
                self._queue((MsgType.CANCEL, rid, kind, None, None, None))

        fut.add_done_callback(on_done)
        self._queue((MsgType.REQUEST, rid, kind, frames, fut, timeout))
        return fut

    def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        """Send a request and wait for its reply, on this thread (see :meth:`call_async` for the
        errors; a timeout cancels the call on the server too)."""
        if threading.get_ident() == self._thread.ident:
            raise TransportError(
                "a blocking call() from a callback of this client's futures would hold up the thread "
                "that serves them and tells when the server is gone; use call_async() there"
            )
        frames, timeout = self._request(payload, timeout_s)
        sock = self._caller_sockets.take()
        try:
            return sock.call(kind, next(self._ids), frames, timeout, self._cfg)
        finally:
            self._caller_sockets.give(sock)

    def _request(self, payload: Any, timeout_s: float | None) -> tuple[list[Any], float | None]:
        """A request's frames (encoded in the caller's thread) and its timeout; raises at once on a
        closed client or one the server has refused."""
        if self._closed:
            raise TransportError(f"the client of {self._address} is closed")
        if self._refused:
            raise self._refusal()
        timeout = self._cfg.request_timeout_s if timeout_s is None else timeout_s
        return encode(payload, config=self._cfg), timeout

    def _refusal(self) -> AuthError:
        return AuthError(f"{self._address} refused this client: {self._refused}")

    def send_oneway(self, kind: str, payload: Any = None) -> None:
        """A tell: the server runs the handler and answers nothing, not even on error."""
        if self._closed:
            raise TransportError(f"the client of {self._address} is closed")
        self._queue((MsgType.TELL, next(self._ids), kind, encode(payload, config=self._cfg), None, None))

    def close(self) -> None:
        """Fail the pending calls with TransportError and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._waker.wake()
        self._thread.join(5.0)
        self._waker.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _queue(self, op: tuple[Any, ...]) -> None:
        self._ops.append(op)
        self._waker.wake()

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        """The main socket and the monitor that says when its connection closes or is refused."""
        return self._socket(_LOST if self._curve is None else _LOST | _HANDSHAKE_EVENTS)

    def _caller_socket(self) -> zmq.Socket:
        return self._socket()[0]

    def _socket(self, events: int = 0) -> tuple[zmq.Socket, zmq.Socket | None]:
        """A DEALER with the config's limits and the Curve keys, connected to the server, and a
        monitor of ``events`` (none for a caller socket; inproc has no connections to lose, so its monitor
        would never speak: silence tells there)."""
        sock = self._ctx.socket(zmq.DEALER)
        apply_limits(sock, self._cfg)
        if self._curve is not None:
            sock.curve_secretkey = self._curve.secret_key
            sock.curve_publickey = self._curve.public_key
            sock.curve_serverkey = self._curve.server_public_key
        monitor = sock.get_monitor_socket(events) if events and not self._address.startswith("inproc://") else None
        try:
            sock.connect(self._address)
        except zmq.ZMQError as exc:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {self._address}: {exc}") from exc
        return sock, monitor

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # --- the I/O thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        st = self._st
        try:
            while not self._closed:
                sock = self._sock
                items = [(self._waker.fd, _POLLIN), (sock, _POLLIN)]
                if self._monitor is not None:
                    items.append((self._monitor, _POLLIN))
                while not self._closed and sock is self._sock:  # a reconnect makes a new socket
                    polled = zmq.zmq_poll(items, st.poll_timeout_ms())  # type: ignore[arg-type]  # fds too
                    try:
                        self._step(st, polled)
                    except Exception as exc:  # keep serving the other calls
                        log.exception("client I/O thread of %s: unexpected error: %r", self._address, exc)
        finally:
            closed = TransportError(f"the client of {self._address} is closed")
            st.fail_all(closed)
            self._caller_sockets.fail(closed, final=True)
            while self._ops:  # queued by a caller just before the close: its future must not wait for ever
                fut = self._ops.popleft()[4]
                if fut is not None:
                    settle(fut, exc=closed)
            self._close_socket()

    def _step(self, st: PendingCalls, polled: list[tuple[Any, int]]) -> None:
        readable = events = False
        for item, _ in polled:  # by identity: comparing a socket with an fd costs more than this
            if item is self._sock:
                readable = True
            elif item is self._monitor:
                events = True
            else:  # the waker's fd
                self._waker.drain()  # before the queue is read: an op queued later wakes us again
        if events:
            self._connection_events(st)
        if self._ops or st.backlog:
            self._send_queued(st)
        if readable:
            self._receive(st)
        self._timers(st)

    def _receive(self, st: PendingCalls) -> None:
        sock = self._sock
        for i in range(_BATCH):
            # The poll said a message waits. Whether another does, ZMQ_EVENTS says (cheaper than a
            # receive that raises zmq.Again); with no call left to answer, the next poll will tell.
            if i and (not st.pending or not int(sock.getsockopt(_EVENTS)) & _POLLIN):
                return
            try:
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                return
            st.heard_from()
            self._on_answer(st, frames)

    def _timers(self, st: PendingCalls) -> None:
        now = time.monotonic()
        if now < st.next_due:  # nothing is due before the time the last poll was sized for
            return
        if now >= st.next_ping:
            st.next_ping = now + self._cfg.heartbeat_interval_s
            try:
                self._sock.send(PING_HEADER, _NOBLOCK)
                st.pinged(now)
            except zmq.Again:
                pass  # queue full towards a silent peer: liveness will tell
        for rid, kind in st.expire(now):
            self._send_cancel(rid, kind)
        if now - max(st.last_recv, self._caller_sockets.heard_at) > st.silence_limit_s():
            self._peer_died(st, now)

    def _send_queued(self, st: PendingCalls) -> None:
        # Requests the socket could not take (EAGAIN: no peer yet, or its queue is full) wait in the
        # backlog until it can, their deadline passes or the peer is declared dead.
        backlog = st.backlog
        while backlog:
            if not self._send_one(st, backlog[0]):
                break
            backlog.popleft()
        ops = self._ops
        while ops:
            op = ops.popleft()
            _, rid, kind, _, fut, timeout_s = op
            if fut is not None:
                if fut.cancelled():
                    continue
                if self._refused:  # refused since the call was made: the server will not serve it
                    settle(fut, exc=self._refusal())
                    continue
                st.add(rid, Pending(fut, kind, timeout_s))  # pending from here: a deadline or a death fails it
            if backlog or not self._send_one(st, op):
                backlog.append(op)

    def _send_cancel(self, rid: int, kind: str) -> None:
        """Tell the server we gave up on ``rid`` (best effort: a full queue drops it)."""
        try:
            self._sock.send(pack_header(MsgType.CANCEL, rid, kind), _NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("CANCEL of %d (%r) not sent: %s", rid, kind, exc)

    def _send_one(self, st: PendingCalls, op: tuple[Any, ...]) -> bool:
        """False when the socket cannot take it now (no peer or queue full)."""
        mtype, rid, kind, frames, fut, _ = op
        if mtype == MsgType.CANCEL:  # only for a request sent and not yet answered
            if st.pop(rid) is not None:
                self._send_cancel(rid, kind)
            return True
        if fut is not None and (fut.cancelled() or not st.has(rid)):
            return True  # cancelled, timed out or failed meanwhile: drop it
        try:
            send_frames(self._sock, [pack_header(mtype, rid, kind), *frames], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            st.pop(rid)
            if fut is not None:
                settle(fut, exc=TransportError(f"cannot send {kind!r} to {self._address}: {exc}"))
        return True

    def _on_answer(self, st: PendingCalls, frames: list[zmq.Frame]) -> None:
        try:
            mtype, rid, _ = parse_header(frames[0].bytes)
        except HeaderError as exc:
            log.warning("dropped a malformed message from %s: %s", self._address, exc)
            return
        if mtype == MsgType.PONG:
            return
        pending = st.pop(rid)
        if pending is None:  # an answer to a call given up on (cancelled, timed out): nobody waits
            log.debug("%s answered %s for no pending call (request %d)", self._address, MsgType(mtype).name, rid)
            return
        try:
            value = reply_value(mtype, decode(frames[1:], config=self._cfg), pending.kind)
        except (ProtocolError, RemoteError) as exc:  # a malformed body, the server's error, a wrong type
            settle(pending.future, exc=exc)
            return
        settle(pending.future, value)

    def _connection_events(self, st: PendingCalls) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(_NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == _LOST:
                self._connection_lost(st)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = ""
            else:
                self._refused = (
                    "the server refused our Curve key (not on its allow-list)"
                    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    else "the Curve handshake failed (is the server key right?)"
                )
                log.warning("%s: %s", self._address, self._refused)
                st.fail_all(self._refusal())
                self._caller_sockets.fail(self._refusal())

    def _connection_lost(self, st: PendingCalls) -> None:
        """The calls sent over a connection that closed get no answer (a restarted server does not
        know them): they fail now, as PeerDeadError, for their callers to send again. The socket
        reconnects by itself; what is sent meanwhile waits for the server to be back."""
        st.alive = st.awaiting_pong = False
        lost = PeerDeadError(f"{self._address} closed the connection (the server exited or restarted)")
        self._caller_sockets.fail(lost)
        if st.pending:
            self._silence("%s closed the connection: failing %d pending calls", self._address, len(st.pending))
            st.fail_all(lost)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception as exc:  # the caller's hook must not end the I/O thread
                log.warning("on_lost hook of the client of %s failed: %r", self._address, exc)

    def _peer_died(self, st: PendingCalls, now: float) -> None:
        why = f"did not answer heartbeats for {st.silence_limit_s():.1f} s"
        if st.pending:
            self._silence("%s %s: failing %d pending calls, reconnecting", self._address, why, len(st.pending))
        st.fail_all(PeerDeadError(f"{self._address} {why}"))
        self._caller_sockets.fail(PeerDeadError(f"{self._address} {why}"))
        st.alive = st.awaiting_pong = False
        self._close_socket()
        self._sock, self._monitor = self._connect()
        st.last_recv = now


__all__ = ["RpcClient"]
