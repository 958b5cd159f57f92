"""An in-process runtime: the scheduler, engines and learner groups as objects in this process.

``InprocRuntime(config)`` (a context manager) builds from the same ``RuntimeConfig`` what
``LocalRuntime`` starts as child processes: the ``SchedulerService`` (its policy, jobs and SQLite
state store, in a fresh temporary directory unless ``state_dir`` is set) and each engine and
learner group the config marks ``local`` (``EngineWorker``, ``LearnerWorker``, made by
``build_worker``). It starts no process and binds no socket: every call goes through a
``DirectClient`` (``polytinker.transport.direct``), which runs the handler on the caller's thread
with the codec and the error codes of the wire. So ``ServiceClient(inproc=True)`` answers what
``ServiceClient()`` answers, and a debugger steps from a client call into the scheduler's handler
and on into the learner's or engine's.

The workers register as they do over the wire (a ``Register`` with its proof, again every
``worker_heartbeat_s`` from one thread each); the broker reaches them through direct links
(``Broker.connect``). A learner group serves one call at a time and an engine many (as their
servers do); the scheduler serves at most ``handler_threads`` client calls at once.

Not here: supervision (a handler that raises answers an error; nothing restarts), the HTTP front
door, colocated workers (``colocate = true``), workers that join from elsewhere (``local = false``
ones are never built: jobs placed on them wait), Curve, timeouts of forwarded calls, and the
processes' umask and torch thread count (this process keeps its own; the state directory is
still 0700).
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from typing import Any

from polytinker.engine.models import model_limits
from polytinker.engine.worker.auth import worker_server_curve
from polytinker.engine.worker.layout import read_state_id
from polytinker.engine.worker.messages import Register
from polytinker.engine.worker.server import build_worker
from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.home import private_state_dir
from polytinker.scheduler.service.runtime import prepared
from polytinker.scheduler.service.scheduler import SchedulerService
from polytinker.transport import TransportConfig, ask
from polytinker.transport.direct import DirectClient, Link

log = logging.getLogger("polytinker.scheduler.inproc")


class InprocRuntime:
    """A scheduler, engines and learner groups as objects in this process (see the module docstring)."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        config = config or RuntimeConfig()
        if config.http.address:  # before prepared(), which may make a temporary directory
            raise ConfigError("the HTTP front door needs the process runtime: unset [http] address for inproc")
        if config.colocate:
            raise ConfigError("colocate = true is built for the process runtime: unset it for inproc")
        self.config, self._fresh = prepared(config)
        self.service: SchedulerService | None = None
        self.workers: dict[str, Any] = {}  # worker id -> its EngineWorker or LearnerWorker
        self._links: dict[str, DirectClient] = {}  # worker id -> the broker's link to its handlers
        self._scheduler: DirectClient | None = None
        self._stop = threading.Event()
        self._heartbeats: list[threading.Thread] = []
        self.failure = None  # nothing here dies on its own (LocalRuntime's interface)
        self.dead = threading.Event()

    @property
    def address(self) -> str:
        """'' (nothing listens): ``client()`` is the way in."""
        return ""

    local_address = address

    @property
    def api_key(self) -> str:
        """The API key of the first tenant that has one (the generated ``local`` tenant unless configured)."""
        return self.config.api_key()

    def client(self) -> Link:
        """The scheduler's handlers as a client calls them (a ``Connection``'s ``rpc``)."""
        if self._scheduler is None:
            raise ConfigError("InprocRuntime.client() is available once start() returned")
        return self._scheduler

    def start(self) -> InprocRuntime:
        cfg = self.config
        private_state_dir(cfg.state_path)
        try:
            self.service = SchedulerService(cfg, cfg.worker_token)
            self.service.broker.connect = self._link
            self.service.start("")  # recovers the jobs and runs the scheduling passes; serves no socket
            transport = TransportConfig(handler_threads=cfg.handler_threads, request_timeout_s=cfg.request_timeout_s)
            self._scheduler = DirectClient(
                "scheduler", self.service.handlers(), config=transport, concurrency=cfg.handler_threads
            )
            todo = [("engine", e.engine_id) for e in cfg.engines if e.local]
            todo += [("learner", g.learner_id) for g in cfg.learners if g.local]
            for role, worker_id in todo:
                self._add_worker(role, worker_id)
        except BaseException:
            self.stop()
            raise
        log.info("in-process runtime up (state in %s)", cfg.state_dir)
        return self

    def _add_worker(self, role: str, worker_id: str) -> None:
        """Build the worker, register it once (so it serves when start returns), keep it registered."""
        worker = build_worker(self.config.worker_plan(worker_id))
        self.workers[worker_id] = worker
        # Engines take many concurrent sample requests (the batcher joins them); learners one at a time.
        self._links[worker_id] = DirectClient(worker_id, worker.handlers(), concurrency=0 if role == "engine" else 1)
        register = self._register_message(role, worker_id)
        ask(self.client(), register)
        beat = threading.Thread(target=self._heartbeat, args=(register,), name=f"register-{worker_id}", daemon=True)
        beat.start()
        self._heartbeats.append(beat)

    def _register_message(self, role: str, worker_id: str) -> Register:
        token = self.config.worker_token
        curve_key = worker_server_curve(token, worker_id, None).public_key.decode()  # what a WorkerServer sends
        limits = model_limits(self.config.model)  # build_worker built the model: this reads its config.json
        memory_gb, slots = self.config.worker_plan(worker_id).capacity
        return Register.signed(
            token,
            worker_id=worker_id,
            role=role,
            address=f"direct://{worker_id}",
            incarnation=uuid.uuid4().hex[:12],
            base_model=self.config.model,
            curve_public_key=curve_key,
            vocab_size=limits.vocab_size,
            max_positions=limits.max_positions,
            memory_gb=memory_gb,
            slots=slots,
            state_id=read_state_id(self.config.state_path),  # its workers' root is the scheduler's
        )

    def _heartbeat(self, register: Register) -> None:
        while not self._stop.wait(self.config.worker_heartbeat_s):
            try:
                ask(self.client(), register)
            except Exception as exc:  # the runtime is stopping
                log.debug("%s not re-registered: %s", register.worker_id, exc)

    def _link(self, msg: Register) -> Link:
        """``Broker.connect``: the link to a worker of this runtime (no other worker can register:
        none has a socket to send ``Register`` from)."""
        link = self._links.get(msg.worker_id)
        if link is None:
            raise ConfigError(f"worker {msg.worker_id!r} is not one of this in-process runtime's")
        return link

    def check(self) -> None:
        """Nothing to raise: no part of this runtime stops by itself (``LocalRuntime.check``'s twin)."""

    def actors(self) -> tuple[()]:
        """No supervised actors (``LocalRuntime.actors``'s twin)."""
        return ()

    def stop(self) -> None:
        self._stop.set()
        for beat in self._heartbeats:
            beat.join(5.0)
        self._heartbeats = []
        if self._scheduler is not None:
            self._scheduler.close()
        if self.service is not None:
            self.service.stop()
            self.service = None
        for link in self._links.values():
            link.close()
        workers, self.workers = self.workers, {}
        for worker in workers.values():
            try:
                worker.close()
            except Exception:  # one worker's failure to close must not keep the others open
                log.exception("closing an in-process worker failed")
        if self._fresh:
            shutil.rmtree(self.config.state_dir, ignore_errors=True)

    def __enter__(self) -> InprocRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["InprocRuntime"]
