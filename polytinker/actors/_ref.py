"""``ActorRef``: the parent's handle on an actor process.

A ref holds the current incarnation (process + mailbox client). A ref handed out by a
Supervisor stays the same object across restarts: the supervisor attaches each new incarnation
to it, so callers keep one ref and never re-resolve addresses themselves. Between a crash and
the restart, messages raise ActorDeadError saying the actor is restarting.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

from polytinker.actors._actor import RESERVED_PREFIX, check_payload_type
from polytinker.actors._mailbox import MailboxClient
from polytinker.actors._process import ChildProcess
from polytinker.actors._protocol import PING_KIND, STOP_KIND, TELL_KIND
from polytinker.actors.config import ActorConfig
from polytinker.errors import ActorDeadError, PeerDeadError, ProtocolError, RemoteError, RequestTimeout, TransportError

# A child whose connection closed is exiting: how long its exit status may take to show.
EXIT_STATUS_WAIT_S = 2.0


class ActorRef:
    """Send messages to an actor and control its process."""

    def __init__(self, name: str, config: ActorConfig, child: ChildProcess | None = None) -> None:
        self._name = name
        self._config = config
        self._lock = threading.Lock()
        self._child: ChildProcess | None = None
        self._client: MailboxClient | None = None
        self._concurrent_client: MailboxClient | None = None
        self._pending: set[Future[Any]] = set()
        self._last_exit: int | None = None
        # Why the ref is not usable right now ('' while it is); said in every ActorDeadError.
        self._down_reason = "has not started"
        # Set by stop()/kill(): the exit is wanted, so a supervisor must not restart it.
        self.stop_requested = False
        if child is not None:
            self._attach(child)

    def __repr__(self) -> str:
        return f"<ActorRef {self._name!r} pid={self.pid} alive={self.alive}>"

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> ActorConfig:
        return self._config

    @property
    def pid(self) -> int | None:
        """Pid of the current incarnation (the last one after it exits; None before the first)."""
        child = self._child
        return child.pid if child is not None else None

    @property
    def alive(self) -> bool:
        child = self._child
        return child is not None and child.poll() is None and not self._down_reason

    @property
    def exit_code(self) -> int | None:
        """Exit code of the last incarnation; None while it runs. A signal shows as its negative number."""
        child = self._child
        if child is None:
            return self._last_exit
        return child.poll()

    @property
    def address(self) -> str:
        child = self._child
        return child.address if child is not None else ""

    def wait_alive(self, timeout_s: float) -> bool:
        """Wait until the actor runs (e.g. a supervised one being restarted); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.alive:
            if self.stop_requested or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def ask(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        """Send a message and wait for the reply.

        Raises RemoteError if the handler raised (the actor keeps serving), RequestTimeout after
        ``timeout_s`` (default ``ActorConfig.ask_timeout_s``), ActorDeadError if the actor is not
        running or dies before it answers.
        """
        return self.ask_async(kind, payload, timeout_s=timeout_s).result()

    def ask_async(self, kind: str, payload: Any = None, *, timeout_s: float | None = None) -> Future[Any]:
        """Like :meth:`ask`, but return a future at once."""
        timeout = self._config.ask_timeout_s if timeout_s is None else timeout_s
        client, child = self._current(kind)
        if not kind.startswith(RESERVED_PREFIX):
            self._check_kind(child, kind, payload)
        outer: Future[Any] = Future()
        try:
            inner = client.call_async(kind, payload, timeout_s=timeout)
        except TransportError as exc:  # the client was closed under us: the process just exited
            raise self._dead() from exc
        with self._lock:
            self._pending.add(outer)
        outer.add_done_callback(self._forget)
        inner.add_done_callback(lambda f: self._settle(outer, f, child, kind))
        return outer

    def tell(self, kind: str, payload: Any = None) -> None:
        """Send a message without waiting; a handler error is logged by the actor, then handled by
        ``ActorConfig.tell_failure``."""
        client, child = self._current()
        self._check_kind(child, kind, payload)
        try:
            client.send_oneway(TELL_KIND, {"kind": kind, "payload": payload})
        except TransportError as exc:
            raise self._dead() from exc

    def ping(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Round trip through the mailbox; answers the actor's name and pid."""
        result: dict[str, Any] = self.ask(PING_KIND, None, timeout_s=timeout_s)
        return result

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Stop gracefully: a stop message queued behind the messages already sent, then ``on_stop``;
        SIGKILL if the process is still there after ``timeout_s`` (default
        ``ActorConfig.stop_timeout_s``). Returns the exit code."""
        self.stop_requested = True
        child, client = self._child, self._client
        if child is None:
            return self._last_exit
        request = (lambda: client.send_oneway(STOP_KIND)) if client is not None else None
        code = child.stop(self._config.stop_timeout_s if timeout_s is None else timeout_s, request)
        self._detach(child, code, "was stopped")
        return code

    def kill(self) -> int | None:
        """End the process at once with SIGKILL (no ``on_stop``). Returns the exit code."""
        self.stop_requested = True
        child = self._child
        if child is None:
            return self._last_exit
        child.signal(signal.SIGKILL)
        code = child.wait(None)
        self._detach(child, code, "was killed")
        return code

    def __enter__(self) -> ActorRef:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- incarnations -------------------------------------------------------------------------

    def _attach(self, child: ChildProcess) -> None:
        client = MailboxClient(child.address) if child.address else None  # "": no mailbox (no handlers)
        concurrent = MailboxClient(child.concurrent_address) if child.concurrent_address else None
        with self._lock:
            old = (self._client, self._concurrent_client)
            self._child, self._client, self._concurrent_client = child, client, concurrent
            self._down_reason = ""
        for c in old:
            if c is not None:
                c.close()
        # The reaper thread can see the exit before stop()/kill() returns; the reason must not
        # depend on which of the two gets there first.
        child.on_exit(lambda c, code: self._detach(c, code, self._exit_reason(code)))

    def _exit_reason(self, code: int | None) -> str:
        if self.stop_requested:
            return "was killed" if code == -signal.SIGKILL else "was stopped"
        return f"exited with code {code}"

    def _detach(self, child: ChildProcess, code: int | None, reason: str) -> None:
        """Mark the incarnation ``child`` gone: later messages raise ActorDeadError with ``reason``."""
        with self._lock:
            if self._child is not child:
                return
            if not self._down_reason:
                self._down_reason = reason
            self._last_exit = code
            clients = (self._client, self._concurrent_client)
            self._client = self._concurrent_client = None
            pending, self._pending = list(self._pending), set()
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.set_exception(self._dead(f"{self._down_reason} before it answered"))
        for c in clients:
            if c is not None:
                c.close()

    def _set_down_reason(self, reason: str) -> None:
        with self._lock:
            self._down_reason = reason

    def _dead(self, why: str | None = None) -> ActorDeadError:
        pid = self.pid
        return ActorDeadError(f"actor {self._name!r} (pid {pid}) {why or self._down_reason}")

    def _current(self, kind: str = "") -> tuple[MailboxClient, ChildProcess]:
        with self._lock:
            client, child = self._client, self._child
            if child is not None and kind in child.concurrent_kinds:
                client = self._concurrent_client
            down = self._down_reason
        if child is not None and not child.address and not down and child.poll() is None:
            raise ProtocolError(
                f"actor {self._name!r} declares no handlers, so it has no mailbox: it takes no messages "
                "(stop and kill it through its ref)"
            )
        if client is None or child is None or down:
            raise self._dead()
        if child.poll() is not None:
            raise self._dead(f"exited with code {child.poll()}")
        return client, child

    def _check_kind(self, child: ChildProcess, kind: str, payload: Any) -> None:
        """Refuse before sending what the actor would refuse: an unknown kind, or a payload that is
        not the typed message registered under that kind."""
        if kind not in child.kinds:
            known = ", ".join(sorted(child.kinds)) or "none"
            raise ProtocolError(f"actor {self._name!r} has no handler for kind {kind!r} (it handles: {known})")
        check_payload_type(kind, payload)

    def _forget(self, fut: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _settle(self, outer: Future[Any], inner: Future[Any], child: ChildProcess, kind: str) -> None:
        if outer.done():
            return
        exc = inner.exception()
        with contextlib.suppress(Exception):
            if exc is None:
                outer.set_result(inner.result())
            elif isinstance(exc, RemoteError | RequestTimeout) and child.poll() is None:
                outer.set_exception(exc)
            elif child.poll() is not None:
                outer.set_exception(self._dead(f"exited with code {child.poll()} while handling {kind!r}"))
            elif isinstance(exc, PeerDeadError):
                # The connection closed: the process is exiting, and its exit status comes a moment
                # later. Waited for off the client's I/O thread, which runs this callback.
                threading.Thread(target=self._settle_exit, args=(outer, exc, child, kind), daemon=True).start()
            else:
                outer.set_exception(exc)

    def _settle_exit(self, outer: Future[Any], exc: BaseException, child: ChildProcess, kind: str) -> None:
        code = child.wait(EXIT_STATUS_WAIT_S)
        with contextlib.suppress(Exception):
            outer.set_exception(
                self._dead(f"exited with code {code} while handling {kind!r}") if code is not None else exc
            )
