"""Placing a runtime's engines and learner groups through Ray (``[cluster] backend = "ray"``).

Ray only places processes and keeps them alive; ZeroMQ stays the data plane and the scheduler
the one authority. ``RayPlacement.start`` asks Ray for one placement group per worker the config
marks ``local`` (``ClusterConfig.bundles_of``: one bundle, a learner group of world size K's K
bundles, one per rank, packed on as few nodes as Ray can), waits until every group is reserved,
then starts each worker as a Ray actor (``RayWorker``) that holds bundle 0. A learner group's
rank 0 starts its ranks 1..K-1 as Ray actors in the other bundles, on whichever nodes hold them
(``engine.learner.ray_followers``); ``rank_nodes`` says where each rank landed.
The actor runs the same code as a local worker process (``WorkerProcess``): it binds on its
node's IP, dials the scheduler and registers over ZeroMQ with the worker token, Curve keys
derived from it.

Ray restarts an actor that dies, its node's loss included, up to ``RuntimeConfig.max_restarts``
times (over the actor's life, not within a window as the local supervisor counts), in its
placement group, which Ray moves to a node that has the resources. The restarted worker is a new
incarnation and registers as a restarted local worker does: the scheduler reloads what it held
from the checkpoints. A monitor thread follows each actor through Ray's public task API alone
(no dashboard needed, no internal table read): a call to ``life``, which never returns, fails
the moment the actor's process or node is lost; a call to ``where``, retried by Ray through the
restart, answers once the new incarnation is registered (its node, pid and incarnation: one
restart counted), or fails once Ray gives up on the actor. Each change is reported at once
(``on_change``): the runtime sends it to the scheduler (``ActorsReport``), so the calls in flight
to a lost worker fail over without waiting for its connection to go silent. An actor Ray gives up
on (``DEAD``) is handed to ``on_give_up``: the runtime stops, as when its supervisor gives up on
a local worker.

``ray`` is an optional dependency (the ``ray`` extra); this module imports it only when placing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polytinker.engine.learner.ray_followers import actor_options, node_ip
from polytinker.engine.worker.messages import ActorState
from polytinker.engine.worker.server import WorkerPlan, WorkerProcess, omp_wait_env
from polytinker.errors import ConfigError, RequestTimeout
from polytinker.scheduler.service.cluster import RAY_EXTRA_HINT, ranks_of
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport import ClientCurve, load_keypair

log = logging.getLogger("polytinker.scheduler.ray")
POLL_S = 0.5  # how long the monitor waits for an actor's call before it reads the placement groups again
NAMESPACE = "polytinker"


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError naming the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"[cluster] backend = 'ray' needs the ray package: {RAY_EXTRA_HINT}") from exc
    return ray


class RayWorker:
    """The body of a worker's Ray actor: what a local worker process runs (``EngineActor``,
    ``LearnerActor``), built in ``__init__`` so Ray counts the actor alive once it is registered."""

    def __init__(self, plan: dict[str, Any], scheduler: str, token: str, env: dict[str, str], curve: Any) -> None:
        os.environ.update(env)  # before torch loads in this process: its threads, OpenMP's wait policy
        self._process = WorkerProcess(
            WorkerPlan.from_dict(plan),
            scheduler=scheduler,
            token=token,
            on_fatal=self._broken,
            bind=f"tcp://{node_ip()}:0",  # the scheduler may be on another node
            client_curve=ClientCurve(*curve) if curve else None,
        )
        self._process.server.registered.wait(30.0)

    @staticmethod
    def _broken(reason: str) -> None:
        # An actor process that exits abnormally is one Ray restarts (its max_restarts): a new
        # incarnation, with a whole learner group. exit_actor would be a wanted exit, not restarted.
        log.error("%s; ending this worker's process for Ray to start it again", reason)
        os._exit(1)

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        node = f"{node_ip()}/{ctx.get_node_id()}"
        return {"node": node, "pid": os.getpid(), "incarnation": self._process.server.incarnation}

    def life(self) -> None:
        """Never returns: the call fails when this actor's process or node is lost (the monitor's
        sign that it left), and a new one waits on its next incarnation."""
        threading.Event().wait()


@dataclass
class _Placed:
    """One worker's placement group and actor, and what the monitor last read of it."""

    worker_id: str
    group: Any
    actor: Any
    state: str = "PENDING_CREATION"
    node: str = ""  # "IP/NODE_ID" of the node it last ran on
    ranks: int = 1  # a learner group's world size: its placement group's bundles
    others: str = ""  # where a group's ranks 1..K-1 run when not on rank 0's node ("rank 1 on NODE_ID")
    pid: int = 0
    incarnation: str = ""
    restarts: int = 0
    last_exit_time: float = 0.0
    # The monitor's call in flight: ``life`` while the actor is ALIVE (until its process ends),
    # else ``where`` (retried through restarts) until the actor answers.
    call: Any = None
    ask_again_at: float = 0.0  # after a where() that raised: not before then (monotonic seconds)


class RayPlacement:
    """The Ray placement of a runtime's workers (see the module docstring)."""

    def __init__(
        self,
        config: RuntimeConfig,
        on_change: Callable[[], None] = lambda: None,
        on_give_up: Callable[[ActorState], None] = lambda _: None,
    ) -> None:
        self.config = config
        self._on_change, self._on_give_up = on_change, on_give_up
        self._ray = import_ray()
        self._started_ray = False
        self._placed: dict[str, _Placed] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.placement_s = 0.0  # placement groups asked for to all reserved
        self._run = secrets.token_hex(4)

    def start(self, worker_ids: list[str]) -> RayPlacement:
        ray, cluster = self._ray, self.config.cluster
        if not ray.is_initialized():
            if cluster.address == "local":
                ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=True)
            self._started_ray = True
        from ray.util.placement_group import placement_group

        plans = [self.config.worker_plan(w) for w in worker_ids]
        t0 = time.monotonic()
        groups = {p.worker_id: placement_group(cluster.bundles_of(p)) for p in plans}
        for wid, group in groups.items():
            left = cluster.placement_timeout_s - (time.monotonic() - t0)
            if not group.wait(max(1.0, left)):
                raise RequestTimeout(
                    f"Ray reserved no node for {wid} ({group.bundle_specs}) within "
                    f"{cluster.placement_timeout_s:.0f} s: no node of the cluster has those resources free"
                )
        self.placement_s = time.monotonic() - t0
        scheduler, curve = self._scheduler_address(), self._worker_curve()
        for plan in plans:
            actor = self._actor(plan, groups[plan.worker_id], scheduler, curve)
            placed = _Placed(plan.worker_id, groups[plan.worker_id], actor, ranks=ranks_of(plan))
            placed.call = self._ask_where(actor)
            self._placed[plan.worker_id] = placed
        self._monitor = threading.Thread(target=self._watch, name="ray-placement", daemon=True)
        self._monitor.start()
        return self

    def _actor(self, plan: WorkerPlan, group: Any, scheduler: str, curve: Any) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        options, cpus = actor_options(group.bundle_specs[0])
        threads = cfg.worker_threads or max(1, int(cpus))  # rank 0's bundle's CPUs (each rank has its own)
        env = {"OMP_NUM_THREADS": str(threads), **omp_wait_env(os.environ)}
        env |= {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if os.environ.get(k)}
        options |= {
            "name": f"polytinker-{plan.worker_id}-{self._run}",  # unique per runtime: two may share a cluster
            "max_restarts": cfg.max_restarts,
            "max_concurrency": 2,  # where() answers while life() holds the actor's other thread
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        }
        remote = self._ray.remote(RayWorker).options(**options)
        if ranks_of(plan) > 1:
            plan = dataclasses.replace(plan, followers="ray")  # its ranks in the group's other bundles
        return remote.remote(plan.to_dict(), scheduler, cfg.worker_token, env, curve)

    def _scheduler_address(self) -> str:
        """The scheduler's address as another node dials it (a wildcard host is this node's IP)."""
        address = self.config.address
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if address.startswith("tcp://") and host in ("0.0.0.0", "*", ""):
            return f"tcp://{self._ray.util.get_node_ip_address()}:{port}"
        return address

    def _worker_curve(self) -> tuple[bytes, bytes, bytes] | None:
        """(public, secret, scheduler's public) for Ray workers that dial a Curve scheduler."""
        cfg = self.config
        if not cfg.curve_secret_file:
            return None

        public, secret = load_keypair(cfg.cluster.worker_curve_secret_file)
        if secret is None:
            raise ConfigError(
                f"[cluster] worker_curve_secret_file {cfg.cluster.worker_curve_secret_file}: no secret key"
            )
        return public, secret, load_keypair(cfg.curve_secret_file)[0]

    # --- monitoring ---------------------------------------------------------------------------------
    @staticmethod
    def _ask_where(actor: Any) -> Any:
        # Retried by Ray while the actor restarts: it fails only once Ray gives up on the actor.
        return actor.where.options(max_task_retries=-1).remote()

    def _watch(self) -> None:
        while not self._stop.is_set():
            gave_up = self._poll()
            for placed in gave_up:
                self._on_give_up(self._actor_state(placed))
                return

    def _poll(self) -> list[_Placed]:
        """Wait up to ``POLL_S`` for the actors' calls; take in those that ended and where each
        learner group's ranks run; report a change; the actors Ray gave up on."""
        ray, now = self._ray, time.monotonic()
        for placed in list(self._placed.values()):
            if placed.call is None and placed.state != "DEAD" and 0 < placed.ask_again_at <= now:
                placed.call, placed.ask_again_at = self._ask_where(placed.actor), 0.0
        calls = {p.call: p for p in list(self._placed.values()) if p.call is not None}
        done: list[Any] = []
        if calls:
            done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=POLL_S, fetch_local=False)
        else:
            self._stop.wait(POLL_S)
        changed, gave_up = False, []
        for ref in done:
            placed = calls[ref]
            try:
                answer = ray.get(ref)
                failure = None
            except Exception as exc:  # the actor's process or node was lost, or Ray gave up on it
                answer, failure = None, exc
            changed |= self._note(placed, answer, failure)
            if placed.state == "DEAD":
                gave_up.append(placed)
        for placed in list(self._placed.values()):
            changed |= self._note_ranks(placed)
        if changed:
            self._on_change()
        return gave_up

    def wait_alive(self, timeout_s: float) -> None:
        """Until every actor answered (a worker registers from its actor's constructor, a moment
        before): ``placements()`` then names every node."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                states = [p.state for p in self._placed.values()]
            if all(state == "ALIVE" for state in states):
                return
            if "DEAD" in states or time.monotonic() > deadline:
                raise RequestTimeout(f"Ray did not start every worker's actor: {self.placements()}")
            time.sleep(0.1)

    def _note(self, placed: _Placed, answer: dict[str, Any] | None, failure: Exception | None) -> bool:
        """Take in how the monitor's call to ``placed`` ended (``where``'s answer, or its failure
        or ``life``'s) and make the next call; True when something ``polytinker status`` shows
        changed."""
        with self._lock:
            before = (placed.state, placed.restarts, placed.node, placed.pid)
            if self._stop.is_set():
                placed.call = None
            elif placed.state == "ALIVE":  # its life() ended: it left its process (or its node); Ray restarts it
                placed.state, placed.last_exit_time = "RESTARTING", time.time()
                placed.call = self._ask_where(placed.actor)
                log.warning("%s's Ray actor left its process (%s)", placed.worker_id, type(failure).__name__)
            elif isinstance(failure, self._ray.exceptions.RayActorError):  # Ray stopped retrying: no restart left
                placed.state, placed.call = "DEAD", None
                log.error("Ray gave up on %s's actor: %s", placed.worker_id, failure)
            elif answer is None:  # where() itself raised: the actor lives; ask again a poll later
                placed.call, placed.ask_again_at = None, time.monotonic() + POLL_S
                log.warning("%s's actor did not say where it runs: %s", placed.worker_id, failure)
            else:
                if placed.incarnation and answer["incarnation"] != placed.incarnation:
                    placed.restarts += 1
                if placed.node and placed.node != answer["node"]:
                    log.warning("%s re-placed on node %s", placed.worker_id, answer["node"])
                placed.state, placed.node, placed.pid = "ALIVE", str(answer["node"]), int(answer["pid"])
                placed.incarnation = str(answer["incarnation"])
                placed.call = placed.actor.life.remote()
            return before != (placed.state, placed.restarts, placed.node, placed.pid)

    def _note_ranks(self, placed: _Placed) -> bool:
        """Take in where a learner group's other ranks run; True when that changed."""
        if placed.ranks == 1 or placed.state != "ALIVE":
            return False
        try:
            nodes = self.rank_nodes(placed.worker_id)
        except Exception as exc:  # the head may be gone for a moment
            log.debug("reading %s's placement group: %s", placed.worker_id, exc)
            return False
        rank0 = placed.node.rpartition("/")[2]
        others = "; ".join(f"rank {r} on {n or 'no node'}" for r, n in enumerate(nodes) if r and n != rank0)
        with self._lock:
            before, placed.others = placed.others, others
        return before != others

    def _actor_state(self, placed: _Placed) -> ActorState:
        alive = placed.state == "ALIVE"
        return ActorState(
            placed.worker_id,
            alive,
            placed.pid if alive else 0,
            placed.restarts,
            placed.state == "DEAD",
            None,  # Ray does not say how a process ended
            placed.last_exit_time,
            "",
            f"{placed.node} ({placed.others})" if placed.node and placed.others else placed.node,
        )

    def actors(self) -> tuple[ActorState, ...]:
        """Each placed worker as ``polytinker status`` shows it (its node: ``IP/NODE_ID``; a
        learner group's rank 0's, then where its other ranks run when elsewhere)."""
        with self._lock:
            return tuple(self._actor_state(p) for p in self._placed.values())

    def placements(self) -> dict[str, str]:
        """worker id -> the Ray node id it runs on ("" while it is not running)."""
        with self._lock:
            return {w: p.node.rpartition("/")[2] if p.state == "ALIVE" else "" for w, p in self._placed.items()}

    def rank_nodes(self, worker_id: str) -> list[str]:
        """The Ray node id of each bundle of ``worker_id``'s placement group, rank 0 first: where
        each of a learner group's ranks runs ("" for a bundle Ray holds on no node now)."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self._placed[worker_id].group)
        where = table.get("bundles_to_node_id", {})
        return [str(where.get(i, "")) for i in range(len(table.get("bundles", {})))]

    def stop(self) -> None:
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(5.0)
        ray = self._ray
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for placed in self._placed.values():
            try:
                ray.kill(placed.actor, no_restart=True)
                remove_placement_group(placed.group)
            except Exception as exc:  # the cluster may already be gone
                log.debug("releasing %s: %s", placed.worker_id, exc)
        self._placed.clear()
        if self._started_ray:
            ray.shutdown()


__all__ = ["RayPlacement", "RayWorker", "import_ray"]
