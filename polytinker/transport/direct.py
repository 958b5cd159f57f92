"""``DirectClient``: an ``RpcClient``'s ``call`` to a table of handlers in this process, with no socket.

A call takes the path a request takes through ``RpcServer`` and ``RpcClient``, minus the sockets:
the payload is encoded by the codec, the server's ``HandlerRunner`` decodes it (bounded, checked
against the kind's registered message type), runs the handler with ``current_call()`` set and
encodes its answer or its error, and the caller decodes that as ``RpcClient`` does. So a handler
sees what it would see from the wire (tuples arrive as lists, typed messages as their types,
arrays read-only) and its caller gets the same results and the same errors (``RemoteError`` with
the error's wire code, ``ProtocolError`` for a refused message) as over ZeroMQ.

What differs: the handler runs on the caller's thread (a debugger steps from the caller into
it), ``timeout_s`` is not enforced (a handler stopped at a breakpoint is waited for), there is
no heartbeat, and ``peer_user_id()`` is '' (no Curve). ``concurrency`` bounds the calls served at
once, as ``handler_threads`` bounds a server's (0: unbounded); calls beyond it wait their turn.

``Link`` is what a caller needs of either client: ``call`` and ``close``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol, cast

import msgpack

from polytinker.errors import ConfigError, ProtocolError, TransportError
from polytinker.transport._calls import CallContext, HandlerRunner
from polytinker.transport.codec import decode, encode
from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.messages import message_type, takes_arrays
from polytinker.transport.protocol import (
    ErrorCode,
    HeaderError,
    RateLimitedLog,
    error_body,
    error_from_body,
    parse_header,
    reply_value,
)
from polytinker.transport.server import Handler, _current, _is_async

log = logging.getLogger("polytinker.transport.direct")


class Link(Protocol):
    """A client of one server: ``RpcClient`` over a socket, or ``DirectClient`` in this process."""

    def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any: ...

    def close(self) -> None: ...


class DirectClient:
    """Calls ``handlers`` in this process as the wire would (see the module docstring). Thread-safe."""

    def __init__(
        self,
        name: str,
        handlers: Mapping[str, Handler],
        *,
        config: TransportConfig | None = None,
        concurrency: int = 0,
        arrays: bool = True,
    ) -> None:
        for kind, handler in handlers.items():
            if _is_async(handler):
                raise ConfigError(f"DirectClient serves plain handlers only; {kind!r} is async")
        self._address = f"direct://{name}"
        self._handlers = dict(handlers)
        self._arrays = {k: _takes_arrays(k, arrays) for k in self._handlers}
        self._cfg = config or DEFAULT_CONFIG
        self._slots = threading.BoundedSemaphore(concurrency) if concurrency > 0 else None
        self._ids = itertools.count(1)
        self._answers: dict[bytes, list[Any]] = {}
        self._lock = threading.Lock()
        self._runner = HandlerRunner(self._cfg, _current, self._answered, lambda _call: None, RateLimitedLog(log))
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def call(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        """Serve one request on this thread and return its reply, or raise what ``RpcClient.call``
        would (``RemoteError``, ``ProtocolError``, ``TransportError`` once closed). ``timeout_s``
        is accepted and not enforced."""
        if self._closed:
            raise TransportError(f"the client of {self._address} is closed")
        handler = self._handlers.get(kind)
        if handler is None:
            refused = HeaderError(f"no handler for kind {kind!r}", ErrorCode.UNKNOWN_KIND)
            raise error_from_body(msgpack.unpackb(error_body(refused.error_code, refused)), kind)
        frames = encode(payload, config=self._cfg)
        rid = next(self._ids)
        ident = rid.to_bytes(8, "big")
        call = CallContext(ident, rid, kind, handler, cast(Any, frames), True, self._arrays[kind])
        if self._slots is None:
            self._runner.run(call)
        else:
            with self._slots:
                self._runner.run(call)
        with self._lock:
            answer = self._answers.pop(ident, None)
        if answer is None:  # HandlerRunner answers every request; this is a bug, not a peer's doing
            raise ProtocolError(f"{kind!r}: no answer from the handler")
        mtype, _, _ = parse_header(answer[0])
        return reply_value(mtype, decode(answer[1:], config=self._cfg), kind)

    def _answered(self, frames: list[Any]) -> None:
        """The runner's outbox: ``[identity, header, *body]`` of one answer."""
        with self._lock:
            self._answers[bytes(frames[0])] = frames[1:]

    def close(self) -> None:
        """Later calls raise ``TransportError``; calls being served finish."""
        self._closed = True

    def __enter__(self) -> DirectClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _takes_arrays(kind: str, untyped: bool) -> bool:
    cls = message_type(kind)
    return untyped if cls is None else takes_arrays(cls)


__all__ = ["DirectClient", "Link"]
