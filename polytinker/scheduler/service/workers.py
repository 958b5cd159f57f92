"""Running a worker (engine or learner group) and keeping it registered with the scheduler.

``WorkerServer`` serves a worker's handlers on its own RPC server and re-registers with the
scheduler every ``heartbeat_s`` from a background thread, and at once when its connection to the
scheduler closes: a restarted scheduler learns about it as soon as it is up, and a restarted
worker (new incarnation) is picked up the same way. It always
serves with Curve and admits only the scheduler (keys derived from the worker token, see
``polytinker.engine.worker.auth``): no other process on the host, tenant or not, gets an answer from it. Its
checkpoints and exports live under the state root it is built with (``build_worker``).

``EngineActor`` and ``LearnerActor`` are the process actors the runtime supervises: each builds
its worker in ``on_start`` (so ``spawn`` returns once the model is loaded and it is registered)
and tears it down in ``on_stop``. ``polytinker worker`` runs the same ``WorkerServer`` in the
foreground on another machine.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from polytinker.actors import Actor
from polytinker.engine.models import model_limits
from polytinker.engine.worker.auth import register_proof, worker_server_curve
from polytinker.engine.worker.messages import Register
from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport import ClientCurve, RpcClient, RpcServer, TransportConfig

log = logging.getLogger("polytinker.scheduler.workers")


class WorkerServer:
    """Serve ``handlers`` at ``bind`` (with Curve: only the scheduler is admitted) and keep
    ``worker_id`` registered with the scheduler. ``keypair``: the worker's own Curve keys (public,
    secret) to serve with instead of the ones derived from ``token``; ``client_curve``: how to reach
    a scheduler that serves with Curve."""

    def __init__(
        self,
        *,
        worker_id: str,
        role: str,
        base_model: str,
        handlers: dict[str, Callable[[Any], Any]],
        scheduler: str,
        token: str,
        bind: str = "tcp://127.0.0.1:0",
        heartbeat_s: float = 0.5,
        handler_threads: int = 1,
        keypair: tuple[bytes, bytes] | None = None,
        client_curve: ClientCurve | None = None,
    ) -> None:
        self.worker_id, self.role, self.base_model = worker_id, role, base_model
        self.incarnation = uuid.uuid4().hex[:12]
        cfg = TransportConfig(handler_threads=handler_threads, request_timeout_s=10.0)
        curve = worker_server_curve(token, worker_id, keypair)
        self.server = RpcServer(bind, handlers, config=cfg, curve=curve).start()
        self._public = curve.public_key.decode()
        self.limits = model_limits(base_model)  # the worker built the model: this reads its config.json
        # A scheduler that restarts knows no worker: register again as soon as the connection
        # closes (the request waits in the socket for the new scheduler), not a heartbeat later.
        self._wake = threading.Event()
        self._client = RpcClient(scheduler, config=cfg, curve=client_curve, on_lost=self._wake.set)
        self._token, self._heartbeat_s = token, heartbeat_s
        self._stop = threading.Event()
        self.registered = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"register-{worker_id}", daemon=True)
        self._thread.start()

    def _message(self) -> Register:
        fields = (
            *(self.worker_id, self.role, self.server.address, self.incarnation, self.base_model, self._public),
            *(self.limits.vocab_size, self.limits.max_positions),
        )
        return Register(register_proof(self._token, *fields), *fields)

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self._client.call("sched.w.register", self._message(), timeout_s=max(2.0, 4 * self._heartbeat_s))
                if failing or not self.registered.is_set():
                    log.info("%s registered with the scheduler at %s", self.worker_id, self._client.address)
                failing = False
                self.registered.set()
            except Exception as exc:  # the scheduler may be restarting: keep trying
                if not failing:
                    log.warning("%s cannot register with %s: %s", self.worker_id, self._client.address, exc)
                failing = True
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        self._client.close()
        self.server.stop()


def worker_threads(ranks: int = 1) -> int:
    """torch's threads in a worker process: ``$OMP_NUM_THREADS`` when set, else this machine's
    cores shared by the ranks of the worker's learner group (an engine or a one-rank learner
    takes them all). In a synchronous training loop the engine samples while the learner waits,
    and the learner trains while the engine waits, so whichever runs gets every core: the main
    job (`make train`) took 1 min 41 s with one thread a worker, 1 min 13 s with every core, with
    the same results. Where workers do run at once (several experiments on one runtime,
    asynchronous loops), set ``$OMP_NUM_THREADS`` to share the cores out instead."""
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, ranks))


def set_worker_threads(role: str, worker_id: str, config: RuntimeConfig) -> None:
    """Give this worker process ``worker_threads`` torch threads: a runtime's worker actor and
    ``polytinker worker`` call it before they build the worker (an in-process runtime does not:
    its threads are the caller's)."""
    import torch

    ranks = next((g.world_size for g in config.learners if g.learner_id == worker_id), 1) if role == "learner" else 1
    torch.set_num_threads(worker_threads(ranks))


def build_worker(role: str, worker_id: str, config: RuntimeConfig) -> Any:
    """The EngineWorker or LearnerWorker that ``worker_id`` names in ``config``, keeping its
    checkpoints and exports under ``config.state_dir`` (a local runtime's, or ``polytinker worker
    --state-dir``): no message names a path."""
    root = config.state_path
    if role == "engine":
        from polytinker.engine.inference.worker import EngineWorker

        for e in config.engines:
            if e.engine_id == worker_id:
                return EngineWorker(config.model, e, root)
    elif role == "learner":
        from polytinker.engine.learner.worker import LearnerWorker

        for g in config.learners:
            if g.learner_id == worker_id:
                return LearnerWorker(config.model, g, root)
    raise ConfigError(f"no {role} {worker_id!r} in the runtime config")


class _WorkerActor(Actor):
    role = ""

    def __init__(self, config: dict[str, Any], worker_id: str, scheduler: str, token: str) -> None:
        self._config = RuntimeConfig.from_dict(config)
        self._worker_id, self._scheduler, self._token = worker_id, scheduler, token
        self._worker: Any = None
        self._server: WorkerServer | None = None

    def on_start(self) -> None:
        os.umask(0o077)  # checkpoints and adapter exports hold a tenant's weights: this user's alone

        set_worker_threads(self.role, self._worker_id, self._config)
        self._worker = build_worker(self.role, self._worker_id, self._config)
        # Engines take many concurrent sample requests (the batcher joins them); learners one at a time.
        threads = 256 if self.role == "engine" else 1
        self._server = WorkerServer(
            worker_id=self._worker_id,
            role=self.role,
            base_model=self._config.model,
            handlers=self._worker.handlers(),
            scheduler=self._scheduler,
            token=self._token,
            heartbeat_s=self._config.worker_heartbeat_s,
            handler_threads=threads,
        )
        self._server.registered.wait(30.0)

    def on_stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._worker is not None:
            self._worker.close()


class EngineActor(_WorkerActor):
    """An inference engine as a supervised process actor."""

    role = "engine"


class LearnerActor(_WorkerActor):
    """A learner group (its rank 0) as a supervised process actor."""

    role = "learner"


__all__ = ["EngineActor", "LearnerActor", "WorkerServer", "build_worker", "set_worker_threads", "worker_threads"]
