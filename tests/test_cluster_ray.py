"""``[cluster] backend = "ray"``: a runtime's engine and learner group placed on the nodes of a Ray
cluster that declare the resources their bundles ask for (custom resources stand in for GPUs),
the learner group's two ranks on two nodes (no node has room for both), a short training run
through the client, and lost nodes (the engine's, then the learner follower's) whose workers
Ray places again.

The cluster is ``ray.cluster_utils.Cluster``: a head and three Ray nodes (raylets) on this
machine, each with its own resources; ``remove_node`` kills one with its processes, as a lost
machine."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from polytinker.cli import main as cli_main
from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.learner.ray_followers import actor_options
from polytinker.engine.types import Datum, SamplingParams
from polytinker.errors import ConfigError
from polytinker.scheduler.service import EngineWorkerConfig, LearnerWorkerConfig, LocalRuntime, RuntimeConfig
from polytinker.scheduler.service.cluster import ClusterConfig
from polytinker.scheduler.service.ray_placement import RayPlacement, _Placed
from polytinker.transport.auth import generate_keypair

MODEL = "tiny-random"
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False}
BUNDLES = {"engine-0": {"CPU": 1, "accel_a": 1}, "learner-0": {"CPU": 0.5, "accel_b": 1}}
SHORT = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
# Long enough to be still generating when the engine's node is removed half a second in.
LONG = SamplingParams(max_tokens=1500, temperature=1.0, ignore_eos=True, seed=1)
DATA = [Datum([5, 17, 230, 1400, 9, 33], [17, 230, 1400, 9, 33, 8], [0.0, 1.0, 1.0, 1.0, 1.0, 1.0])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(state: Path, address: str) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        state_dir=str(state),
        engines=(EngineWorkerConfig(adapter_slots=2, batch_window_s=0.0),),
        # Two ranks, a bundle each: one accel_b a node, so they run on two nodes.
        learners=(LearnerWorkerConfig(world_size=2, micro_batch_size=4),),
        cluster=ClusterConfig(backend="ray", address=address, bundles=BUNDLES, placement_timeout_s=60.0),
        worker_heartbeat_s=0.5,
        worker_retry_s=120.0,
        start_timeout_s=150.0,
        max_restarts=2,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    c = cluster_utils.Cluster(initialize_head=True, connect=False, head_node_args=dict(NODE))
    try:
        c.nodes_by_resource = {
            "accel_a": c.add_node(**NODE, resources={"accel_a": 1}),
            "accel_b": c.add_node(**NODE, resources={"accel_b": 1}),
            "accel_b2": c.add_node(**NODE, resources={"accel_b": 1}),
        }
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def runtime(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRuntime]:
    rt = LocalRuntime(_config(tmp_path_factory.mktemp("ray-runtime"), cluster.address))
    t0 = time.monotonic()
    rt.start()
    print(f"placed and registered in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    try:
        yield rt
    finally:
        rt.stop()


def _train_and_sample(service: ServiceClient, agent: str) -> Any:
    trainer = service.create_lora_training_client(MODEL, rank=4, agent=agent, seed=3)
    first = trainer.forward_backward(DATA, "cross_entropy").result()
    assert first.loss_fn_outputs, first
    assert trainer.optim_step(AdamParams(learning_rate=1e-2)).result().version == 1
    sampler = trainer.save_weights_and_get_sampling_client()
    assert sampler.sample([3, 4, 5], 1, SHORT).result().sequences[0].tokens
    return trainer, sampler


@pytest.mark.timeout(240)
def test_serve_places_the_engine_and_learner_on_the_nodes_with_their_resources(
    cluster: Any, runtime: LocalRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    placed = runtime.placement.placements()
    accel_b = {cluster.nodes_by_resource[k].node_id for k in ("accel_b", "accel_b2")}
    assert placed["engine-0"] == cluster.nodes_by_resource["accel_a"].node_id
    ranks = runtime.placement.rank_nodes("learner-0")
    assert ranks[0] == placed["learner-0"] and set(ranks) == accel_b  # rank 1 on the other node
    status = runtime.status()
    rows = {a["name"]: a for a in status["actors"]}
    assert rows["engine-0"]["alive"] and rows["engine-0"]["node"].endswith(placed["engine-0"])
    rank1 = ranks[1]
    assert rows["learner-0"]["node"].endswith(f"{placed['learner-0']} (rank 1 on {rank1})")
    assert rows["scheduler"]["node"] == ""  # a child process of serve, on this machine
    workers = {w["worker_id"]: w for w in status["workers"]}
    assert workers.keys() == {"engine-0", "learner-0"} and all(w["alive"] for w in workers.values())
    with ServiceClient(runtime.address, api_key=runtime.api_key) as service, ThreadPoolExecutor(2) as pool:
        # Two agents at once: their calls meet on the group whose ranks are on two nodes.
        for done in [pool.submit(_train_and_sample, service, agent) for agent in ("alice", "bob")]:
            done.result(timeout=180)
    assert cli_main(["status", "--scheduler", runtime.address, "--api-key", runtime.api_key]) == 0
    actors_table = capsys.readouterr().out.split("\nWORKER")[0]  # the actors' rows, before the workers'
    table = {line.split()[0]: line for line in actors_table.splitlines()}
    assert table["engine-0"].endswith(rows["engine-0"]["node"]) and table["scheduler"].endswith("this machine")


@pytest.mark.timeout(300)
def test_lost_nodes_workers_are_placed_again_and_the_run_goes_on(cluster: Any, runtime: LocalRuntime) -> None:
    with ServiceClient(runtime.address, api_key=runtime.api_key) as service:
        trainer, sampler = _train_and_sample(service, "survivor")
        # The engine's node goes while samples are in flight: they are sent again to the engine
        # Ray places on the replacement node, which loads the adapter again.
        in_flight = [sampler.sample([3, 4, 5], 1, LONG) for _ in range(2)]
        time.sleep(0.5)
        assert not any(f.done() for f in in_flight)
        cluster.remove_node(cluster.nodes_by_resource["accel_a"])
        replacement = cluster.add_node(**NODE, resources={"accel_a": 1})
        results = [f.result(timeout=180) for f in in_flight]
        assert all(len(r.sequences[0].tokens) == LONG.max_tokens for r in results)
        _wait_placed(runtime, "engine-0", replacement.node_id)
        rows = {a["name"]: a for a in runtime.status()["actors"]}
        assert rows["engine-0"]["restarts"] == 1 and rows["engine-0"]["last_exit_time"] > 0
        assert service.runtime_status()["stats"]["engine-0"]["adapter_loads"] >= 1
        # The node of the learner group's rank 1 goes between steps: the group is broken (a
        # process group cannot take a rank back), rank 0's actor starts again and its new rank 1
        # runs where Ray re-placed that bundle; the group reloads the adapter from its step-1
        # checkpoint; no step is lost or repeated.
        before = trainer.forward(DATA).result()
        rank0, rank1 = runtime.placement.rank_nodes("learner-0")
        (lost,) = [n for n in cluster.list_all_nodes() if n.node_id == rank1]
        cluster.remove_node(lost)
        replacement = cluster.add_node(**NODE, resources={"accel_b": 1})
        after = trainer.forward(DATA).result(timeout=180)
        assert max(abs(a - b) for ra, rb in zip(after, before, strict=True) for a, b in zip(ra, rb, strict=True)) < 1e-4
        assert runtime.placement.rank_nodes("learner-0") == [rank0, replacement.node_id]
        _wait_restarted(runtime, "learner-0", 1)
        trainer.forward_backward(DATA, "cross_entropy").result()
        assert trainer.optim_step(AdamParams(learning_rate=1e-2)).result().version == 2
        assert trainer.save_weights_and_get_sampling_client().sample([3], 1, SHORT).result().sequences


def _wait_restarted(runtime: LocalRuntime, worker_id: str, restarts: int) -> None:
    """The restarted worker serves from its actor's constructor, a moment before its monitor's
    call through the restart is answered (Ray retries it while the actor restarts)."""
    deadline = time.monotonic() + 30
    while (row := {a["name"]: a for a in runtime.status()["actors"]}[worker_id])["restarts"] != restarts:
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert row["alive"]


def _wait_placed(runtime: LocalRuntime, worker_id: str, node_id: str) -> None:
    """The worker registers from its actor's constructor, a moment before Ray counts it alive."""
    deadline = time.monotonic() + 30
    while runtime.placement.placements()[worker_id] != node_id:
        assert time.monotonic() < deadline, runtime.placement.placements()
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_ray_workers_dial_a_scheduler_that_serves_with_curve(
    cluster: Any, runtime: LocalRuntime, tmp_path: Path
) -> None:
    """What a scheduler other machines reach needs: Ray workers admitted by the key
    worker_curve_secret_file names (its .key in curve_clients_dir)."""
    _, scheduler_secret = generate_keypair(tmp_path / "keys", "scheduler")
    worker_public, worker_secret = generate_keypair(tmp_path / "keys", "workers")
    clients = tmp_path / "keys" / "clients"
    clients.mkdir()
    (clients / "workers.key").write_bytes(worker_public.read_bytes())
    cfg = dataclasses.replace(
        _config(tmp_path / "state", cluster.address),
        address=f"tcp://127.0.0.1:{_free_port()}",
        curve_secret_file=str(scheduler_secret),
        curve_clients_dir=str(clients),
        # The first runtime's workers hold the custom resources: this engine takes the head's CPU.
        engines=(EngineWorkerConfig(adapter_slots=1, batch_window_s=0.0),),
        learners=(),
        cluster=ClusterConfig(
            backend="ray",
            address=cluster.address,
            bundles={"engine-0": {"CPU": 1}},
            worker_curve_secret_file=str(worker_secret),
        ),
    )
    with LocalRuntime(cfg) as curved:  # start() returns once the engine registered through Curve
        with ServiceClient(curved.local_address, api_key=curved.api_key) as service:
            sampler = service.create_sampling_client(base_model=MODEL)
            assert sampler.sample([3, 4, 5], 1, SHORT).result().sequences[0].tokens
        assert curved.placement.placements()["engine-0"] == cluster.head_node.node_id


def test_backend_ray_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"polytinker\[ray\]"):
        LocalRuntime(_config(tmp_path, "local")).start()


def test_cluster_table_is_checked_when_read() -> None:
    with pytest.raises(ConfigError, match="not engines or learners"):
        RuntimeConfig(cluster=ClusterConfig(backend="ray", bundles={"gpu-box": {"GPU": 1}}))
    with pytest.raises(ConfigError, match="expected one of 'local', 'ray'"):
        RuntimeConfig.from_dict({"cluster": {"backend": "slurm"}})
    cfg = RuntimeConfig.from_dict({"cluster": {"backend": "ray", "bundles": {"engine-0": {"GPU": 1, "CPU": 2}}}})
    assert cfg.cluster.bundles_of(cfg.worker_plan("engine-0")) == [{"GPU": 1.0, "CPU": 2.0}]
    # A learner group asks for a bundle per rank (Ray packs them on as few nodes as it can).
    learners = (LearnerWorkerConfig(world_size=3, device="cuda"),)
    gpu = RuntimeConfig(learners=learners, cluster=ClusterConfig(backend="ray"))
    assert gpu.cluster.bundles_of(gpu.worker_plan("learner-0")) == [{"CPU": 1.0, "GPU": 1.0}] * 3
    cpu = RuntimeConfig(learners=(LearnerWorkerConfig(world_size=3),), cluster=ClusterConfig(backend="ray"))
    assert cpu.cluster.bundles_of(cpu.worker_plan("learner-0")) == [{"CPU": 1.0}] * 3
    assert actor_options({"CPU": 2.0, "GPU": 2.0, "memory": 1e9, "accel": 2.0}) == (
        {"num_cpus": 2.0, "num_gpus": 2.0, "resources": {"accel": 2.0}, "memory": 1e9},
        2.0,
    )


@pytest.mark.timeout(180)
def test_each_rank_of_a_learner_group_sees_its_own_bundles_gpu(cluster: Any) -> None:
    """Ray's own GPU accounting, on a node that declares two GPUs (none need exist): a learner
    group of world size 2 on ``cuda`` is two bundles of one GPU, and an actor started in each
    bundle with the options its rank gets sees one GPU, not the other's, so each rank takes the
    first device it sees."""
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = RuntimeConfig(learners=(LearnerWorkerConfig(world_size=2, device="cuda"),), cluster=ClusterConfig("ray"))
    bundles = cfg.cluster.bundles_of(cfg.worker_plan("learner-0"))
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    node = cluster.add_node(**{**NODE, "num_cpus": 2}, num_gpus=2)
    if not ray.is_initialized():
        ray.init(address=cluster.address, namespace="polytinker-test")

    class Probe:  # defined here so Ray ships it by value (the test module is not importable there)
        def visible(self) -> tuple[list[Any], str]:
            import os

            return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES", "")

    group = placement_group(bundles)
    try:
        assert group.wait(60), "Ray reserved no node for the group's bundles"
        seen = []
        for rank in range(2):
            options, _ = actor_options(group.bundle_specs[rank])
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            probe = ray.remote(Probe).options(**options, scheduling_strategy=strategy).remote()
            seen.append(ray.get(probe.visible.remote(), timeout=90))
            ray.kill(probe)
        (ids0, visible0), (ids1, visible1) = seen
        assert len(ids0) == len(ids1) == 1 and ids0 != ids1, seen
        assert visible0 == str(ids0[0]) and visible1 == str(ids1[0]), seen
    finally:
        remove_placement_group(group)
        cluster.remove_node(node)


@pytest.mark.timeout(120)
def test_the_monitor_counts_a_restart_and_hands_on_an_actor_ray_gave_up_on(runtime: LocalRuntime) -> None:
    import ray

    class Stand:
        """A Ray actor the placement's monitor follows as it follows a worker's (``where``,
        ``life``): each incarnation answers with its own id. (Defined here: Ray ships it by value.)"""

        def __init__(self) -> None:
            self.incarnation = uuid.uuid4().hex

        def where(self) -> dict[str, Any]:
            node = ray.get_runtime_context().get_node_id()
            return {"node": f"here/{node}", "pid": os.getpid(), "incarnation": self.incarnation}

        def life(self) -> None:
            threading.Event().wait()

    placement = RayPlacement(runtime.config)  # its monitor driven by hand (_poll), no thread
    actor = ray.remote(Stand).options(max_restarts=1, max_concurrency=2, num_cpus=0).remote()
    placed = _Placed("stand-0", None, actor)
    placed.call = placement._ask_where(actor)
    placement._placed[placed.worker_id] = placed

    def poll_until(done: Any) -> list[Any]:
        deadline, gave_up = time.monotonic() + 60, []
        while not done():
            assert time.monotonic() < deadline, placed
            gave_up = placement._poll()
        return gave_up

    poll_until(lambda: placed.state == "ALIVE")
    first = placed.pid
    os.kill(first, signal.SIGKILL)  # its process lost: Ray starts it again, a restart counted
    poll_until(lambda: placed.state == "ALIVE" and placed.pid != first)
    assert placed.restarts == 1 and placed.last_exit_time > 0
    os.kill(placed.pid, signal.SIGKILL)  # no restart left: Ray gives up, and so does the runtime
    gave_up = poll_until(lambda: placed.state == "DEAD")
    assert gave_up == [placed] and not placement.actors()[0].alive and placement.actors()[0].gave_up
