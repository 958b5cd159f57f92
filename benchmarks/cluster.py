"""Ray placement (``[cluster] backend = "ray"``) on a Ray cluster of several nodes on this machine
(``ray.cluster_utils.Cluster``, custom resources standing in for GPUs), against the same workers
started locally, in the same run.

    python benchmarks/cluster.py --quick      # 3 measured steps each way
    python benchmarks/cluster.py --steps 10

Prints:

- ``placement_s``: ``LocalRuntime.start`` on Ray, from serve's start to every worker registered
  and counted alive by Ray (placement groups reserved, actors started, models loaded);
  ``placement_groups_s`` the reservation alone; ``local_start_s`` the same start with local workers.
- ``step_local_s``, ``step_ray_s``: the median RL step (forward_backward of a batch, optim_step,
  the new weights' sampler, a sample of it) on each; ``ray_overhead_ratio`` = ray / local
  (target <= 1.05). Both runtimes give each worker the same torch threads (``worker_threads``).
- ``local_restart_s``: SIGKILL of the local engine to a sample of the trained adapter answered
  (the supervisor restarts it; it reloads the adapter); ``node_loss_recovery_s``: the Ray engine's
  node removed (``Cluster.remove_node``, a spare node with its resources already up) to the same
  sample answered from the engine Ray placed again; ``node_loss_vs_local_restart_ratio`` (target <= 2).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import time
from typing import Any

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum, SamplingParams
from polytinker.engine.worker.server import available_cores
from polytinker.scheduler.service import EngineWorkerConfig, LearnerWorkerConfig, LocalRuntime, RuntimeConfig
from polytinker.scheduler.service.cluster import ClusterConfig

MODEL = "tiny-random"
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False}
BUNDLES = {"engine-0": {"CPU": 1, "accel_a": 1}, "learner-0": {"CPU": 1, "accel_b": 1}}
SAMPLE = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
ADAM = AdamParams(learning_rate=1e-2)


def _config(state: str, cluster: ClusterConfig) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        state_dir=state,
        engines=(EngineWorkerConfig(adapter_slots=2, batch_window_s=0.0),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        cluster=cluster,
        worker_threads=available_cores(),  # what a local worker takes by default; Ray's the same
        worker_heartbeat_s=0.5,
        worker_retry_s=120.0,
        max_restarts=2,
    )


def _batch(seed: int, n: int = 8, length: int = 48) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(1, 4000) for _ in range(length + 1)]
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 8 + [1.0] * (length - 8)))
    return out


def _steps(runtime: LocalRuntime, steps: int) -> tuple[float, Any]:
    """The median time of an RL step after one warm-up; and the last step's sampler."""
    with ServiceClient(runtime.address, api_key=runtime.api_key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=8, agent="bench", seed=3)
        times, sampler = [], None
        for i in range(steps + 1):
            t0 = time.monotonic()
            trainer.forward_backward(_batch(i), "cross_entropy").result()
            trainer.optim_step(ADAM).result()
            sampler = trainer.save_weights_and_get_sampling_client()
            sampler.sample([3, 4, 5], 4, SAMPLE).result()
            if i:
                times.append(time.monotonic() - t0)
        path = trainer.save_weights_for_sampler("last").result().path
    return statistics.median(times), path


def _served_after(runtime: LocalRuntime, path: str, t0: float) -> float:
    """Seconds from ``t0`` until the version at ``path`` samples again."""
    with ServiceClient(runtime.address, api_key=runtime.api_key) as service:
        service.create_sampling_client(model_path=path).sample([3, 4, 5], 1, SAMPLE).result(timeout=300)
    return time.monotonic() - t0


def local_phase(steps: int, out: dict[str, float]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cluster-local-") as state:
        t0 = time.monotonic()
        runtime = LocalRuntime(_config(state, ClusterConfig())).start()
        out["local_start_s"] = time.monotonic() - t0
        try:
            out["step_local_s"], path = _steps(runtime, steps)
            pid = runtime.workers["engine-0"].pid
            assert pid is not None
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            out["local_restart_s"] = _served_after(runtime, path, t0)
        finally:
            runtime.stop()


def ray_phase(steps: int, out: dict[str, float]) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(NODE))
    try:
        engine_node = cluster.add_node(**NODE, resources={"accel_a": 1})
        cluster.add_node(**NODE, resources={"accel_b": 1})
        with tempfile.TemporaryDirectory(prefix="bench-cluster-ray-") as state:
            placed = ClusterConfig(backend="ray", address=cluster.address, bundles=BUNDLES)
            t0 = time.monotonic()
            runtime = LocalRuntime(_config(state, placed)).start()
            out["placement_s"] = time.monotonic() - t0
            try:
                out["placement_groups_s"] = runtime.placement.placement_s
                assert runtime.placement.placements()["engine-0"] == engine_node.node_id
                out["step_ray_s"], path = _steps(runtime, steps)
                cluster.add_node(**NODE, resources={"accel_a": 1})  # the spare the engine moves to
                t0 = time.monotonic()
                cluster.remove_node(engine_node)
                out["node_loss_recovery_s"] = _served_after(runtime, path, t0)
            finally:
                runtime.stop()
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 measured steps each way")
    parser.add_argument("--steps", type=int, default=None, help="measured steps each way (default 8, --quick 3)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 8)
    out: dict[str, float] = {}
    local_phase(steps, out)
    ray_phase(steps, out)
    for name in ("placement_s", "placement_groups_s", "local_start_s", "step_local_s", "step_ray_s"):
        print(f"{name}: {out[name]:.3f}")
    print(f"ray_overhead_ratio: {out['step_ray_s'] / out['step_local_s']:.3f}")
    print(f"local_restart_s: {out['local_restart_s']:.2f}")
    print(f"node_loss_recovery_s: {out['node_loss_recovery_s']:.2f}")
    print(f"node_loss_vs_local_restart_ratio: {out['node_loss_recovery_s'] / out['local_restart_s']:.3f}")


if __name__ == "__main__":
    main()
