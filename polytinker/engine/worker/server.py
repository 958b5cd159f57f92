"""Running a worker (engine or learner group) and keeping it registered with the scheduler.

``WorkerServer`` serves a worker's handlers on its own RPC server and re-registers with the
scheduler every ``heartbeat_s`` from a background thread, and at once when its connection to the
scheduler closes: a restarted scheduler learns about it as soon as it is up, and a restarted
worker (new incarnation) is picked up the same way; closed, it tells the scheduler it leaves
(``Leave``), so that its calls fail over and a worker that joined is forgotten now. It always
serves with Curve and admits only the scheduler (keys derived from the worker token, see
``polytinker.engine.worker.auth``): no other process on the host, tenant or not, gets an answer from it. Its
checkpoints and exports live under the state root it is built with (``build_worker``).

A ``WorkerPlan`` is what one worker is built from: its engine or learner config, the base model
and the state root (the scheduler's runtime config makes one per worker: ``RuntimeConfig.worker_plan``).
``WorkerProcess`` is a worker process's one way in, whoever launched it: the worker built from
its plan and served by its ``WorkerServer``. ``EngineActor`` and ``LearnerActor`` are the process
actors the runtime supervises: each makes its ``WorkerProcess`` in ``on_start`` (so ``spawn``
returns once the model is loaded and it is registered) and closes it in ``on_stop``;
``polytinker worker`` runs one in the foreground on another machine, and a Ray actor one on a Ray
node. A worker that breaks as a whole (a learner group that lost a rank) ends its process, each
launcher in its way, so that what supervises it starts it anew.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytinker.actors import Actor
from polytinker.engine.learner.follower import FollowersKind
from polytinker.engine.learner.worker import LearnerWorker
from polytinker.engine.models import model_limits
from polytinker.engine.worker.auth import worker_server_curve
from polytinker.engine.worker.config import EngineWorkerConfig, LearnerWorkerConfig
from polytinker.engine.worker.layout import read_state_id
from polytinker.engine.worker.messages import Leave, Register
from polytinker.errors import ConfigError, WorkerFailed
from polytinker.transport import ClientCurve, RpcClient, RpcServer, TransportConfig, ask

log = logging.getLogger("polytinker.engine.worker")


# Engines take many concurrent sample requests (their batcher joins them); a learner group one at
# a time (its calls must not interleave inside the model).
HANDLER_THREADS = {"engine": 256, "learner": 1}
LEAVE_TIMEOUT_S = 1.0  # how long a stopping worker waits for the scheduler to take its Leave


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
        keypair: tuple[bytes, bytes] | None = None,
        client_curve: ClientCurve | None = None,
        capacity: tuple[float, int] = (0.0, 0),
        state_root: str = "",
    ) -> None:
        self.worker_id, self.role, self.base_model = worker_id, role, base_model
        self._state_root = state_root
        self._state_id = ""  # its state root's state-id, read until found (the scheduler may write it after)
        self.capacity = capacity  # (memory_gb, slots) as its config declares them (Register)
        self.incarnation = uuid.uuid4().hex[:12]
        cfg = TransportConfig(handler_threads=HANDLER_THREADS[role], request_timeout_s=10.0)
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
        self._failing = False  # the last registration failed (the scheduler restarting or gone)
        self._thread = threading.Thread(target=self._loop, name=f"register-{worker_id}", daemon=True)
        self._thread.start()

    def _message(self) -> Register:
        if not self._state_id and self._state_root:
            self._state_id = read_state_id(self._state_root)
        return Register.signed(
            self._token,
            worker_id=self.worker_id,
            role=self.role,
            address=self.server.address,
            incarnation=self.incarnation,
            base_model=self.base_model,
            curve_public_key=self._public,
            vocab_size=self.limits.vocab_size,
            max_positions=self.limits.max_positions,
            memory_gb=self.capacity[0],
            slots=self.capacity[1],
            state_id=self._state_id,
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ask(self._client, self._message(), timeout_s=max(2.0, 4 * self._heartbeat_s))
                if self._failing or not self.registered.is_set():
                    log.info("%s registered with the scheduler at %s", self.worker_id, self._client.address)
                self._failing = False
                self.registered.set()
            except Exception as exc:  # the scheduler may be restarting: keep trying
                if not self._failing:
                    log.warning("%s cannot register with %s: %s", self.worker_id, self._client.address, exc)
                self._failing = True
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        self._leave()
        self._client.close()
        self.server.stop()

    def _leave(self) -> None:
        """Tell the scheduler this process stops (``Leave``), so that it fails its calls over and
        forgets a joined worker now rather than after its silence. Best effort, and brief: a
        scheduler that is gone or not answering does not hold the stop up."""
        if not self.registered.is_set() or self._failing:
            return
        try:
            ask(self._client, Leave.signed(self._token, self.worker_id, self.incarnation), timeout_s=LEAVE_TIMEOUT_S)
        except Exception as exc:  # the scheduler stopped first, or is restarting: it learns from the silence
            log.info("%s could not say it leaves: %s", self.worker_id, exc)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset or
    ``taskset`` narrows), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_threads(ranks: int = 1) -> int:
    """torch's threads in a worker process: ``$OMP_NUM_THREADS`` when set (a local runtime sets
    it for each worker it starts: ``worker_env``), else the cores this process may run on shared
    by the ranks of the worker's learner group (an engine or a one-rank learner takes them all).
    In a training loop the engine samples while the learner waits, and the learner trains while
    the engine waits, so whichever runs gets every core: the main job (`make train`) took
    1 min 41 s with one thread a worker, 1 min 13 s with every core, with the same results; and
    with other processes holding the cores, one thread a worker was slower than every core with
    OpenMP's passive wait policy (docs/benchmarks.md, "contention.py")."""
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, available_cores() // max(1, ranks))


# How long libgomp's threads spin after their work before they sleep: long enough that the next
# of a decode step's back-to-back small ops finds them awake, short enough that a waiting thread
# gives its core back at once to a busy peer (about 1,000 pause loops).
SPIN_COUNT = 1000


def worker_env(threads: int, ranks: int = 1, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a local runtime adds to the environment of a worker process it starts (OpenMP reads
    it when torch loads, so only at spawn): ``OMP_NUM_THREADS`` = ``threads`` when > 0; with 0,
    ``$OMP_NUM_THREADS`` when set, else the cores this runtime may run on (its CPU affinity)
    shared by the worker's ``ranks`` (``worker_threads``). And the wait of OpenMP's threads
    (``omp_wait_env``)."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    elif not environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // max(1, ranks)))
    return env | omp_wait_env(environ)


def omp_wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=SPIN_COUNT``, unless the environment sets
    either. A thread that waits at a barrier for one that another process pre-empted must not spin
    on a core that process needs (on 2 loaded cores, threads spinning libgomp's default 300,000
    loops took a training step 10x the CPU); but with no spin at all (PASSIVE alone), each of a
    decode step's small ops (a mixed batch's LoRA products, index_select, index_add: about 1,000 a
    step) woke the sleeping threads again: 60-360 us an op instead of 5-15, and four clients'
    sampling 1.6x one client's instead of 2.2x (docs/benchmarks.md, "engine.py"). libgomp takes
    GOMP_SPINCOUNT over the policy; another OpenMP runtime reads the policy."""
    if environ.get("OMP_WAIT_POLICY") or environ.get("GOMP_SPINCOUNT"):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker is built from: its config (an engine's or a learner group's), the base
    model it serves, the state root it keeps weights under, and how often it registers."""

    model: str
    state_dir: str
    worker: EngineWorkerConfig | LearnerWorkerConfig
    heartbeat_s: float = 10.0
    # How a learner group's ranks 1..K-1 start: "local", child processes of rank 0 on its machine;
    # "ray", Ray actors in the other bundles of rank 0's placement group (RayPlacement sets it).
    followers: FollowersKind = "local"

    @property
    def role(self) -> str:
        return "engine" if isinstance(self.worker, EngineWorkerConfig) else "learner"

    @property
    def ranks(self) -> int:
        """Processes of this worker that compute at once: a learner group's ranks, or 1."""
        return self.worker.world_size if isinstance(self.worker, LearnerWorkerConfig) else 1

    @property
    def capacity(self) -> tuple[float, int]:
        """(memory_gb, slots) as the config declares them: an engine's adapter slots, a group's max_jobs."""
        w = self.worker
        return (w.memory_gb, w.adapter_slots if isinstance(w, EngineWorkerConfig) else w.max_jobs)

    @property
    def worker_id(self) -> str:
        w = self.worker
        return w.engine_id if isinstance(w, EngineWorkerConfig) else w.learner_id

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for a worker process's start arguments."""
        return {**dataclasses.asdict(self), "role": self.role}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerPlan:
        config = EngineWorkerConfig if d["role"] == "engine" else LearnerWorkerConfig
        followers = d.get("followers", "local")
        if followers not in ("local", "ray"):
            raise ConfigError(f"a worker plan's followers must be 'local' or 'ray', got {followers!r}")
        return cls(d["model"], d["state_dir"], config(**d["worker"]), float(d["heartbeat_s"]), followers)


def set_worker_threads(plan: WorkerPlan) -> None:
    """Give this worker process ``worker_threads`` torch threads: a runtime's worker actor and
    ``polytinker worker`` call it before they build the worker (an in-process runtime does not:
    its threads are the caller's)."""
    import torch

    torch.set_num_threads(worker_threads(plan.ranks))


def build_worker(plan: WorkerPlan, on_broken: Callable[[str], None] | None = None) -> Any:
    """The EngineWorker or LearnerWorker of ``plan``, keeping its checkpoints and exports under
    ``plan.state_dir`` (a local runtime's, or ``polytinker worker --state-dir``): no message
    names a path. ``on_broken(reason)``: the worker broke as a whole (``WorkerProcess``)."""
    if not plan.state_dir:
        raise ConfigError(f"{plan.role} {plan.worker_id}: no state directory to keep weights in")
    root = Path(plan.state_dir).expanduser()
    if isinstance(plan.worker, EngineWorkerConfig):
        # torch loads in an engine's process only: the scheduler and the client read this module.
        from polytinker.engine.inference.worker import EngineWorker

        return EngineWorker(plan.model, plan.worker, root)

    return LearnerWorker(plan.model, plan.worker, root, on_broken, plan.followers)


class WorkerProcess:
    """One worker process's body, whoever launched it (see the module docstring): the worker of
    ``plan`` served at ``bind`` and kept registered with ``scheduler``. ``on_fatal(reason)`` is
    called (on a background thread) when the worker breaks as a whole; it answers ``WorkerFailed``
    from then on, and the launcher ends the process. ``keypair``, ``client_curve``: as
    ``WorkerServer``'s."""

    def __init__(
        self,
        plan: WorkerPlan,
        *,
        scheduler: str,
        token: str,
        on_fatal: Callable[[str], None],
        bind: str = "tcp://127.0.0.1:0",
        keypair: tuple[bytes, bytes] | None = None,
        client_curve: ClientCurve | None = None,
    ) -> None:
        os.umask(0o077)  # checkpoints and adapter exports hold a tenant's weights: this user's alone
        set_worker_threads(plan)
        self.plan = plan
        self.worker = build_worker(plan, on_broken=on_fatal)
        try:
            self.server = WorkerServer(
                worker_id=plan.worker_id,
                role=plan.role,
                base_model=plan.model,
                handlers=self.worker.handlers(),
                scheduler=scheduler,
                token=token,
                bind=bind,
                heartbeat_s=plan.heartbeat_s,
                keypair=keypair,
                client_curve=client_curve,
                capacity=plan.capacity,
                state_root=plan.state_dir,
            )
        except BaseException:
            self.worker.close()
            raise

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self.worker.close()


class _WorkerActor(Actor):
    role = ""

    def __init__(self, plan: dict[str, Any], scheduler: str, token: str) -> None:
        self._plan = WorkerPlan.from_dict(plan)
        if self._plan.role != self.role:
            raise ConfigError(f"a {self.role} actor was given the plan of a {self._plan.role}")
        self._scheduler, self._token = scheduler, token
        self._process: WorkerProcess | None = None

    def on_start(self) -> None:
        self._process = WorkerProcess(self._plan, scheduler=self._scheduler, token=self._token, on_fatal=self._broken)
        self._process.server.registered.wait(30.0)

    def _broken(self, reason: str) -> None:
        # The supervisor restarts a failed actor: a new incarnation, with a whole learner group.
        self.fail_self(WorkerFailed(reason))

    def on_stop(self) -> None:
        if self._process is not None:
            self._process.close()


class EngineActor(_WorkerActor):
    """An inference engine as a supervised process actor."""

    role = "engine"


class LearnerActor(_WorkerActor):
    """A learner group (its rank 0) as a supervised process actor."""

    role = "learner"


__all__ = [
    "HANDLER_THREADS",
    "EngineActor",
    "LearnerActor",
    "WorkerPlan",
    "WorkerProcess",
    "WorkerServer",
    "available_cores",
    "build_worker",
    "set_worker_threads",
    "worker_env",
    "worker_threads",
]
