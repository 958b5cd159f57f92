"""A learner group's followers as Ray actors: ranks 1..K-1 in bundles 1..K-1 of the placement
group whose bundle 0 holds rank 0's actor (``[cluster] backend = "ray"``).

Ray packs a group's K bundles on as few nodes as it can (a placement group's default strategy),
so a group whose ranks do not fit on one node spans several: rank r runs in bundle r, on the
GPUs that bundle reserved (each rank its own first visible device), and dials rank 0's
rendezvous at rank 0's node IP; gloo or NCCL then connect the ranks across the nodes. The
followers are actors that rank 0's actor owns: Ray ends them when rank 0's process ends, and
restarts none of them (``max_restarts=0``). A process group cannot take a rank back, so a
follower that ends before ``close`` (its process or its node lost) breaks the group, as a local
follower's exit does (``follower.Followers``): rank 0's process ends and Ray starts it again in
bundle 0, and it starts new followers in the other bundles, which Ray re-places on a node that
has the resources when theirs was lost.

``ray`` is imported only here, only in a Ray actor's process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from polytinker.engine.learner.follower import JOIN_GRACE_S, Followers

log = logging.getLogger("polytinker.engine.learner.group")
WATCH_S = 0.5  # how often the watcher looks whether a follower's run has ended
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # rank 0's, for every rank


def actor_options(bundle: dict[str, float]) -> tuple[dict[str, Any], float]:
    """The Ray resource options of an actor that holds the whole ``bundle`` (it sees every GPU
    the bundle reserved), and the bundle's CPUs."""
    rest = dict(bundle)
    cpus, gpus, memory = rest.pop("CPU", 0.0), rest.pop("GPU", 0.0), rest.pop("memory", None)
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "resources": rest}
    if memory is not None:
        options["memory"] = memory
    return options, cpus


def node_ip() -> str:
    """This Ray node's IP: where rank 0 listens for its followers, and a Ray worker binds."""
    import ray

    return str(ray.util.get_node_ip_address())


class RayFollower:
    """The body of a follower's actor: ``run`` is the rank's life (``group.follow``)."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)  # before torch loads in this process: rank 0's threads and wait policy

    def run(self, *args: Any) -> None:
        # torch loads here, in the actor's process (this module loads none).
        from polytinker.engine.learner.group import follow

        follow(*args)


class RayFollowerSet(Followers):
    """Ranks 1..K-1 of the group whose rank 0 runs in this Ray actor (see the module docstring).
    ``args``: ``group.follow``'s arguments after the rank and the world size."""

    def __init__(self, name: str, world_size: int, args: tuple[Any, ...], on_broken: Callable[[str], None] | None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(on_broken)
        group = ray.util.get_current_placement_group()
        if group is None or len(group.bundle_specs) < world_size:
            raise RuntimeError(f"{name}: rank 0 is not in a placement group of {world_size} bundles")
        env = {k: os.environ[k] for k in THREAD_ENV if os.environ.get(k)}
        self._actors: list[Any] = []
        self._runs: dict[Any, str] = {}  # a follower's run (an ObjectRef) -> its rank's name
        for rank in range(1, world_size):
            options, _ = actor_options(group.bundle_specs[rank])
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            remote = ray.remote(RayFollower).options(**options, max_restarts=0, scheduling_strategy=strategy)
            actor: Any = remote.remote(env)  # an ActorHandle: its methods are called with .remote
            self._actors.append(actor)
            self._runs[actor.run.remote(rank, world_size, *args)] = f"{name}-rank{rank}"
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-followers", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        import ray

        pending = list(self._runs)
        while pending and not self._closing:
            done, pending = ray.wait(pending, num_returns=1, timeout=WATCH_S)
            for ref in done:
                try:
                    ray.get(ref)
                    detail = "it left the group"
                except Exception as exc:  # its process or its node was lost, or follow() raised
                    detail = f"{type(exc).__name__}"
                self._lost(f"learner group rank {self._runs[ref]} ended (its process or node lost)", detail)

    def close(self) -> None:
        import ray

        self._closing = True
        # After rank 0's stop each run returns (the rank left the process group); then the actors go.
        ray.wait(list(self._runs), num_returns=len(self._runs), timeout=JOIN_GRACE_S)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # its node is gone already
                log.debug("ending a follower: %s", exc)
        self._watcher.join(2 * WATCH_S)


__all__ = ["RayFollower", "RayFollowerSet", "actor_options", "node_ip"]
