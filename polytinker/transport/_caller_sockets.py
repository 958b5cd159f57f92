"""Blocking calls on their caller's own thread: a pool of caller sockets, each a DEALER of its own.

A blocking ``RpcClient.call()`` takes an idle caller socket (or connects a new one), sends its
request, waits for the answer in a blocking receive and decodes it, all on the calling thread,
then gives the socket back. Handing the request to the client's I/O thread and the answer back
took two thread wake-ups and two turns of the GIL per call, about a sixth of a loopback round
trip on 2 cores (benchmarks/transport.py). A caller socket is used by one thread at a time (the
pool's lock is the memory barrier ZeroMQ asks for when a socket moves between threads); the I/O
thread never touches one in use.

What the I/O thread still knows for every call: whether the server is there. When the main
connection closes, the server falls silent, its Curve handshake refuses us, or the client is
closed, the I/O thread fails every caller socket in a call (:meth:`CallerSockets.fail`): the
waiting caller, which looks at its socket's verdict at least every ``CHECK_S`` while it waits,
raises that error and closes the socket instead of giving it back, and the idle ones are closed,
so the next call connects afresh. (A wake-up pipe per socket would tell at once, at the price of
two more file descriptors each; a tenth of a second is nothing next to the silence limit.) The
pool keeps ``TransportConfig.idle_caller_sockets`` idle sockets at most: a thread pool's churn
costs no connections.

A call abandoned at its deadline sends CANCEL on its socket (the server keys requests by
connection and request id) and the socket goes back to the pool: an answer that comes later is
told apart by its request id and dropped by the socket's next call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from polytinker.errors import RequestTimeout
from polytinker.transport.codec import decode
from polytinker.transport.config import TransportConfig
from polytinker.transport.protocol import (
    HeaderError,
    MsgType,
    pack_header,
    parse_header,
    recv_frames,
    reply_value,
    send_frames,
)

_NOBLOCK = int(zmq.NOBLOCK)
# Message types as plain ints: an IntEnum member costs a class attribute lookup per use.
_REQUEST, _CANCEL = int(MsgType.REQUEST), int(MsgType.CANCEL)
CHECK_S = 0.1  # longest a waiting caller goes without looking whether its socket was failed
_CHECK_MS = int(CHECK_S * 1000)


class CallerSocket:
    """One socket to the server, and the I/O thread's verdict on the call it carries."""

    __slots__ = ("failure", "heard_at", "sock", "wait_ms")

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.failure: BaseException | None = None  # set by the I/O thread; the socket is then dropped
        self.heard_at = 0.0  # monotonic time of the last message from the server
        # A send or a receive blocks at most this long (ZMQ_SNDTIMEO, ZMQ_RCVTIMEO) before the caller
        # looks at the verdict and the deadline again: one blocking receive, not a poll and a receive.
        self.wait_ms = sock.sndtimeo = sock.rcvtimeo = _CHECK_MS

    def close(self) -> None:
        self.sock.close(linger=0)

    def call(self, kind: str, rid: int, frames: list[Any], timeout_s: float | None, cfg: TransportConfig) -> Any:
        """Send request ``rid`` and wait for its answer (or the deadline, or a failure)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sock = self.sock
        message = [pack_header(_REQUEST, rid, kind), *frames]
        while True:  # the send waits only when the queue towards the server is full (sndhwm)
            self._bound(kind, rid, deadline, timeout_s)
            try:
                send_frames(sock, message)
                break
            except zmq.Again:
                self._check()
        while True:
            self._bound(kind, rid, deadline, timeout_s)
            try:
                answer = recv_frames(sock)  # an answer that came is taken even when a failure came with it
            except zmq.Again:
                self._check()
                continue
            self.heard_at = time.monotonic()
            try:
                mtype, answered, _ = parse_header(answer[0].bytes)
            except HeaderError:
                continue  # not an answer: the main connection's I/O thread would drop it too
            if answered != rid:  # the late answer of a call given up on earlier
                continue
            return reply_value(mtype, decode(answer[1:], config=cfg), kind)

    def _bound(self, kind: str, rid: int, deadline: float | None, timeout_s: float | None) -> None:
        """Bound the next send or receive by CHECK_S and what is left of the deadline; past the
        deadline, cancel the call and raise RequestTimeout."""
        wait_ms = _CHECK_MS
        if deadline is not None:
            left_ms = int((deadline - time.monotonic()) * 1000) + 1
            if left_ms <= 1:
                with contextlib.suppress(zmq.ZMQError):  # best effort, as the I/O thread's CANCEL
                    self.sock.send(pack_header(_CANCEL, rid, kind), _NOBLOCK)
                raise RequestTimeout(f"{kind!r} got no reply within {timeout_s} s")
            wait_ms = min(wait_ms, left_ms)
        if wait_ms != self.wait_ms:
            self.wait_ms = self.sock.sndtimeo = self.sock.rcvtimeo = wait_ms

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure


class CallerSockets:
    """The caller sockets of one client: idle ones (last used first) and those in a call."""

    def __init__(self, connect: Callable[[], zmq.Socket], idle_max: int) -> None:
        self._connect = connect
        self._idle_max = idle_max
        self._lock = threading.Lock()
        self._idle: list[CallerSocket] = []
        self._busy: set[CallerSocket] = set()
        self._closed: BaseException | None = None
        # When a caller socket last heard from the server: a sign of life for the I/O thread's
        # silence limit, as an answer on the main socket is (a float's assignment is atomic).
        self.heard_at = 0.0

    def take(self) -> CallerSocket:
        with self._lock:
            if self._closed is not None:
                raise self._closed
            cs = self._idle.pop() if self._idle else None
            if cs is not None:
                self._busy.add(cs)
                return cs
        cs = CallerSocket(self._connect())  # outside the lock: a connect may take a moment
        with self._lock:
            if self._closed is not None:
                cs.close()
                raise self._closed
            self._busy.add(cs)
        return cs

    def give(self, cs: CallerSocket) -> None:
        """Back to the pool after a call; closed instead when it was failed or the pool is full."""
        with self._lock:
            self._busy.discard(cs)
            self.heard_at = max(self.heard_at, cs.heard_at)
            keep = cs.failure is None and self._closed is None and len(self._idle) < self._idle_max
            if keep:
                self._idle.append(cs)
        if not keep:
            cs.close()

    def fail(self, exc: BaseException, *, final: bool = False) -> None:
        """From the I/O thread: the server is gone (or refused us, or the client closed): every call
        waiting on a caller socket raises ``exc``; idle ones are closed, the next call connects a new one."""
        with self._lock:
            if final:
                self._closed = exc
            idle, self._idle = self._idle, []
            for cs in self._busy:
                if cs.failure is None:  # the first reason stands (a refused key, then its disconnection)
                    cs.failure = exc
        for cs in idle:
            cs.close()


__all__ = ["CallerSocket", "CallerSockets"]
