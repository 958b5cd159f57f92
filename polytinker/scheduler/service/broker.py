"""The broker: engines and learner groups register here; requests are forwarded to them.

- A ``Register`` proves the worker token without carrying it (``auth.register_proof`` of its
  fields, the worker's Curve key among them). Every worker serves with Curve and admits only the
  scheduler's client key; the broker connects to the key the worker registered, with the client
  keypair derived from the token, so no other process on the host can send a worker a request.
- Workers (``Register``) re-register every ``worker_heartbeat_s``. Each process start has a new
  ``incarnation``: when it changes, the broker forgets what the old process held in memory (the
  adapters a learner had loaded), so the next request reloads them from their checkpoints.
  A scheduler that restarts knows no worker until each re-registers, a heartbeat later.
- ``call(worker_id, msg)`` forwards one request (its kind and reply type are its class's:
  ``Request[R]``, and the answer is checked to be an ``R``). If the worker dies (its connection
  goes silent, or it is gone from the registry), the call waits for the worker to come back (a
  supervisor restarts it) and sends the request again, up to ``worker_retry_s``; ``prepare``
  runs first on every new incarnation (to reload the adapter the request needs). A request the
  worker deduplicates (``keyed``: it carries an idempotency key) is also sent again to the same
  incarnation once it re-registers (it was wrongly declared dead: alive, but silent for a while),
  with its ``attempt`` counted up; so is a read (``REPEATABLE``: running it twice changes
  nothing); any other request waits for a new incarnation. A read given ``elsewhere`` (a sample
  or a logprobs call: any engine that holds or loads the adapter answers it alike) goes at once to
  the worker the policy picks after the death, when that is another one that is there: it does not
  wait for the dead engine's restart. A worker counts as dead when its
  connection closes or, still open, stays silent for ``worker_silence_s``: slow is not dead. A worker that
  answers ``NotResident`` dropped what ``prepare`` loaded (a learner group whose replicas switched
  between LoRA adapters and a full-parameter model): ``prepare`` runs again, then the request.
  One that answers ``WorkerFailed`` broke as a whole (a learner group lost a rank) and its process
  is ending: that incarnation counts as exited, and the request goes to the next one, as after a
  death (a keyed request with its attempt counted up).
- A worker the config does not declare registers only with ``[cluster] join_undeclared``; its
  ``Register`` carries the capacity its own config declares, and ``on_join`` hands that to the
  scheduler's policy, which places on it from the next scheduling pass.
- A local runtime's supervisor sees a worker process exit before any heartbeat can: its
  ``ActorsReport`` (``supervised``) marks that incarnation exited and closes its connection, so
  the calls in flight to it fail over at once (to wait for the restarted worker), not a heartbeat
  liveness later. A stale heartbeat of an exited incarnation cannot bring it back.
- Each learner group has a ``LearnerSlicer`` (``slicer.py``: whose turn it is on the group) and
  an ``FbBatcher`` (``fb_batcher.py``: the LoRA calls that meet run as one pass).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from polytinker.engine.types import ModelLimits
from polytinker.engine.worker.auth import (
    launcher_credential,
    leave_proof,
    register_proof,
    same,
    scheduler_client_keypair,
)
from polytinker.engine.worker.layout import ensure_state_id
from polytinker.engine.worker.messages import (
    ActorsReport,
    ActorState,
    EngineLogprobs,
    EngineSample,
    LearnerAdapterWeights,
    LearnerForward,
    Leave,
    Register,
    WorkersQuery,
    WorkerStats,
)
from polytinker.errors import (
    AuthError,
    ConfigError,
    NotResident,
    PeerDeadError,
    PolytinkerError,
    ProtocolError,
    RemoteError,
    TransportError,
    WorkerFailed,
    WorkerUnavailable,
)
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.fb_batcher import FbBatcher, Prepare, Send
from polytinker.scheduler.service.replies import ActorsNoted, Left, Registered, WorkersReply
from polytinker.scheduler.service.slicer import LearnerSlicer
from polytinker.transport import ClientCurve, Request, RpcClient, TransportConfig, ask, kind_of
from polytinker.transport.direct import Link

# Worker requests that only read (the weights, the model's answers): a resend to the process that
# may have run them already costs time, never a wrong state.
REPEATABLE: frozenset[type] = frozenset(
    {EngineSample, EngineLogprobs, LearnerForward, WorkerStats, LearnerAdapterWeights}
)

log = logging.getLogger("polytinker.scheduler.broker")
R = TypeVar("R")


@dataclass
class WorkerHandle:
    worker_id: str
    role: str
    address: str
    incarnation: str
    client: Link  # an RpcClient to its address (in process: a DirectClient to its handlers)
    last_seen: float
    prepared: set[str] = field(default_factory=set)  # keys `prepare` already ran for on this incarnation
    dead: bool = False
    since: float = field(default_factory=time.time)  # Unix time of its first registration
    exited: bool = False  # its supervisor saw the process exit: it never answers again
    shares_state: bool = True  # it sees the scheduler's state_dir (Register.state_id)


class Broker:
    """The registry of workers and the forwarding of requests to them (thread-safe)."""

    def __init__(self, config: RuntimeConfig, token: str) -> None:
        self.config = config
        self._token = token
        self._curve = scheduler_client_keypair(token)  # what this scheduler's connections to workers present
        # How a registered worker is reached: a Curve RpcClient to its address; an in-process
        # runtime (InprocRuntime) replaces it with direct links to its workers' handlers.
        self.connect: Callable[[Register], Link] = self._client_for
        self._launcher = launcher_credential(token)  # what the runtime that launched the workers shows
        self._declared = {e.engine_id: "engine" for e in config.engines} | {
            g.learner_id: "learner" for g in config.learners
        }
        self._workers: dict[str, WorkerHandle] = {}
        self._actors: tuple[ActorState, ...] = ()  # the local runtime's last ActorsReport
        self._cv = threading.Condition()
        self._join_lock = threading.Lock()
        self.model_limits = ModelLimits()  # until a worker registers: ids are checked >= 0 only
        hb = config.worker_heartbeat_s
        self._transport = TransportConfig(
            request_timeout_s=config.request_timeout_s,
            heartbeat_interval_s=hb,
            heartbeat_liveness=max(2, math.ceil(config.worker_silence_s / hb)),
        )
        self.slicers = {g.learner_id: LearnerSlicer(config.learner_slice_idle_s) for g in config.learners}
        self.batchers = {g.learner_id: self._batcher(g.learner_id) for g in config.learners}
        # A worker the config does not declare joined (its Register): the scheduler's policy places on it.
        self.on_join: Callable[[Register], None] = lambda _msg: None
        # A joined worker left for good (``forget_gone``): its jobs go back to the queue.
        self.on_leave: Callable[[str], None] = lambda _worker_id: None
        self._joined: dict[str, float] = {}  # joined worker id -> monotonic time it joined
        self.state_id = ensure_state_id(config.state_path)  # what a worker that sees this state reads

    def _batcher(self, learner_id: str) -> FbBatcher:
        return FbBatcher(
            self._keyed_sender(learner_id), self.config.learner_batch_window_s, self.config.learner_batch_max
        )

    def _keyed_sender(self, learner_id: str) -> Send:
        def send(_kind: str, payload: Any, prepares: list[Prepare]) -> Any:
            return self.call(learner_id, payload, prepare=prepares, keyed=True)

        return send

    # --- registration ------------------------------------------------------------------------------
    def register(self, msg: Register) -> Registered:
        if not same(msg.proof, register_proof(self._token, *msg.signed_fields())):
            raise AuthError("worker token rejected: start the worker with the runtime's --token")
        role = self._declared.get(msg.worker_id)
        if role is None:
            role = self._join(msg)
        if role != msg.role or msg.base_model != self.config.model:
            raise ConfigError(
                f"{msg.worker_id} is this runtime's {role} of {self.config.model}; it registered as "
                f"{msg.role} of {msg.base_model}"
            )
        self._note_limits(msg)
        now = time.monotonic()
        with self._cv:
            old = self._workers.get(msg.worker_id)
            if old is not None and old.incarnation == msg.incarnation and old.exited:
                return Registered(known=True)  # sent before the process died, read after
            if old is not None and old.incarnation == msg.incarnation and old.address == msg.address:
                old.last_seen, old.dead = now, False
                return Registered(known=True)
        client = self.connect(msg)
        shares = msg.state_id == self.state_id
        if msg.role == "learner" and not shares:
            log.warning(
                "learner %s does not see this runtime's state_dir (%s is not shared with its machine): the "
                "checkpoints it writes are not where another learner would resume its jobs from",
                msg.worker_id,
                self.config.state_dir,
            )
        with self._cv:
            old = self._workers.get(msg.worker_id)
            self._workers[msg.worker_id] = WorkerHandle(
                msg.worker_id, msg.role, msg.address, msg.incarnation, client, now, shares_state=shares
            )
            self._cv.notify_all()
        if old is not None:
            old.client.close()
        log.info(
            "worker %s (%s) registered at %s, incarnation %s", msg.worker_id, msg.role, msg.address, msg.incarnation
        )
        return Registered(known=False)

    def leave(self, msg: Leave) -> Left:
        """A worker stopping on purpose (``Leave``): that incarnation counts as exited at once, so
        its calls in flight fail over now; a worker that joined at run time is also forgotten at
        once (its jobs queued again), as ``forget_gone`` does after ``joined_gone_s``. A declared
        worker stays declared: its jobs wait for it to come back, as for a restart."""
        if not same(msg.proof, leave_proof(self._token, msg.worker_id, msg.incarnation)):
            raise AuthError("worker token rejected")
        with self._cv:
            h = self._workers.get(msg.worker_id)
        if h is None or h.incarnation != msg.incarnation:
            return Left(known=False)  # an earlier incarnation's, or said twice: the one there stays
        self._mark_exited(h, "left")
        if msg.worker_id in self._joined:
            self._forget(msg.worker_id)
        return Left(known=True)

    def _join(self, msg: Register) -> str:
        """Admit a worker the config does not declare ([cluster] join_undeclared): a learner group
        gets its slicer and batcher, and ``on_join`` gives its capacity to the policy."""
        if not self.config.cluster.join_undeclared:
            raise ConfigError(
                f"no worker {msg.worker_id!r} in this runtime's config; declared: {sorted(self._declared)} "
                "(set [cluster] join_undeclared = true for workers to join at run time)"
            )
        if msg.base_model != self.config.model:
            raise ConfigError(f"{msg.worker_id} serves {msg.base_model}; this runtime serves {self.config.model}")
        if msg.memory_gb <= 0 or msg.slots < 1:
            raise ConfigError(f"{msg.worker_id} registered no capacity (memory_gb and slots): update that worker")
        # Not under _cv: on_join takes the job manager's lock, under which the policy asks alive().
        with self._join_lock:
            if msg.worker_id in self._declared:  # another thread admitted it first
                return self._declared[msg.worker_id]
            if msg.role == "learner":
                self.slicers[msg.worker_id] = LearnerSlicer(self.config.learner_slice_idle_s)
                self.batchers[msg.worker_id] = self._batcher(msg.worker_id)
            self.on_join(msg)
            self._declared[msg.worker_id] = msg.role
            self._joined[msg.worker_id] = time.monotonic()
        log.info("worker %s (%s, %g GB, %d slots) joined", msg.worker_id, msg.role, msg.memory_gb, msg.slots)
        return msg.role

    def _note_limits(self, msg: Register) -> None:
        """The base model's limits as its workers read them (the smallest where two disagree):
        what the scheduler checks requests against at its door."""

        def least(a: int, b: int) -> int:
            return min(a, b) if a and b else a or b

        with self._cv:
            known = self.model_limits
            vocab, positions = least(known.vocab_size, msg.vocab_size), least(known.max_positions, msg.max_positions)
            self.model_limits = ModelLimits(vocab, positions)

    def _check_launcher(self, credential: str) -> None:
        if not same(credential, self._launcher):
            raise AuthError("worker token rejected")

    def workers_query(self, msg: WorkersQuery) -> WorkersReply:
        self._check_launcher(msg.credential)
        return WorkersReply(self.workers())

    def supervised(self, msg: ActorsReport) -> ActorsNoted:
        """The local runtime's supervisor reports its actors (see the module docstring)."""
        self._check_launcher(msg.credential)
        with self._cv:
            self._actors = msg.actors
        for actor in msg.actors:
            if actor.name in self._declared and actor.last_exit_time:
                self._exited(actor.name, actor.last_exit_time)
        return ActorsNoted()

    def actors(self) -> list[dict[str, Any]]:
        """The supervised actors as last reported (empty for a scheduler no local runtime launched),
        for tenants: without ``last_error``, a line of a server traceback, which may name paths or
        another tenant's jobs (the operator reads it in the runtime's log)."""
        with self._cv:
            return [{k: v for k, v in dataclasses.asdict(a).items() if k != "last_error"} for a in self._actors]

    def _exited(self, worker_id: str, at: float) -> None:
        """The process of ``worker_id`` that registered before ``at`` exited: fail its calls now."""
        with self._cv:
            h = self._workers.get(worker_id)
            if h is None or h.since > at:  # a later incarnation registered since
                return
        self._mark_exited(h)

    def _mark_exited(self, h: WorkerHandle, how: str = "exited") -> None:
        """The incarnation ``h`` is gone for good (a stale heartbeat of it cannot bring it back)."""
        with self._cv:
            if h.exited:
                return
            h.dead = h.exited = True
            self._cv.notify_all()
        level = logging.INFO if how == "left" else logging.WARNING  # a stop on purpose is no alarm
        log.log(level, "worker %s (incarnation %s) %s; failing its calls in flight", h.worker_id, h.incarnation, how)
        h.client.close()  # its pending calls raise TransportError: Broker.call waits for the restart

    def _client_for(self, msg: Register) -> RpcClient:
        curve = ClientCurve(self._curve[0], self._curve[1], msg.curve_public_key.encode())
        return RpcClient(msg.address, config=self._transport, curve=curve)

    def workers(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._cv:
            return [
                {
                    "worker_id": h.worker_id,
                    "role": h.role,
                    "address": h.address,
                    "incarnation": h.incarnation,
                    "alive": self._alive(h, now),
                    "seen_s_ago": round(now - h.last_seen, 3),
                    "shares_state": h.shares_state,
                }
                for h in self._workers.values()
            ]

    def alive(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is registered and alive now: the policy places new work on such
        workers first (``ClusterState.set_presence``)."""
        with self._cv:
            h = self._workers.get(worker_id)
            return h is not None and self._alive(h, time.monotonic())

    def _alive(self, h: WorkerHandle, now: float) -> bool:
        return not h.dead and now - h.last_seen < max(4 * self.config.worker_heartbeat_s, self.config.worker_silence_s)

    def wait_for(self, worker_id: str, timeout_s: float, not_incarnation: str = "") -> WorkerHandle:
        """The live handle of ``worker_id`` (a different incarnation than ``not_incarnation``)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                h = self._workers.get(worker_id)
                now = time.monotonic()
                if h is not None and self._alive(h, now) and h.incarnation != not_incarnation:
                    return h
                if worker_id not in self._declared:
                    raise WorkerUnavailable(f"worker {worker_id} left the runtime")
                if now >= deadline:
                    raise WorkerUnavailable(f"worker {worker_id} is not available (waited {timeout_s:.0f} s)")
                self._cv.wait(min(0.1, deadline - now))

    def forget_gone(self) -> list[str]:
        """The joined workers not there (registered and alive) for ``[cluster] joined_gone_s``:
        gone for good. Each is forgotten (a later Register joins anew), its calls in flight fail
        over, and ``on_leave`` takes its jobs back to the queue. Declared workers are never
        forgotten: their jobs wait for them, as for a restart."""
        gone_s, now = self.config.cluster.joined_gone_s, time.monotonic()
        with self._cv:
            gone = []
            for worker_id, joined_at in self._joined.items():
                h = self._workers.get(worker_id)
                last = joined_at if h is None else h.last_seen
                if now - last > gone_s and (h is None or not self._alive(h, now)):
                    gone.append(worker_id)
        for worker_id in gone:
            self._forget(worker_id)
            log.warning("worker %s has not been there for %g s: it left the runtime", worker_id, gone_s)
        return gone

    def _forget(self, worker_id: str) -> None:
        """The joined ``worker_id`` left the runtime: forgotten (a later Register joins anew), its
        calls in flight fail over, and ``on_leave`` takes its jobs back to the queue."""
        with self._join_lock:  # as _join: a Register of this id waits for the leave to finish
            if self._joined.pop(worker_id, None) is None:
                return  # forgotten already (a Leave and forget_gone at once)
            self._declared.pop(worker_id, None)
            self.slicers.pop(worker_id, None)
            self.batchers.pop(worker_id, None)
            with self._cv:
                h = self._workers.pop(worker_id, None)
                self._cv.notify_all()
            if h is not None:
                h.client.close()  # its calls in flight fail: they wait no more for it (wait_for)
            self.on_leave(worker_id)

    def close(self) -> None:
        with self._cv:
            handles, self._workers = list(self._workers.values()), {}
        for h in handles:
            h.client.close()

    # --- forwarding ------------------------------------------------------------------------------
    def call(
        self,
        worker_id: str,
        payload: Request[R],
        *,
        prepare: Prepare | list[Prepare] | None = None,
        timeout_s: float | None = None,
        retry: bool = True,
        keyed: bool = False,
        elsewhere: Callable[[], str] | None = None,
    ) -> R:
        """Forward one request, riding out a restart of the worker (see the module docstring); its
        answer, checked to be the reply its class declares.
        ``prepare=(key, fn)`` (or a list of them): run ``fn(handle)`` once per incarnation before the request.
        ``retry=False``: a request that must not run twice fails when its worker dies.
        ``keyed``: the worker answers a resend of ``payload`` (a dataclass with ``attempt``) with its
        first result, so it may go to the same incarnation again.
        ``elsewhere``: for a read (``REPEATABLE``), the worker the policy would send it to now; when
        its worker dies and that is another one, there, the read goes there at once (its
        ``prepare`` runs there first) instead of waiting for the dead one to come back."""
        prepares = [prepare] if isinstance(prepare, tuple) else list(prepare or [])
        kind = kind_of(type(payload))
        deadline = time.monotonic() + self.config.worker_retry_s
        avoid = ""
        reprepared = False
        while True:
            h = self.wait_for(worker_id, max(0.0, deadline - time.monotonic()), not_incarnation=avoid)
            try:
                self._prepare(h, prepares)
                return ask(h.client, payload, timeout_s=timeout_s or self.config.request_timeout_s)
            except RemoteError as exc:
                if exc.code != WorkerFailed.code:
                    if exc.code != NotResident.code or not prepares or reprepared:
                        raise
                    log.info("%s on %s: %s; preparing it again", kind, worker_id, exc)
                    h.prepared.difference_update(key for key, _ in prepares)
                    reprepared = True
                    continue
                self._mark_exited(h)  # this incarnation is ending (not a later one): it answers nothing more
                lost: Exception = exc
            except (PeerDeadError, TransportError) as exc:
                if isinstance(exc, ProtocolError):
                    raise
                with self._cv:
                    h.dead = True
                lost = exc
            other = self._elsewhere(elsewhere, worker_id) if type(payload) in REPEATABLE else None
            if other is not None and time.monotonic() < deadline:
                log.warning("%s to %s failed (%s); sending it to %s", kind, worker_id, lost, other)
                worker_id, avoid = other, ""
                continue
            log.warning("%s to %s failed (%s); waiting for it to come back", kind, worker_id, lost)
            if keyed:  # a keyed message is a dataclass with an attempt count (the docstring's)
                sent: Any = payload
                payload = dataclasses.replace(sent, attempt=sent.attempt + 1)
            elif type(payload) not in REPEATABLE:
                avoid = h.incarnation
            if not retry or time.monotonic() >= deadline:
                raise WorkerUnavailable(f"worker {worker_id} died and did not come back: {lost}") from lost

    @staticmethod
    def _prepare(h: WorkerHandle, prepares: list[Prepare]) -> None:
        for key, fn in prepares:
            if key not in h.prepared:
                fn(h)
                h.prepared.add(key)

    def _elsewhere(self, choose: Callable[[], str] | None, dead: str) -> str | None:
        """The worker ``choose`` names now, when it is another one and alive; else None."""
        if choose is None:
            return None
        try:
            other = choose()
        except PolytinkerError as exc:  # no other worker can take it now (every slot pinned, ...)
            log.info("no other worker for a call to %s: %s", dead, exc)
            return None
        return other if other != dead and self.alive(other) else None


__all__ = ["Broker", "WorkerHandle"]
