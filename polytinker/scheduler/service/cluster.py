"""``ClusterConfig``: the ``[cluster]`` table of a runtime config, which says what places the
engines and learner groups the runtime starts (those declared ``local = true``).

- ``backend = "local"`` (the default): child processes of ``polytinker serve`` on this machine,
  under its supervisor (``runtime.LocalRuntime``).
- ``backend = "ray"``: one Ray placement group per engine and per learner group, each worker a
  Ray actor in it (``ray_placement.RayPlacement``; needs the ``ray`` extra). The scheduler stays a
  child process of ``serve`` on this machine, the one authority; a Ray actor runs the same worker
  code as a local worker, dials the scheduler and registers over ZeroMQ with the worker token.

``bundle(plan)`` is the Ray resources of one worker, or of one rank of a learner group:
``[cluster.bundles]`` when it names the worker, else ``{"CPU": cpus_per_bundle}`` plus one ``GPU``
for a worker whose device is ``cuda``. A learner group of world size K asks for K such bundles,
which Ray packs on as few nodes as it can (one node when one has room for all): rank 0's actor
holds bundle 0 and starts rank r as a Ray actor in bundle r (``engine.learner.ray_followers``),
each rank on its own bundle's GPU, NCCL (gloo on CPUs) between the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from polytinker.engine.worker.config import LearnerWorkerConfig
from polytinker.engine.worker.server import WorkerPlan
from polytinker.errors import ConfigError

ClusterBackend = Literal["local", "ray"]
RAY_EXTRA_HINT = "pip install 'polytinker[ray]'"


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: what places the workers the runtime starts (see the module docstring)."""

    backend: ClusterBackend = "local"
    # "local": child processes of serve on this machine; "ray": Ray actors in placement groups.
    address: str = "local"
    # backend = "ray": "local" starts a Ray instance on this machine for the runtime (stopped with
    # it); "auto" joins the one `ray start` runs on this machine; "HOST:PORT" (the head's GCS
    # address) or "ray://HOST:PORT" an existing cluster's.
    cpus_per_bundle: float = 1.0
    # CPUs a bundle asks for when [cluster.bundles] does not name the worker.
    bundles: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per worker id, the resources of one worker (a learner group's: of one rank), e.g.
    # engine-0 = { CPU = 2, GPU = 1 } or a custom resource a node declares (ray start --resources).
    worker_curve_secret_file: str = ""
    # With curve_secret_file (a scheduler that serves with Curve): the `.key_secret` the Ray workers
    # dial the scheduler with (its `.key` in curve_clients_dir). Read by serve, handed to the actors.
    placement_timeout_s: float = 300.0
    # How long serve waits for Ray to reserve a placement group before it fails.
    join_undeclared: bool = False
    # true: an engine or learner group this config does not declare may register (with the worker
    # token: `polytinker worker --config its.toml --id ...`, its own config declaring it) and is
    # placed on from then on, with the memory and slots its config declares; a job no worker there
    # can run waits queued for one to join instead of being rejected. false: only declared ids
    # register (a mistyped --id fails loudly instead of joining as a new worker).
    joined_gone_s: float = 600.0
    # A worker that joined and has not been there (alive and registered) for this long has left
    # for good: its jobs are queued again for the workers that are left (from their last
    # version's checkpoint) and nothing is placed on it any more; it joins anew if it comes back.
    # Declared workers are never forgotten (their jobs wait for them, as for a restart).

    def __post_init__(self) -> None:
        if self.backend not in ("local", "ray"):
            raise ConfigError(f"[cluster] backend must be 'local' or 'ray', got {self.backend!r}")
        if not self.address:
            raise ConfigError("[cluster] address: 'local', 'auto', HOST:PORT or ray://HOST:PORT")
        if not self.cpus_per_bundle >= 0 or not self.placement_timeout_s > 0 or not self.joined_gone_s > 0:
            raise ConfigError("[cluster] cpus_per_bundle must be >= 0, placement_timeout_s and joined_gone_s > 0")
        for worker, resources in self.bundles.items():
            if not resources or any(not v >= 0 for v in resources.values()) or not any(resources.values()):
                raise ConfigError(
                    f"[cluster.bundles] {worker}: name the resources of one bundle, each >= 0 and one > 0, "
                    f"got {resources!r}"
                )

    def check_workers(self, worker_ids: set[str], curve: bool) -> None:
        """Refuse bundles for undeclared workers, and Ray workers that could not reach a Curve scheduler."""
        unknown = sorted(set(self.bundles) - worker_ids)
        if unknown:
            raise ConfigError(f"[cluster.bundles] names {unknown}, not engines or learners of the config")
        if self.backend == "ray" and curve and not self.worker_curve_secret_file:
            raise ConfigError(
                "[cluster] backend = 'ray' with a scheduler that serves with Curve: set worker_curve_secret_file "
                "(a .key_secret whose .key is in curve_clients_dir) for the Ray workers to dial it with"
            )

    def bundle(self, plan: WorkerPlan) -> dict[str, float]:
        """One bundle of ``plan``'s worker (see the module docstring)."""
        if plan.worker_id in self.bundles:
            return {k: float(v) for k, v in self.bundles[plan.worker_id].items() if v > 0}
        resources = {"CPU": float(self.cpus_per_bundle)} if self.cpus_per_bundle > 0 else {}
        if plan.worker.device.startswith("cuda"):
            resources["GPU"] = 1.0
        return resources

    def bundles_of(self, plan: WorkerPlan) -> list[dict[str, float]]:
        """The placement group of ``plan``'s worker: a bundle per process, a learner group's one
        per rank (see the module docstring)."""
        if plan.worker.device.startswith("cuda:"):
            raise ConfigError(
                f"{plan.worker_id}: device {plan.worker.device!r}, but on Ray a worker sees only the GPUs of "
                "its own bundle: use device = 'cuda' (or 'auto')"
            )
        return [self.bundle(plan) for _ in range(ranks_of(plan))]


def ranks_of(plan: WorkerPlan) -> int:
    """How many processes ``plan``'s worker runs: a learner group's world size, else 1."""
    return plan.worker.world_size if isinstance(plan.worker, LearnerWorkerConfig) else 1


__all__ = ["RAY_EXTRA_HINT", "ClusterBackend", "ClusterConfig", "ranks_of"]
