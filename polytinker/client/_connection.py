"""The client's connection to a scheduler: typed requests, retries, and errors mapped to types.

Every call goes through ``Connection.ask`` (``ask(msg)``: the kind and the reply type come from
the message's class, ``Request[R]``, and the result is typed ``R``; ``request(kind, msg, reply)``
underneath spells them out):

- an "overloaded" answer is retried for up to ``overload_wait_s``, then ``OverloadedError`` is
  raised; a "waiting" answer (the job is queued, preempted or paused) until ``job_wait_s``, then
  ``JobNotRunning``. Between tries the client backs off exponentially with full jitter
  (``backoff_s``: a uniform wait up to the answer's ``retry_after_s`` doubled per try, capped at
  ``OVERLOAD_CAP_S`` or ``WAITING_CAP_S``), so clients refused together do not return together;
- a scheduler that stops answering (restarting: its connection closed) is retried for up to
  ``reconnect_s`` from that moment, however long the call had run, when the request is safe to
  send twice (``idempotent=True``). ``forward_backward`` and ``optim_step`` are:
  each call carries a ``request_id``, the same on every resend (whose ``attempt`` counts up), and
  the learner applies one id once; so is ``create_job``: its ``request_key``, made once per call,
  gets the job the first copy made (``scheduler/service/request_keys.py``); ``load_state`` is not,
  and raises. A ``WorkerUnavailable`` answer (the scheduler waited ``worker_retry_s`` for a
  restarting worker) is retried alike;
- with ``check`` (the embedded runtime's ``LocalRuntime.check``), a runtime that stopped for good
  (an actor stayed down) raises its ``RuntimeDead``, which names the actor and why, instead of
  the calls retrying a scheduler that is gone;
- errors the scheduler raised come back as their own types (``AuthError``, ``ConfigError``,
  ``NotBuiltError``, ``JobNotRunning``), with the ``RemoteError`` as ``__cause__``.

The scheduler answers typed replies (``polytinker.scheduler.service.replies``): ``ask`` returns
the one the message declares, and the clients turn it into ``polytinker.types``'s
results (``ForwardBackwardOutput``, ``OptimStepResponse``, also known
here as ``OptimStepResult``, ``SampleResponse``, ...).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from polytinker.errors import (
    JobNotRunning,
    OverloadedError,
    PeerDeadError,
    RemoteError,
    RequestTimeout,
    TransportError,
    WorkerUnavailable,
    error_class,
)
from polytinker.scheduler.service.replies import OverloadedReply, WaitingReply
from polytinker.transport import ClientCurve, Request, RpcClient, TransportConfig, kind_of, reply_of
from polytinker.transport.direct import Link
from polytinker.types import ForwardBackwardOutput, OptimStepResponse, SampledSequence, SampleResponse

R = TypeVar("R")
OVERLOAD_CAP_S = 10.0  # the longest back-off after an "overloaded" answer
WAITING_CAP_S = 2.0  # ... after a "waiting" one (a queued job starts in its own time: ask again soon)


def backoff_s(base_s: float, tries: int, cap_s: float, rng: random.Random | None = None) -> float:
    """Exponential back-off with full jitter: uniform in [0, min(cap_s, base_s * 2**tries)]."""
    ceiling = min(cap_s, max(0.0, base_s) * 2.0 ** min(tries, 32))
    return (rng or random).uniform(0.0, ceiling)


# The results are Tinker's types (polytinker.types); the names polytinker's client used stay.
OptimStepResult = OptimStepResponse


class Connection:
    """One RPC client to the scheduler plus the API key, retries and a pool for futures."""

    def __init__(
        self,
        address: str,
        api_key: str,
        *,
        curve: ClientCurve | None = None,
        timeout_s: float = 600.0,
        reconnect_s: float = 120.0,
        overload_wait_s: float = 300.0,
        job_wait_s: float = 600.0,
        check: Callable[[], None] | None = None,
        rpc: Link | None = None,
    ) -> None:
        self.address, self.api_key = address, api_key
        self.check = check
        self.timeout_s, self.reconnect_s = timeout_s, reconnect_s
        self.overload_wait_s, self.job_wait_s = overload_wait_s, job_wait_s
        # rpc: an in-process runtime's DirectClient (InprocRuntime.client()) instead of a socket to address.
        self.rpc: Link = rpc or RpcClient(address, config=TransportConfig(request_timeout_s=timeout_s), curve=curve)
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="polytinker-client")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.rpc.close()

    def ask(self, msg: Request[R], *, idempotent: bool = True) -> R:
        """The scheduler's answer to ``msg``: the reply its class declares, after the retries the
        module docstring lists; any other answer is a ``TransportError``."""
        return self.request(kind_of(type(msg)), msg, reply_of(type(msg)), idempotent=idempotent)

    def request(self, kind: str, msg: Any, reply: type[R], *, idempotent: bool = True) -> R:
        """The scheduler's answer to ``msg``, of type ``reply`` (a class of ``replies``), after the
        retries the module docstring lists; any other answer is a ``TransportError``."""
        start = time.monotonic()
        lost_at: float | None = None  # when the scheduler went away (the reconnect window starts there)
        overloaded = waiting = 0  # refusals of this call so far: the back-off doubles with each

        def may_retry() -> bool:
            """A lost scheduler or worker: whether the reconnect window, from the first loss, is open."""
            nonlocal lost_at
            lost_at = time.monotonic() if lost_at is None else lost_at
            return idempotent and time.monotonic() - lost_at <= self.reconnect_s

        while True:
            if self.check is not None:
                self.check()
            try:
                answer = self.rpc.call(kind, msg, timeout_s=self.timeout_s)
            except (PeerDeadError, RequestTimeout) as exc:
                if self.check is not None:
                    self.check()  # the scheduler is gone for good, not restarting: say why
                if isinstance(exc, RequestTimeout) or not may_retry():
                    raise
                time.sleep(0.2)  # the scheduler is restarting: the client reconnects by itself
                if hasattr(msg, "attempt"):
                    msg = dataclasses.replace(msg, attempt=msg.attempt + 1)
                continue
            except RemoteError as exc:
                local = _local(exc)
                # The scheduler waited for a restarting worker in vain: a slow restart (a model
                # loading on a saturated machine) still counts as one.
                if isinstance(local, WorkerUnavailable) and may_retry():
                    time.sleep(1.0)
                    continue
                if local is exc:
                    raise
                raise local from exc
            waited, lost_at = time.monotonic() - start, None
            if isinstance(answer, reply):
                return answer
            if isinstance(answer, OverloadedReply):
                if waited > self.overload_wait_s:
                    raise OverloadedError(answer.reason or "overloaded", answer.retry_after_s)
                time.sleep(backoff_s(answer.retry_after_s, overloaded, OVERLOAD_CAP_S))
                overloaded += 1
            elif isinstance(answer, WaitingReply):
                if waited > self.job_wait_s:
                    raise JobNotRunning(answer.reason, str(answer.state))
                time.sleep(backoff_s(answer.retry_after_s, waiting, WAITING_CAP_S))
                waiting += 1
            else:
                raise TransportError(f"the scheduler answered {kind} with {answer!r}, not a {reply.__qualname__}")


def _local(exc: RemoteError) -> Exception:
    """The error the scheduler raised, as its own type when its wire code names one (AuthError,
    ConfigError, NotBuiltError, JobNotRunning, WorkerUnavailable, ...); else the RemoteError."""
    cls = error_class(exc.code)
    return cls(Exception.__str__(exc)) if cls is not None else exc  # the message without "Type: "


__all__ = [
    "OVERLOAD_CAP_S",
    "WAITING_CAP_S",
    "Connection",
    "ForwardBackwardOutput",
    "OptimStepResponse",
    "OptimStepResult",
    "SampleResponse",
    "SampledSequence",
    "backoff_s",
]
