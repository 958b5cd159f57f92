"""A real engine or learner worker in a child process, called the way the scheduler calls it.

``worker_process`` spawns the runtime's own ``EngineActor`` or ``LearnerActor``
(``polytinker.engine.worker.server``): the child builds its ``EngineWorker`` or
``LearnerWorker``, serves ``worker.handlers()`` on its Curve ``WorkerServer`` and registers with a
stand-in scheduler that only records the ``Register``. The test gets an ``RpcClient`` to that
server holding the scheduler's client keys (derived from the worker token, as the broker's are),
and sends it the scheduler's typed worker messages (``polytinker.engine.worker.messages``).
Shared by the tests that check a worker across the process boundary.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
from collections.abc import Iterator
from pathlib import Path

from polytinker.actors import Actor, ActorConfig, spawn
from polytinker.engine.worker import messages as wm
from polytinker.engine.worker.auth import scheduler_client_keypair
from polytinker.engine.worker.replies import Registered
from polytinker.engine.worker.server import EngineActor, LearnerActor
from polytinker.scheduler.service.config import EngineWorkerConfig, LearnerWorkerConfig, RuntimeConfig
from polytinker.transport import ClientCurve, RpcClient, RpcServer, TransportConfig


@contextlib.contextmanager
def worker_process(
    worker: EngineWorkerConfig | LearnerWorkerConfig,
    *,
    model: str,
    state_dir: Path,
    run_dir: Path,
    timeout_s: float = 240.0,
) -> Iterator[RpcClient]:
    """The worker ``worker`` describes, on ``model``, keeping its weights under ``state_dir``;
    yields a client of its RPC server (calls time out after ``timeout_s``), stops it on exit."""
    actor: type[Actor]
    engines: tuple[EngineWorkerConfig, ...] = ()
    learners: tuple[LearnerWorkerConfig, ...] = ()
    if isinstance(worker, EngineWorkerConfig):
        actor, worker_id, engines = EngineActor, worker.engine_id, (worker,)
    else:
        actor, worker_id, learners = LearnerActor, worker.learner_id, (worker,)
    token = secrets.token_hex(16)
    config = RuntimeConfig(
        model=model,
        state_dir=str(state_dir),
        engines=engines,
        learners=learners,
        worker_token=token,
        worker_heartbeat_s=0.5,
    )
    registered: queue.Queue[wm.Register] = queue.Queue()

    def register(msg: wm.Register) -> Registered:
        # The typed answer the worker declares: anything else is a failed registration, and the
        # worker then reports ready only after its 30 s wait for one.
        registered.put(msg)
        return Registered(known=False)

    actor_config = ActorConfig(start_timeout_s=timeout_s, stop_timeout_s=60.0, env=(("OMP_NUM_THREADS", "1"),))
    with RpcServer("tcp://127.0.0.1:0", {"sched.w.register": register}) as scheduler:
        ref = spawn(
            actor,
            config.worker_plan(worker_id).to_dict(),
            scheduler.address,
            token,
            name=worker_id,
            run_dir=run_dir,
            config=actor_config,
        )
        try:
            msg = registered.get(timeout=30)
            public, secret = scheduler_client_keypair(token)
            curve = ClientCurve(public, secret, msg.curve_public_key.encode())
            with RpcClient(msg.address, config=TransportConfig(request_timeout_s=timeout_s), curve=curve) as client:
                yield client
        finally:
            ref.stop()


__all__ = ["worker_process"]
