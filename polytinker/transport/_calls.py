"""Running a server's handlers: the request context, the handler-thread pool, and the answer of a
call, errors included.

``HandlerRunner.submit`` queues a request (FIFO) for at most ``handler_threads`` threads, started
as the queue needs them; ``run`` serves one on the calling thread. Serving a call means decoding
its payload (the codec bounds size and depth; arrays only where the kind takes them), checking it
is the kind's registered message type, calling the handler and encoding its result. Every failure
on that path becomes the frames of an ERROR answer; a failure while building those is caught too,
so a handler thread never dies and never leaves a count held.

``HandlerRunner.fail`` answers a call whose handler still runs (a caller's deadline for it has
passed): exactly one answer goes out for a call, whichever comes first, and the thread stuck in
that handler is written off, its place in the pool taken by a new thread (while at most
``handler_threads`` are written off at once), so a handler that never returns holds no slot.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from polytinker.errors import ProtocolError
from polytinker.transport.codec import decode, encode
from polytinker.transport.config import TransportConfig
from polytinker.transport.messages import message_type
from polytinker.transport.protocol import (
    ErrorCode,
    MsgType,
    RateLimitedLog,
    describe,
    error_body,
    handler_error_code,
    new_error_id,
    pack_header,
)

log = logging.getLogger("polytinker.transport.server")
_REPLY = int(MsgType.REPLY)  # a plain int: an IntEnum member costs a class attribute lookup per use


class CallContext:
    """The request a handler is serving: ``current_call()`` inside a handler returns it."""

    __slots__ = (
        "answered",
        "arrays",
        "body",
        "cancelled",
        "handler",
        "ident",
        "kind",
        "nbytes",
        "reply",
        "request_id",
        "task",
        "worker",
    )

    def __init__(
        self,
        ident: bytes,
        rid: int,
        kind: str,
        handler: Any,
        body: list[zmq.Frame],
        reply: bool,
        arrays: bool,
        nbytes: int | None = None,
    ) -> None:
        self.nbytes = sum(map(len, body)) if nbytes is None else nbytes
        self.ident = ident
        self.request_id = rid
        self.kind = kind
        self.handler = handler
        self.body = body
        self.reply = reply
        self.arrays = arrays
        self.cancelled = False
        """True once the client sent CANCEL for this request: its answer will be dropped, so a long
        handler may stop early (return anything, or raise)."""
        self.task: asyncio.Task[Any] | None = None
        self.answered = False  # claimed by the answer that goes out (HandlerRunner.claim)
        self.worker = _OFF_POOL  # where a pool thread is with it (_RUNNING, _FINISHED, _WRITTEN_OFF)

    @property
    def peer_user_id(self) -> str:
        """On a Curve server, the Z85 public key the requester was admitted with; else ''."""
        try:
            return str(self.body[0].get("User-Id"))
        except (zmq.ZMQError, AttributeError, IndexError):
            return ""


_OFF_POOL, _RUNNING, _FINISHED, _WRITTEN_OFF = range(4)


class HandlerRunner:
    """The handler threads of one server and what they do with a call."""

    def __init__(
        self,
        cfg: TransportConfig,
        current: contextvars.ContextVar[CallContext | None],
        send: Callable[[list[Any]], None],
        forget: Callable[[CallContext], None],
        bad: RateLimitedLog,
    ) -> None:
        self._cfg = cfg
        self._current = current
        self._send = send  # queues [identity, *answer frames] for the I/O thread
        self._forget = forget  # the call can no longer be cancelled
        self._bad = bad
        self._failures = RateLimitedLog(log)
        # A SimpleQueue (C) hands a call to a waiting thread at about half the cost of a
        # Condition (pure Python, a new lock per wait): it is on every request's path.
        self._queue: queue.SimpleQueue[CallContext | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the counts below
        self._threads = 0
        self._waiting = 0  # threads blocked on the queue (or about to be)
        self._queued = 0  # calls in the queue
        self._stopping = False
        self._written_off = 0  # threads still stuck in a handler whose call fail() answered
        self.queued_bytes = 0  # of the requests in the queue

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` fits under max_queued_bytes (always, into an empty queue)."""
        return not self._queued or self.queued_bytes + nbytes <= self._cfg.max_queued_bytes

    def submit(self, call: CallContext) -> None:
        with self._lock:
            self._queued += 1
            self.queued_bytes += call.nbytes
            # A thread more whenever the queue holds more calls than threads wait for them.
            start = self._queued > self._waiting and self._threads < self._cfg.handler_threads
            if start:
                self._threads += 1
        self._queue.put(call)
        if start:
            threading.Thread(target=self._work, name="polytinker-handler", daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            threads = self._threads
        for _ in range(threads):  # one wake-up each: a thread that takes None ends
            self._queue.put(None)

    def _work(self) -> None:
        q, lock = self._queue, self._lock
        with lock:
            self._waiting += 1
        while True:
            call = q.get()
            with lock:
                self._waiting -= 1
                if call is None or self._stopping:
                    self._threads -= 1
                    self._queued = 0
                    self.queued_bytes = 0
                    return
                self._queued -= 1
                self.queued_bytes -= call.nbytes
                call.worker = _RUNNING
            out = None if call.cancelled else self._serve(call)
            self._forget(call)
            # The pool's bookkeeping and the claim of the answer in one turn of the lock, before the
            # hand-off: the I/O thread that sends the answer waits for this thread's GIL, so whatever
            # ran after the hand-off would add to the round trip.
            with lock:
                if call.worker == _WRITTEN_OFF:  # fail() answered it, and a new thread has our place
                    self._written_off -= 1
                    return
                call.worker = _FINISHED
                self._waiting += 1
                send = out is not None and not call.cancelled and not call.answered
                call.answered = True
            if send and out is not None:
                self._send([call.ident, *out])

    def run(self, call: CallContext) -> None:
        """Serve ``call`` on this thread and queue its answer; never raises."""
        out = self._serve(call)
        self._forget(call)
        if out is not None and not call.cancelled and self.claim(call):
            self._send([call.ident, *out])

    def _serve(self, call: CallContext) -> list[Any] | None:
        """The frames of ``call``'s answer (None for a tell, or when serving failed); never raises."""
        try:
            return self._call(call)
        except BaseException as exc:
            self._failures("serving %r failed outside its handler: %s", call.kind, describe(exc), key="run")
            return None

    def claim(self, call: CallContext) -> bool:
        """Whether the answer about to go is the call's only one (fail() may have answered it)."""
        with self._lock:
            if call.answered:
                return False
            call.answered = True
            return True

    def fail(self, call: CallContext, exc: BaseException) -> bool:
        """Answer ``call`` with ``exc`` now, from any thread, while its handler may still run: the
        handler's own answer is then dropped, and the pool thread it holds is replaced. False
        (nothing sent) when the call was answered already, or is a tell."""
        if not call.reply or call.cancelled or not self.claim(call):
            return False
        out = self.failure(call, exc)
        if out is not None:
            self._send([call.ident, *out])
        with self._lock:
            if call.worker != _RUNNING or self._written_off >= self._cfg.handler_threads or self._stopping:
                return True  # not on a pool thread, or too many stuck already: the pool stays as it is
            call.worker = _WRITTEN_OFF
            self._written_off += 1
            self._threads -= 1
            start = self._queued > self._waiting
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name="polytinker-handler", daemon=True).start()
        return True

    def _call(self, call: CallContext) -> list[Any] | None:
        """Frames of the answer (without the identity), or None for a tell."""
        ok, payload = self._payload(call)
        if not ok:
            return payload  # type: ignore[no-any-return]
        token = self._current.set(call)
        try:
            result = call.handler(payload)
        except BaseException as exc:  # SystemExit too: the thread must go on serving
            return self.failure(call, exc)
        finally:
            self._current.reset(token)
        return self._answer(call, result)

    async def acall(self, call: CallContext) -> list[Any] | None:
        """The same for a coroutine handler, on the server's loop."""
        ok, payload = self._payload(call)
        if not ok:
            return payload  # type: ignore[no-any-return]
        self._current.set(call)  # the task runs in a copy of the context: this stays with it
        try:
            result = await call.handler(payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return self.failure(call, exc)
        return self._answer(call, result)

    def _payload(self, call: CallContext) -> tuple[bool, Any]:
        """``(True, payload)``, or ``(False, error frames)`` (None for a tell) when it cannot be served."""
        kind = call.kind
        try:
            payload = decode(call.body, config=self._cfg, arrays=call.arrays)
        except ProtocolError as exc:
            self._bad("undecodable %s payload: %s", kind, describe(exc), key=("malformed", kind))
            return False, self._error(call, ErrorCode.MALFORMED, exc)
        expected = message_type(kind)
        if expected is not None and type(payload) is not expected:
            bad = ProtocolError(f"kind {kind!r} takes a {expected.__qualname__}, got {type(payload).__qualname__}")
            self._bad("%s", bad, key=("bad_payload", kind))
            return False, self._error(call, ErrorCode.BAD_PAYLOAD, bad)
        return True, payload

    def failure(self, call: CallContext, exc: BaseException) -> list[Any] | None:
        """Log a handler's failure under a new error id; the ERROR frames that name it."""
        error_id = new_error_id()
        code = handler_error_code(exc)
        if code == ErrorCode.HANDLER or not call.reply:  # an error no caller expects: show where it came from
            what = "a tell" if not call.reply else "a request"
            self._failures(
                "handler %r failed on %s [error id %s]: %s: %s",
                call.kind,
                what,
                error_id,
                type(exc).__name__,
                describe(exc),
                key=(call.kind, type(exc)),
                exc_info=exc,
            )
        else:
            log.debug("handler %r raised %s [error id %s]: %s", call.kind, code, error_id, describe(exc))
        if not call.reply:
            return None
        trace = _format(exc) if self._cfg.expose_tracebacks else ""
        header = pack_header(MsgType.ERROR, call.request_id, call.kind)
        return [header, error_body(code, exc, error_id=error_id, trace=trace)]

    def _answer(self, call: CallContext, result: Any) -> list[Any] | None:
        if not call.reply:
            return None
        try:
            return [pack_header(_REPLY, call.request_id, call.kind), *encode(result, config=self._cfg)]
        except ProtocolError as exc:
            log.error("handler %r returned a value that cannot be sent: %s", call.kind, describe(exc))
            return self._error(call, ErrorCode.UNENCODABLE, exc)

    @staticmethod
    def _error(call: CallContext, code: ErrorCode, exc: BaseException) -> list[Any] | None:
        if not call.reply:
            return None
        return [pack_header(MsgType.ERROR, call.request_id, call.kind), error_body(code, exc)]


def _format(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(exc))
    except BaseException:
        return f"{type(exc).__name__}: {describe(exc)}"


__all__ = ["CallContext", "HandlerRunner"]
