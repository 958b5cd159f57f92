"""The actor mailbox on the wire: a small request/reply layer over ZeroMQ and msgpack.

This is the one place the actors touch sockets, so it can be swapped for
``polytinker.transport.rpc`` without touching the rest: ``MailboxServer(address, handlers)``
with ``start()``, ``stop()``, ``address``; ``MailboxClient(address)`` with ``call``,
``call_async``, ``send_oneway``, ``close``.

Wire format (one ZeroMQ message per request or reply, DEALER -> ROUTER):
request ``[msgpack {"id": int, "kind": str, "payload": Any, "oneway": bool}]``;
reply ``[msgpack {"id": int, "ok": bool, "result": Any}]`` or, on error,
``{"id", "ok": false, "error_type", "message", "traceback"}``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack
import zmq

from polytinker.errors import ProtocolError, RemoteError, RequestTimeout, TransportError

log = logging.getLogger(__name__)

_POLL_MS = 5  # how often an I/O thread looks at its outgoing queue
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class MailboxServer:
    """Serves ``handlers[kind](payload)`` for requests arriving at ``address``."""

    def __init__(self, address: str, handlers: Mapping[str, Callable[[Any], Any]], *, threads: int) -> None:
        self._requested = address
        self._handlers = dict(handlers)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._outbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mailbox")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        sock.bind(self._requested)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._thread = threading.Thread(target=self._loop, name="mailbox-io", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    frames = sock.recv_multipart()
                    self._accept(frames)
                while True:
                    try:
                        reply = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    sock.send_multipart(reply)
        finally:
            sock.close(linger=0)

    def _accept(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[-1]
        try:
            req = _unpack(body)
            rid, kind, payload, oneway = req["id"], req["kind"], req.get("payload"), bool(req.get("oneway"))
        except Exception as exc:
            log.warning("malformed request dropped: %s", exc)
            return
        self._pool.submit(self._run, ident, rid, kind, payload, oneway)

    def _run(self, ident: bytes, rid: int, kind: str, payload: Any, oneway: bool) -> None:
        fn = self._handlers.get(kind)
        try:
            if fn is None:
                raise ProtocolError(f"unknown message kind {kind!r}")
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": fn(payload)}
            body = _pack(reply)
        except Exception as exc:
            if oneway:
                log.error("one-way %r failed: %s", kind, exc, exc_info=exc)
                return
            t = type(exc)
            reply = {
                "id": rid,
                "ok": False,
                "error_type": f"{t.__module__}.{t.__qualname__}",
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc)),
            }
            body = _pack(reply)
        if not oneway:
            self._outbox.put([ident, body])


class MailboxClient:
    """Sends requests to one MailboxServer; many calls may be in flight at once."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._pending: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mailbox-client-io", daemon=True)
        self._thread.start()

    def call_async(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Future[Any]:
        if self._closed.is_set():
            raise TransportError(f"client of {self.address} is closed")
        rid = next(self._ids)
        fut: Future[Any] = Future()
        with self._lock:
            self._pending[rid] = fut
        fut.add_done_callback(lambda _f: self._forget(rid))
        self._outbox.put(_pack({"id": rid, "kind": kind, "payload": payload, "oneway": False}))
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, self._expire, (fut, kind, timeout_s))
            timer.daemon = True
            timer.start()
            fut.add_done_callback(lambda _f: timer.cancel())
        return fut

    def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        return self.call_async(kind, payload, timeout_s=timeout_s).result()

    def send_oneway(self, kind: str, payload: Any = None) -> None:
        if self._closed.is_set():
            raise TransportError(f"client of {self.address} is closed")
        self._outbox.put(_pack({"id": 0, "kind": kind, "payload": payload, "oneway": True}))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.set_exception(TransportError(f"client of {self.address} closed"))

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    @staticmethod
    def _expire(fut: Future[Any], kind: str, timeout_s: float) -> None:
        with contextlib.suppress(Exception):
            fut.set_exception(RequestTimeout(f"{kind!r} got no reply within {timeout_s} s"))

    def _loop(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                while True:
                    try:
                        sock.send(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if poller.poll(_POLL_MS):
                    self._resolve(sock.recv_multipart()[-1])
        finally:
            sock.close(linger=0)

    def _resolve(self, body: bytes) -> None:
        try:
            rep = _unpack(body)
            with self._lock:
                fut = self._pending.get(rep["id"])
        except Exception as exc:
            log.warning("malformed reply dropped: %s", exc)
            return
        if fut is None or fut.done():
            return
        with contextlib.suppress(Exception):
            if rep.get("ok"):
                fut.set_result(rep.get("result"))
            else:
                err = RemoteError(
                    rep.get("message", ""),
                    remote_type=rep.get("error_type", ""),
                    remote_traceback=rep.get("traceback", ""),
                )
                fut.set_exception(err)
