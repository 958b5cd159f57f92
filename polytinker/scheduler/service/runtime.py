"""Launching a runtime on this machine: the scheduler, engines and learner groups as process actors.

``LocalRuntime(config)`` (a context manager) starts, under one ``Supervisor``:

- the scheduler (``SchedulerActor``), on a fixed address: a port of 0 is resolved to a free port
  once, so a restarted scheduler comes back where clients and workers already look for it;
- each engine and learner group the config marks ``local`` (``EngineActor``, ``LearnerActor``),
  started side by side (each loads the model in its own process).

The supervisor restarts any of them that dies (SIGKILL included); workers re-register and the
scheduler recovers its jobs from SQLite. Each exit and restart is reported to the scheduler
(``ActorsReport``): a worker's exit fails its calls in flight at once, and ``runtime_status``
shows every actor. Every actor is essential (without its scheduler, or an engine or learner its
jobs were placed on, the runtime cannot serve them): when one dies more than
``RuntimeConfig.max_restarts`` times within ``restart_window_s``, the runtime logs one line that
says which and why, stops everything and fails: ``failure`` and ``check()`` hold a
``RuntimeDead``, ``dead`` is set, and ``polytinker serve`` exits non-zero.

The state directory is kept 0700 and the processes write under it with umask 077: it holds
every tenant's weights. It is one runtime's at a time (``home.StateLock``: a second one on it is
refused). With no tenants configured, one tenant ``local`` is created with a fresh API key
(``runtime.api_key``; the jobs of an earlier runtime's ``local`` on that directory stay its own).
``ServiceClient()`` without an address starts one of these for the script, on a persistent
directory it shares with the other scripts of this user (``home.default_state_dir``);
``polytinker serve`` runs one in the foreground.

With ``[cluster] backend = "ray"`` the engines and learner groups are Ray actors instead
(``ray_placement.RayPlacement``): only the scheduler is a child process here, Ray restarts a
worker that dies, and ``actors()`` lists the workers with the node each runs on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polytinker.actors import ActorConfig, ActorRef, ChildReport, RestartPolicy, Supervisor
from polytinker.engine.device import resolve_device
from polytinker.engine.worker.auth import launcher_credential
from polytinker.engine.worker.colocated import ColocatedActor
from polytinker.engine.worker.messages import ActorsReport, ActorState, WorkersQuery
from polytinker.engine.worker.server import EngineActor, LearnerActor, worker_env
from polytinker.errors import ConfigError, RequestTimeout, RuntimeDead
from polytinker.scheduler.service.actor import SchedulerActor
from polytinker.scheduler.service.config import RuntimeConfig, TenantConfig
from polytinker.scheduler.service.home import Holder, StateLock, private_state_dir
from polytinker.scheduler.service.messages import RuntimeStatus
from polytinker.scheduler.service.ray_placement import RayPlacement
from polytinker.scheduler.service.tenants import new_api_key
from polytinker.transport import RpcClient, ask

log = logging.getLogger("polytinker.scheduler.runtime")
REPORT_EVERY_S = 5.0  # the actors' states are sent this often too, so a lost report heals itself


def resolve_address(address: str) -> str:
    """``tcp://HOST:0`` -> ``tcp://HOST:<a free port>``; other addresses unchanged."""
    if not (address.startswith("tcp://") and address.endswith(":0")):
        return address
    host = address[len("tcp://") : -2]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("*", "") else "0.0.0.0", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def prepared(config: RuntimeConfig) -> tuple[RuntimeConfig, bool]:
    """The config with state_dir, address, tenants and worker token filled in; and whether
    state_dir is a fresh temporary directory (removed at stop)."""
    fresh = not config.state_dir
    state_dir = config.state_dir or tempfile.mkdtemp(prefix="polytinker-runtime-")
    tenants = config.tenants or (TenantConfig("local", api_key=new_api_key()),)
    token = config.worker_token or secrets.token_urlsafe(24)
    cfg = dataclasses.replace(
        config, state_dir=state_dir, address=resolve_address(config.address), tenants=tenants, worker_token=token
    )
    return cfg, fresh


class LocalRuntime:
    """A scheduler, engines and learner groups as supervised child processes (see the module docstring)."""

    serves_http = False  # the gateway's HttpRuntime starts the HTTP front door beside it

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        given = config or RuntimeConfig()
        if given.http.address and not self.serves_http:  # before prepared(), which may make a directory
            raise ConfigError(
                "[http] address is set: the HTTP front door is the gateway's; start the runtime with "
                "polytinker.gateway.HttpRuntime (or `polytinker serve --http`), or unset the address"
            )
        self.config, self._fresh = prepared(given)
        self._generated_tenant = not given.tenants  # prepared() made the "local" tenant
        self._state_lock: StateLock | None = None
        self.supervisor: Supervisor | None = None
        self.scheduler: ActorRef | None = None
        self.workers: dict[str, ActorRef] = {}
        self.failure: RuntimeDead | None = None
        self.dead = threading.Event()  # set once an actor stayed down and the runtime has stopped
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()  # a second stop() waits for the first to finish
        self._report_now = threading.Event()
        self._reporting = threading.Event()  # cleared to end the reporter thread
        self._reporter: threading.Thread | None = None
        self.placement: Any = None  # the RayPlacement of the workers, with [cluster] backend = "ray"
        self._colocated: dict[str, tuple[str, ...]] = {}  # a colocated actor's name -> the worker ids it serves

    @property
    def address(self) -> str:
        return self.config.address

    @property
    def local_address(self) -> str:
        """Where this machine's processes reach the scheduler (a Unix socket when it serves with Curve)."""
        return self.config.local_address

    @property
    def api_key(self) -> str:
        """The API key of the first tenant that has one (the generated ``local`` tenant unless configured)."""
        return self.config.api_key()

    def _actor_config(self) -> ActorConfig:
        cfg = self.config
        restart = RestartPolicy(
            max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s, backoff_initial_s=0.1, backoff_max_s=2.0
        )
        return ActorConfig(start_timeout_s=cfg.start_timeout_s, stop_timeout_s=10.0, restart=restart)

    def start(self) -> LocalRuntime:
        cfg = self.config
        on_ray = cfg.cluster.backend == "ray"
        if on_ray:  # no ray installed, or a worker Ray cannot place: fails here, before anything starts
            for wid in [e.engine_id for e in cfg.engines if e.local] + [g.learner_id for g in cfg.learners if g.local]:
                cfg.cluster.bundles_of(cfg.worker_plan(wid))
            self.placement = RayPlacement(cfg, lambda: self._report_now.set(), self._ray_gave_up)
        # A GPU asked for where there is none fails here, not in a worker's log (on Ray: on its node).
        for g in cfg.learners:
            if g.local and not on_ray:
                resolve_device(g.device, g.world_size)
        for e in cfg.engines:
            if e.local and not on_ray:
                resolve_device(e.device)
        run_dir = private_state_dir(cfg.state_path) / "run"
        lock = StateLock(cfg.state_path)
        lock.acquire()  # one runtime per state directory (StateDirInUse names the other)
        self._state_lock = lock
        self.supervisor = Supervisor(
            run_dir=run_dir, name="runtime", on_give_up=self._gave_up, on_change=lambda _: self._report_now.set()
        )
        try:
            self.scheduler = self.supervisor.spawn(
                SchedulerActor,
                cfg.to_dict(),
                cfg.address,
                cfg.worker_token,
                name="scheduler",
                config=self._actor_config(),
            )
            self._reporting.set()
            self._reporter = threading.Thread(target=self._report_loop, name="runtime-report", daemon=True)
            self._reporter.start()
            todo: list[tuple[Any, str]] = [(EngineActor, e.engine_id) for e in cfg.engines if e.local]
            todo += [(LearnerActor, g.learner_id) for g in cfg.learners if g.local]
            if self.placement is not None:
                self.placement.start([wid for _, wid in todo])  # Ray actors: they load and register there
            elif cfg.colocate:
                self._spawn_colocated()
            else:
                with ThreadPoolExecutor(max(1, len(todo))) as pool:  # each loads the model: side by side
                    futures = {wid: pool.submit(self._spawn_worker, cls, wid) for cls, wid in todo}
                    for wid, fut in futures.items():
                        self.workers[wid] = fut.result()
            self.wait_ready([wid for _, wid in todo])
            if self.placement is not None:
                self.placement.wait_alive(cfg.start_timeout_s)
            self._report_now.set()  # every actor is up: the scheduler's view should say so now
            lock.publish(Holder(os.getpid(), self.local_address, self.api_key if self._generated_tenant else ""))
        except BaseException:
            self.stop()
            raise
        log.info("runtime up at %s (state in %s)", cfg.address, cfg.state_dir)
        return self

    def _spawn_worker(self, cls: type, worker_id: str) -> ActorRef:
        assert self.supervisor is not None
        cfg = self.config
        plan = cfg.worker_plan(worker_id)
        # Threads and OpenMP's wait policy are read when torch loads: set at spawn (worker_env).
        env = worker_env(cfg.worker_threads, plan.ranks)
        return self.supervisor.spawn(
            cls,
            plan.to_dict(),
            self.local_address,
            cfg.worker_token,
            name=worker_id,
            config=dataclasses.replace(self._actor_config(), env=tuple(sorted(env.items()))),
        )

    def _spawn_colocated(self) -> None:
        """One ``ColocatedActor`` per engine and learner pair (``RuntimeConfig.colocated_pairs``):
        it registers as both, so each worker id names the one process."""
        assert self.supervisor is not None
        cfg = self.config
        for engine, learner in cfg.colocated_pairs():
            plans = cfg.worker_plan(engine.engine_id), cfg.worker_plan(learner.learner_id)
            name = f"colocated-{engine.engine_id}-{learner.learner_id}"[:100]
            env = worker_env(cfg.worker_threads)
            ref = self.supervisor.spawn(
                ColocatedActor,
                plans[0].to_dict(),
                plans[1].to_dict(),
                self.local_address,
                cfg.worker_token,
                name=name,
                config=dataclasses.replace(self._actor_config(), env=tuple(sorted(env.items()))),
            )
            self.workers[engine.engine_id] = self.workers[learner.learner_id] = ref
            self._colocated[name] = (engine.engine_id, learner.learner_id)

    # --- supervision -----------------------------------------------------------------------------
    def _gave_up(self, report: ChildReport) -> None:
        """The supervisor gave up on an actor (on its thread): fail, and stop the rest."""
        self._fail(RuntimeDead(f"the runtime stopped: {report.describe()}"))

    def _ray_gave_up(self, actor: ActorState) -> None:
        """Ray gave up on a worker's actor (its restarts spent): fail, and stop the rest."""
        where = f" (last on node {actor.node})" if actor.node else ""
        self._fail(
            RuntimeDead(
                f"the runtime stopped: worker {actor.name!r}'s Ray actor is dead, and not restarted again "
                f"({actor.restarts} restarts){where}"
            )
        )

    def _fail(self, failure: RuntimeDead) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        log.error("%s", failure)

        def stop() -> None:
            self.stop()
            self.dead.set()

        threading.Thread(target=stop, name="runtime-stop", daemon=True).start()

    def check(self) -> None:
        """Raise ``RuntimeDead`` if an actor stayed down and the runtime stopped."""
        if self.failure is not None:
            raise RuntimeDead(str(self.failure))

    def actors(self) -> tuple[ActorState, ...]:
        """Each supervised actor's state (empty before start and after stop)."""
        sup = self.supervisor
        if sup is None:
            return ()
        placed = self.placement.actors() if self.placement is not None else ()
        # A colocated actor is reported under each worker id it serves: its exit fails both
        # workers' calls in flight at once, as a separate worker's does.
        return placed + tuple(
            ActorState(
                name,
                r.alive,
                r.pid or 0,
                r.restarts,
                r.gave_up,
                r.last_exit_code,
                r.exits[-1].time if r.exits else 0.0,
                r.last_error,
            )
            for r in sup.report().values()
            for name in self._colocated.get(r.name, (r.name,))
        )

    def _report_loop(self) -> None:
        """Send the actors' states to the scheduler at each exit and restart, and every few seconds."""
        with RpcClient(self.local_address) as client:
            while self._reporting.is_set():
                self._report_now.clear()
                try:
                    report = ActorsReport(launcher_credential(self.config.worker_token), self.actors())
                    ask(client, report, timeout_s=2.0)
                    wait_s = REPORT_EVERY_S
                except Exception as exc:  # the scheduler may be restarting: soon again
                    log.debug("actor report not delivered: %s", exc)
                    wait_s = 0.5
                self._report_now.wait(wait_s)

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The scheduler's ``runtime_status`` (workers, supervised actors, their stats, learner switches)."""
        with RpcClient(self.local_address) as client:
            return ask(client, RuntimeStatus(self.api_key), timeout_s=timeout_s).as_dict()

    def wait_ready(self, worker_ids: list[str], timeout_s: float | None = None) -> None:
        """Wait until the scheduler answers and every worker in ``worker_ids`` is registered and alive."""
        deadline = time.monotonic() + (timeout_s or self.config.start_timeout_s)
        with RpcClient(self.local_address) as client:
            while True:
                self.check()
                try:
                    query = WorkersQuery(launcher_credential(self.config.worker_token))
                    reply = ask(client, query, timeout_s=5.0)
                    alive = {w["worker_id"] for w in reply.workers if w["alive"]}
                    if set(worker_ids) <= alive:
                        return
                except Exception as exc:  # the scheduler may still be starting
                    log.debug("runtime not ready yet: %s", exc)
                if time.monotonic() > deadline:
                    raise RequestTimeout(f"the runtime's workers {worker_ids} did not register in time")
                time.sleep(0.2)

    def stop(self) -> None:
        with self._stop_lock:
            self._reporting.clear()
            self._report_now.set()
            if self._reporter is not None and self._reporter is not threading.current_thread():
                self._reporter.join(5.0)
            with self._lock:
                sup, self.supervisor = self.supervisor, None
            placement, self.placement = self.placement, None
            if placement is not None:
                placement.stop()
            if sup is not None:
                sup.stop()
            lock, self._state_lock = self._state_lock, None
            if lock is not None:
                lock.release()
            if self._fresh:
                shutil.rmtree(self.config.state_dir, ignore_errors=True)

    def __enter__(self) -> LocalRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_servable(config: RuntimeConfig) -> None:
    """Refuse a public address without Curve before starting anything."""
    host = config.address.removeprefix("tcp://").rsplit(":", 1)[0]
    public = config.address.startswith("tcp://") and not host.startswith("127.") and host != "localhost"
    if public and not config.curve_secret_file:
        raise ConfigError(
            f"refusing to serve {config.address} without Curve: set curve_secret_file and curve_clients_dir "
            "(keys from `polytinker keys generate`) or bind 127.0.0.1"
        )


__all__ = ["LocalRuntime", "check_servable", "prepared", "resolve_address"]
