"""The scheduler service's parts in one process: config, SQLite state, tenants, jobs over the policy,
learner time-slicing, and the RPC surface against malformed and overloaded traffic."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import zmq

from polytinker.client._connection import Connection
from polytinker.engine.types import Datum
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError, ProtocolError, RemoteError
from polytinker.model_path import CheckpointPath, ModelPath, from_tinker
from polytinker.scheduler.service import (
    AuthError,
    EngineWorkerConfig,
    JobManager,
    JobNotRunning,
    LearnerSlicer,
    LearnerWorkerConfig,
    OverloadedError,
    RuntimeConfig,
    SchedulerService,
    StateStore,
    TenantConfig,
)
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.tenants import Tenants, hash_key
from polytinker.scheduler.types import JobState
from polytinker.transport import RpcClient, RpcServer

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"


def config(tmp_path: Path, **kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model": "tiny-random",
        "state_dir": str(tmp_path),
        "tenants": (TenantConfig("alice", api_key=KEY_A), TenantConfig("bob", api_key=KEY_B)),
        "worker_token": "worker-token-0123456789",
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


# --- config ------------------------------------------------------------------------------------------


def test_config_validation_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="unique"):
        RuntimeConfig(engines=(EngineWorkerConfig("x"),), learners=(LearnerWorkerConfig("x"),))
    with pytest.raises(ConfigError, match="at least 16"):
        TenantConfig("t", api_key="short")
    with pytest.raises(ConfigError, match="together"):
        RuntimeConfig(curve_secret_file="k.key_secret")
    with pytest.raises(ConfigError, match="engine_id"):
        EngineWorkerConfig("bad id!")
    with pytest.raises(ConfigError, match="handler_threads"):
        RuntimeConfig(handler_threads=100, max_inflight_samples=90, max_inflight_train=10)


def test_config_from_toml_and_round_trip(tmp_path: Path) -> None:
    toml = tmp_path / "runtime.toml"
    toml.write_text(
        'model = "tiny-random"\nmax_inflight_samples = 7\n'
        '[[engines]]\nengine_id = "e1"\nadapter_slots = 2\n'
        '[[learners]]\nlearner_id = "l1"\n'
        '[[tenants]]\nname = "alice"\napi_key = "alice-key-0123456789"\n'
        "[jobs]\nsteps = 5\n"
    )
    cfg = RuntimeConfig.from_toml(toml)
    assert cfg.engines[0].adapter_slots == 2 and cfg.learners[0].learner_id == "l1" and cfg.jobs.steps == 5
    assert RuntimeConfig.from_dict(cfg.to_dict()) == cfg
    toml.write_text('model = "m"\nunknown_key = 1\n')
    with pytest.raises(ConfigError, match="unknown_key"):
        RuntimeConfig.from_toml(toml)


# --- state and tenants ----------------------------------------------------------------------------------


def test_state_is_wal_and_durable_across_reopen(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    store = StateStore(db)
    store.ensure_adapter("alice/j1/a", "alice", "j1", "a")
    store.record_version("alice/j1/a", 1, "/c/v1", "/e/v1")
    store.record_version("alice/j1/a", 2, "/c/v2", "/e/v2")
    assert store.drop_versions_below("alice/j1/a", 2) == [("/c/v1", "/e/v1")]
    store.close()
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    again = StateStore(db)
    row = again.adapter("alice/j1/a")
    assert row is not None and (row.version, row.checkpoint, row.export_dir) == (2, "/c/v2", "/e/v2")
    assert again.version_row("alice/j1/a", 1) is None and again.version_row("alice/j1/a", 2) == ("/c/v2", "/e/v2")


def test_tenants_store_only_key_hashes(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.sqlite3")
    tenants = Tenants(store)
    tenants.add(TenantConfig("alice", api_key=KEY_A))
    assert tenants.authenticate(KEY_A) == "alice"
    for bad in ("", "nope-nope-nope-nope", None, 42):
        with pytest.raises(AuthError):
            tenants.authenticate(bad)
    tenants.add(TenantConfig("carol", curve_public_key="c" * 40))
    assert tenants.authenticate("", "c" * 40) == "carol"  # no API key: the admitted Curve key decides
    assert tenants.authenticate(KEY_A, "c" * 40) == "alice"  # an API key takes precedence
    with pytest.raises(AuthError):
        tenants.authenticate("", "d" * 40)
    with pytest.raises(ConfigError, match="exactly one"):
        TenantConfig("dave", api_key=KEY_B, curve_public_key="c" * 40)
    dump = "\n".join(store._db.iterdump())
    assert KEY_A not in dump and hash_key(KEY_A) in dump


# --- jobs ----------------------------------------------------------------------------------------------


def manager(tmp_path: Path, **kw: object) -> JobManager:
    cfg = config(tmp_path, **kw)
    store = StateStore(cfg.state_path / "scheduler.sqlite3")
    tenants = Tenants(store)
    for t in cfg.tenants:
        tenants.add(t)
    return JobManager(cfg, store, tenants.weights())


def create(mgr: JobManager, tenant: str, key: str, kind: str = "lora_rl", **kw: object) -> str:
    return mgr.create(tenant, m.CreateJob(key, kind, "tiny-random", **kw)).job_id  # type: ignore[arg-type]


def test_lora_on_the_unembedding_is_refused_at_creation_where_an_engine_is_vllm(tmp_path: Path) -> None:
    unembed = ("q_proj", "v_proj", "lm_head")
    vllm = manager(tmp_path / "vllm", engines=(EngineWorkerConfig(backend="vllm"),))
    with pytest.raises(ConfigError, match="hf engine backend only"):
        create(vllm, "alice", KEY_A, target_modules=unembed)
    assert create(manager(tmp_path / "hf"), "alice", KEY_A, target_modules=unembed)  # the hf engine serves it
    sft = manager(tmp_path / "sft", engines=(EngineWorkerConfig(backend="vllm"),))
    assert create(sft, "alice", KEY_A, kind="sft", target_modules=unembed)  # no engine samples an SFT job


def test_a_lora_rank_no_vllm_engine_serves_is_refused_at_creation(tmp_path: Path) -> None:
    default = manager(tmp_path / "default", engines=(EngineWorkerConfig(backend="vllm"),))
    assert create(default, "alice", KEY_A, rank=32)  # a Tinker client's default rank: served by default
    with pytest.raises(
        ConfigError, match=r"LoRA rank 64 is above .*'engine-0': 32.*raise \[engines.vllm\] max_lora_rank"
    ):
        create(default, "alice", KEY_A, rank=64)
    wide = EngineWorkerConfig(backend="vllm", vllm={"max_lora_rank": 128, "kv_cache_gib": 4.0})
    assert create(manager(tmp_path / "wide", engines=(wide,)), "alice", KEY_A, rank=128)
    assert create(manager(tmp_path / "hf"), "alice", KEY_A, rank=256)  # the hf engine serves any rank
    # A misspelt or impossible vllm setting fails where the config is read.
    with pytest.raises(ConfigError, match="unknown vllm settings"):
        EngineWorkerConfig(backend="vllm", vllm={"max_lora_rnak": 64})
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        EngineWorkerConfig(backend="vllm", vllm={"max_lora_rank": 48})
    with pytest.raises(ConfigError, match="need backend = 'vllm'"):
        EngineWorkerConfig(vllm={"max_lora_rank": 64})


def test_vllm_settings_reach_the_engine_s_vllm_arguments() -> None:
    engine = EngineWorkerConfig(
        backend="vllm",
        adapter_slots=6,
        vllm={"gpu_memory_utilization": 0.45, "kv_cache_gib": 0, "tensor_parallel_size": 2, "dtype": "float16"},
    )
    kwargs = engine.vllm_config("tiny-random").llm_kwargs(Path("/models/tiny"))
    assert kwargs["max_loras"] == 6 and kwargs["max_lora_rank"] == 32 and kwargs["dtype"] == "float16"
    assert kwargs["gpu_memory_utilization"] == 0.45 and kwargs["tensor_parallel_size"] == 2
    assert "kv_cache_memory_bytes" not in kwargs  # sized from the memory share instead
    raw = RuntimeConfig(engines=(engine,)).to_dict()
    assert RuntimeConfig.from_dict(raw).engines[0] == engine  # and survive the trip to a worker process


def test_job_lifecycle_and_tenant_isolation(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    job = create(mgr, "alice", KEY_A)
    row, placement = mgr.running("alice", job)
    assert row.state == "running" and placement.learner == "learner-0" and placement.engine == "engine-0"
    with pytest.raises(AuthError):
        mgr.get("bob", job)  # the same answer as for a job that does not exist
    with pytest.raises(AuthError):
        mgr.action("bob", job, "cancel")
    assert mgr.action("alice", job, "pause").state == "paused"
    with pytest.raises(JobNotRunning):
        mgr.running("alice", job)
    assert mgr.action("alice", job, "resume").state == "running"
    assert mgr.action("alice", job, "cancel").state == "cancelled"
    with pytest.raises(ConfigError, match="cancelled"):
        mgr.action("alice", job, "resume")
    kinds = [e["kind"] for e in mgr.store.events(job)]
    assert kinds[:2] == ["admit", "start"] and "pause" in kinds and kinds[-1] == "cancel"
    with pytest.raises(ConfigError, match="serves base model"):
        mgr.create("alice", m.CreateJob(KEY_A, "lora_rl", "other-model"))


def test_full_parameter_job_gets_the_learner_to_itself_and_queues_the_rest(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    full = create(mgr, "alice", KEY_A, "full_rl")
    assert mgr.get("alice", full).state == "running"
    lora = create(mgr, "bob", KEY_B)
    assert mgr.get("bob", lora).state == "queued"  # the learner group is exclusive to the full job
    mgr.action("alice", full, "finish")
    assert mgr.get("bob", lora).state == "running"


def test_a_full_queue_answers_overloaded_with_a_retry_time(tmp_path: Path) -> None:
    mgr = manager(tmp_path, max_queued_jobs=1)
    create(mgr, "alice", KEY_A, "full_rl")  # takes the learner
    create(mgr, "alice", KEY_A, "full_rl")  # waits: the one queued slot
    with pytest.raises(OverloadedError) as err:
        create(mgr, "bob", KEY_B, "sft")
    assert err.value.retry_after_s > 0
    assert [j.kind for j in mgr.store.jobs()] == ["full_rl", "full_rl"]  # nothing was recorded for it


def test_recovery_puts_live_jobs_back_and_keeps_paused_ones_paused(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    running = create(mgr, "alice", KEY_A)
    paused = create(mgr, "bob", KEY_B)
    mgr.action("bob", paused, "pause")
    mgr.store.close()
    again = manager(tmp_path)  # a restarted scheduler over the same database
    assert again.recover() == 1
    assert again.get("alice", running).state == "running"
    assert again.get("bob", paused).state == "paused"
    assert again.action("bob", paused, "resume").state == "running"


# --- learner time-slicing ------------------------------------------------------------------------------


def test_learner_slicer_keeps_a_job_until_its_step_boundary() -> None:
    slicer = LearnerSlicer(idle_s=30.0)
    order: list[str] = []
    with slicer.turn("a", 0):
        order.append("a-fb")

    def b() -> None:
        with slicer.turn("b", 0, ends_step=True):
            order.append("b-step")

    t = threading.Thread(target=b)
    t.start()
    time.sleep(0.2)
    assert order == ["a-fb"]  # b waits: a holds the group between its forward_backward and its step
    with slicer.turn("a", 0, ends_step=True):
        order.append("a-step")
    t.join(5)
    assert order == ["a-fb", "a-step", "b-step"] and slicer.switches == 2


def test_learner_slicer_hands_over_after_an_idle_holder() -> None:
    slicer = LearnerSlicer(idle_s=0.1)
    with slicer.turn("a", 0):
        pass
    start = time.monotonic()
    with slicer.turn("b", 0):
        pass
    assert time.monotonic() - start < 2.0


def test_learner_slicer_lets_lora_jobs_hold_together_and_a_full_job_alone() -> None:
    slicer = LearnerSlicer(idle_s=30.0)
    order: list[str] = []

    def run(job: str, shared: bool, priority: int = 0) -> threading.Thread:
        def body() -> None:
            with slicer.turn(job, priority, ends_step=True, shared=shared):
                order.append(job)

        t = threading.Thread(target=body)
        t.start()
        return t

    with slicer.turn("a", 0, shared=True):
        order.append("a-fb")
    run("b", shared=True).join(5)
    assert order == ["a-fb", "b"]  # b joined a: both are LoRA jobs
    full = run("full", shared=False)
    time.sleep(0.2)
    assert order == ["a-fb", "b"]  # the full-parameter job waits for a's step boundary
    late = run("c", shared=True)
    time.sleep(0.2)
    assert order == ["a-fb", "b"]  # and a LoRA job that comes after it does not overtake it
    with slicer.turn("a", 0, ends_step=True, shared=True):
        order.append("a-step")
    full.join(5)
    late.join(5)
    # Then the policy picks between the two waiters (next_learner_job); each runs in its own turn.
    assert order[:3] == ["a-fb", "b", "a-step"] and sorted(order[3:]) == ["c", "full"]


# --- the RPC surface -------------------------------------------------------------------------------------


@pytest.fixture
def service(tmp_path: Path):
    cfg = config(tmp_path, max_inflight_train=1)
    svc = SchedulerService(cfg, cfg.worker_token).start("tcp://127.0.0.1:0")
    assert svc.server is not None
    yield svc, svc.server.address
    svc.stop()


def test_malformed_and_hostile_requests_never_take_the_scheduler_down(service) -> None:
    _svc, address = service
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(address)
    for frames in ([b"garbage"], [b"\x94\x01\x01\x07\xa3abc", b"\xc1"], [b""] * 3):
        raw.send_multipart(frames)
    raw.close()
    with RpcClient(address) as client:
        with pytest.raises(ProtocolError, match="takes a"):
            client.call("sched.create_job", {"api_key": KEY_A, "kind": "lora_rl"})
        with pytest.raises(ProtocolError):
            client.call("sched.create_job", m.ListJobs(KEY_A))
        with pytest.raises(RemoteError, match="unknown API key"):
            client.call("sched.list_jobs", m.ListJobs("wrong-key-wrong-key"))
        with pytest.raises(RemoteError, match="worker token"):
            forged = wm.Register("bad", "engine-0", "engine", "tcp://x:1", "i", "tiny-random", "k" * 40)
            client.call("sched.w.register", forged)
        reply = client.call("sched.create_job", m.CreateJob(KEY_A, "lora_rl", "tiny-random", rank=4))
        assert isinstance(reply, r.JobReply) and reply.job["state"] == "running"
        jobs = client.call("sched.list_jobs", m.ListJobs(KEY_B)).jobs
        assert jobs == []  # bob sees none of alice's jobs


def test_training_without_a_learner_waits_then_the_bound_answers_overloaded(service) -> None:
    svc, address = service
    with RpcClient(address) as client:
        job = client.call("sched.create_job", m.CreateJob(KEY_A, "lora_rl", "tiny-random", rank=4)).job
        with svc.admission.admit("alice", "train"):  # one training call in flight: the bound (1) is reached
            reply = client.call("sched.optim_step", m.OptimStep(KEY_A, job["job_id"]))
        assert isinstance(reply, r.OverloadedReply) and reply.retry_after_s > 0


def test_client_connection_retries_overloaded_answers_then_succeeds() -> None:
    answers = iter(
        [
            r.OverloadedReply(0.05, "busy"),
            r.WaitingReply(JobState.QUEUED, 0.05, "queued"),
            r.JobListReply([], {}),
        ]
    )
    with RpcServer("tcp://127.0.0.1:0", {"sched.list_jobs": lambda _msg: next(answers)}) as server:
        conn = Connection(server.address, KEY_A)
        try:
            assert conn.request("sched.list_jobs", m.ListJobs(KEY_A), r.JobListReply) == r.JobListReply([], {})
        finally:
            conn.close()
    busy = r.OverloadedReply(0.01, "busy")
    with RpcServer("tcp://127.0.0.1:0", {"x": lambda _msg: busy}) as server:
        conn = Connection(server.address, KEY_A, overload_wait_s=0.05)
        try:
            with pytest.raises(OverloadedError):
                conn.request("x", None, r.JobListReply)
        finally:
            conn.close()


def test_message_validation_and_model_paths() -> None:
    with pytest.raises(ConfigError):
        Datum((1, 2), (2,), (1.0,))
    with pytest.raises(ConfigError):
        m.CreateJob(KEY_A, "training", "tiny-random")
    with pytest.raises(ConfigError):
        m.Sample(KEY_A, "", "tiny-random", (), 1)
    path = ModelPath.parse("polytinker://job-1/agent@3")
    assert (path.job_id, path.agent, path.version) == ("job-1", "agent", 3)
    assert str(path) == "polytinker://job-1/agent@3"
    assert path.tinker == "tinker://job-1/sampler_weights/agent@3"
    assert ModelPath.from_tinker(path.tinker) == path
    with pytest.raises(ConfigError):
        ModelPath.parse("polytinker://job-1@x")
    with pytest.raises(ConfigError):
        ModelPath.from_tinker("tinker://job-1/weights/agent@3")
    checkpoint = CheckpointPath.parse("polytinker-ckpt://job-1/after-two")
    assert checkpoint == CheckpointPath("job-1", "after-two") and str(checkpoint) == "polytinker-ckpt://job-1/after-two"
    assert checkpoint.tinker == "tinker://job-1/weights/after-two"
    assert CheckpointPath.from_tinker(checkpoint.tinker) == checkpoint
    assert from_tinker(checkpoint.tinker) == str(checkpoint) and from_tinker(path.tinker) == str(path)
    with pytest.raises(ConfigError):
        CheckpointPath.from_tinker(path.tinker)
    with pytest.raises(ConfigError):
        from_tinker("tinker://job-1/external_weights/x")
    assert CheckpointPath.parse("after-two") is None and CheckpointPath.parse("polytinker://job-1/agent@3") is None


def test_a_higher_priority_job_preempts_at_the_next_step_boundary(tmp_path: Path) -> None:
    mgr = manager(tmp_path, learners=(LearnerWorkerConfig(max_jobs=1),))
    low = create(mgr, "alice", KEY_A, priority=0)
    assert mgr.get("alice", low).state == "running"
    high = create(mgr, "bob", KEY_B, priority=5)
    assert mgr.get("alice", low).state == "preempting"  # told to stop at its next step boundary
    assert mgr.get("bob", high).state == "queued"
    mgr.running("alice", low)  # still takes calls until that boundary
    mgr.step_boundary(low, 1)  # its step 1 is durable: it gives the learner up
    assert mgr.get("alice", low).state == "queued"
    assert mgr.get("bob", high).state == "running"
    mgr.action("bob", high, "finish")
    assert mgr.get("alice", low).state == "running"  # back from its saved version
    kinds = [e["kind"] for e in mgr.store.events(low)]
    assert "preempt" in kinds and "requeue" in kinds


def test_a_closed_service_client_refuses_calls_instead_of_starting_a_runtime() -> None:
    from polytinker.client import ServiceClient
    from polytinker.errors import TransportError

    service = ServiceClient("tcp://127.0.0.1:9", api_key=KEY_A)
    service.close()
    with pytest.raises(TransportError, match="closed"):
        service.list_jobs()
    assert service.runtime is None


def test_training_data_in_polytinker_and_tinker_shapes_become_the_same_message() -> None:
    import numpy as np

    from polytinker.client.training_client import to_datum

    ours = to_datum(Datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], [0.5] * 3, [-1.0] * 3))
    tinker = to_datum(
        {
            "model_input": [1, 2, 3],
            "loss_fn_inputs": {"target_tokens": np.array([2, 3, 4]), "weights": [0, 1, 1],
                               "advantages": [0.5] * 3, "logprobs": [-1.0] * 3},
        }
    )  # fmt: skip
    assert ours == tinker
    with pytest.raises(TypeError, match="target_tokens"):
        to_datum({"model_input": [1, 2], "loss_fn_inputs": {}})


def test_an_idle_job_is_paused_to_free_resources_and_its_next_call_resumes_it(tmp_path: Path) -> None:
    mgr = manager(tmp_path, job_idle_pause_s=0.2, learners=(LearnerWorkerConfig(max_jobs=1),))
    idle = create(mgr, "alice", KEY_A)
    waiting = create(mgr, "bob", KEY_B)
    assert mgr.get("bob", waiting).state == "queued"  # the one learner slot is taken
    time.sleep(0.3)
    assert mgr.pause_idle() == [idle]
    assert mgr.get("alice", idle).state == "paused" and mgr.get("bob", waiting).state == "running"
    assert mgr.pause_idle() == []  # bob's idle time counts from its start, not from its submission
    mgr.action("bob", waiting, "finish")
    row, _ = mgr.running("alice", idle)  # the next call of the idle job resumes it
    assert row.state == "running"
    with pytest.raises(ConfigError, match="must be > 0"):
        config(tmp_path, job_idle_pause_s=0)


def test_a_replacement_learner_answers_a_resent_step_its_predecessor_took(tmp_path: Path) -> None:
    """Keyed training calls on real learner workers: a duplicate is answered from the first result;
    a step finished by a process that died before answering is found by its replacement (from the
    key next to the checkpoint), which loads it instead of stepping again; a resent step whose
    gradient died with the old process is refused."""
    import dataclasses

    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import GradientLost

    cfg = LearnerWorkerConfig(micro_batch_size=8)
    adapter = "alice/job/agent"
    batch = tuple(Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)) for _ in range(2))
    fb = wm.LearnerForwardBackward(adapter, batch, "cross_entropy", request_id="fb-1", from_version=0)
    step = wm.LearnerStep(adapter, 1e-2, 0.9, 0.95, 1e-12, 0.0, request_id="st-1", from_version=0)
    first = LearnerWorker("tiny-random", cfg, tmp_path)
    try:
        first.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        once = first.forward_backward(fb)
        assert first.forward_backward(dataclasses.replace(fb, attempt=1)) == once
        stepped = first.step(step)
        assert first.step(dataclasses.replace(step, attempt=1)) == stepped
        assert (first.stats["forward_backward"], first.stats["optim_steps"], first.stats["duplicates"]) == (1, 1, 2)
        assert stepped.version == 1 and stepped.metrics["optim/tokens"] == 6.0  # one gradient, not two
        weights = first.forward(wm.LearnerForward(adapter, batch)).logprobs
    finally:
        first.close()
    # The answer never reached the scheduler: it still records version 0, and a new process starts there.
    second = LearnerWorker("tiny-random", cfg, tmp_path)
    try:
        second.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        assert second.step(dataclasses.replace(step, attempt=1)) == stepped
        assert second.stats["optim_steps"] == 0 and second._versions()[adapter] == 1
        assert second.forward(wm.LearnerForward(adapter, batch)).logprobs == weights
        with pytest.raises(GradientLost, match="redo this step"):
            second.step(dataclasses.replace(step, request_id="st-2", from_version=1, attempt=1))
        assert second.stats["optim_steps"] == 0 and second._versions()[adapter] == 1
    finally:
        second.close()


def test_a_step_whose_forward_backward_calls_a_restarted_learner_lost_is_refused(tmp_path: Path) -> None:
    """optim_step carries how many forward_backward calls the scheduler saw answered since the last
    step: a learner holding fewer (it restarted between them) refuses the step, even on its first
    send, and drops the part it holds, so the redone calls make the same step as an unbroken run."""
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import GradientLost

    cfg = LearnerWorkerConfig(micro_batch_size=8)
    adapter = "alice/job/agent"
    batch = tuple(Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)) for _ in range(2))

    def fb(request_id: str) -> wm.LearnerForwardBackward:
        return wm.LearnerForwardBackward(adapter, batch, "cross_entropy", request_id=request_id, from_version=0)

    def step(request_id: str, expected_fb: int) -> wm.LearnerStep:
        return wm.LearnerStep(adapter, 1e-2, 0.9, 0.95, 1e-12, 0.0, request_id=request_id, expected_fb=expected_fb)

    worker = LearnerWorker("tiny-random", cfg, tmp_path / "first")
    try:
        worker.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        worker.forward_backward(fb("a"))
        worker.forward_backward(fb("b"))
        unbroken = worker.forward(wm.LearnerForward(adapter, batch)).logprobs
        worker.step(step("s-unbroken", 2))
        stepped = worker.forward(wm.LearnerForward(adapter, batch)).logprobs
    finally:
        worker.close()

    # The first forward_backward died with the old process.
    replacement = LearnerWorker("tiny-random", cfg, tmp_path / "replacement")
    try:
        replacement.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        replacement.forward_backward(fb("b"))
        with pytest.raises(GradientLost, match="holds 1 of the step's 2 forward_backward calls"):
            replacement.step(step("s-1", 2))
        assert replacement.stats["optim_steps"] == 0 and replacement._versions()[adapter] == 0
        assert replacement.forward(wm.LearnerForward(adapter, batch)).logprobs == unbroken
        with pytest.raises(GradientLost, match="holds 0 of the step's 1"):
            replacement.step(step("s-2", 1))
        replacement.forward_backward(fb("a2"))  # the client redoes the step's calls
        replacement.forward_backward(fb("b2"))
        assert replacement.step(step("s-3", 2)).version == 1
        redone = replacement.forward(wm.LearnerForward(adapter, batch)).logprobs
        flat = [x for row in redone for x in row]
        assert flat == pytest.approx([x for row in stepped for x in row], abs=1e-6)  # the dropped half counted once
        assert replacement.step(step("s-4", -1)).version == 2  # an unknown count is not checked
    finally:
        replacement.close()


def test_an_async_rl_job_tells_the_policy_how_far_it_samples_ahead(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    job = create(mgr, "alice", KEY_A, max_staleness=2)
    row = mgr.get("alice", job)
    assert row.max_staleness == 2 and row.public()["max_staleness"] == 2
    assert mgr._policy_job(row, "p.1", 0).max_staleness == 2  # what the policy plans the job with
    assert mgr.store.job(job) == row  # stored, so a restarted scheduler plans it the same way
    with pytest.raises(ConfigError, match="max_staleness is for RL jobs"):
        create(mgr, "alice", KEY_A, "sft", max_staleness=1)


def test_a_database_without_the_newer_columns_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """CREATE TABLE jobs (job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL,
        base_model TEXT NOT NULL, agent TEXT NOT NULL, lora TEXT NOT NULL, state TEXT NOT NULL,
        priority INTEGER NOT NULL, steps INTEGER NOT NULL, reason TEXT NOT NULL DEFAULT '',
        created_s REAL NOT NULL, updated_s REAL NOT NULL);
        INSERT INTO jobs VALUES ('j1', 'alice', 'lora_rl', 'tiny-random', 'a', '{}', 'running', 0, 5, '', 1.0, 2.0);
        CREATE TABLE checkpoints (job_id TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
        version INTEGER NOT NULL, created_s REAL NOT NULL, PRIMARY KEY (job_id, name));
        INSERT INTO checkpoints VALUES ('j1', 'kept', 'checkpoints/x', 3, 1.0);"""
    )
    db.commit()
    db.close()
    store = StateStore(path)
    try:
        row = store.job("j1")
        assert row is not None and row.max_staleness == 0 and row.steps == 5
        assert row.request_key == "" and store.job_for_request("alice", "") is None  # made with no key
        store.insert_job(dataclasses.replace(row, job_id="j2", request_key="k1", request_digest="d"))
        found = store.job_for_request("alice", "k1")
        assert found is not None and found.job_id == "j2" and store.job_for_request("bob", "k1") is None
        assert [c["expires_s"] for c in store.checkpoints("j1")] == [None]  # an old checkpoint never expires
        assert store.set_checkpoint_expiry("j1", "kept", 5.0) and store.expired_checkpoints(6.0) == [("j1", "kept")]
    finally:
        store.close()


def test_a_data_parallel_learner_worker_runs_a_full_parameter_job_then_lora_again(tmp_path: Path) -> None:
    """K=2 replicas hold either the LoRA adapters or one full-parameter model: a full job's step
    equals one process's (same data, same update), and the LoRA adapter comes back from its
    checkpoint afterwards. A call for a slot the switch dropped is refused (NotResident), never
    served from fresh weights."""
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import NotResident

    lora, full = "alice/lora/agent", "alice/full/agent"
    rows = [(5, 6, 7, 8, 9), (10, 11, 12), (13, 14, 15, 16), (17, 18, 19, 20, 21, 22), (23, 24, 25)]
    batch = tuple(Datum(r, (*r[1:], 3), (0.0,) + (1.0,) * (len(r) - 1)) for r in rows)

    def step(adapter: str, is_full: bool) -> wm.LearnerStep:
        # Adam's eps at 1e-3: a weight whose gradient is float noise (summed in another order
        # across replicas) then moves by noise, not by a whole learning rate of either sign.
        return wm.LearnerStep(adapter, 1e-2, 0.9, 0.95, 1e-3, 0.0, full=is_full)

    def run(worker: LearnerWorker) -> dict[str, object]:
        worker.ensure(wm.EnsureAdapter(lora, 0, rank=4))
        worker.forward_backward(wm.LearnerForwardBackward(lora, batch, "cross_entropy"))
        lora_step = worker.step(step(lora, False))
        lora_after = worker.forward(wm.LearnerForward(lora, batch)).logprobs
        worker.ensure(wm.EnsureAdapter(full, 0, full=True))
        worker.forward_backward(wm.LearnerForwardBackward(full, batch, "cross_entropy", full=True))
        full_step = worker.step(step(full, True))
        full_after = worker.forward(wm.LearnerForward(full, batch, full=True)).logprobs
        if worker.cfg.world_size > 1:
            with pytest.raises(NotResident, match="adapter alice/lora/agent is not resident"):
                worker.forward(wm.LearnerForward(lora, batch))
        assert lora_step.checkpoint == "checkpoints/alice/lora/agent/v1"  # under the worker's own root
        worker.ensure(wm.EnsureAdapter(lora, 1, wm.WeightsRef(lora, 1), rank=4))
        lora_again = worker.forward(wm.LearnerForward(lora, batch)).logprobs
        if worker.cfg.world_size > 1:
            with pytest.raises(NotResident, match="full-parameter model alice/full/agent"):
                worker.forward(wm.LearnerForward(full, batch, full=True))
        return {"lora": lora_after, "full": full_after, "lora_again": lora_again, "full_version": full_step.version}

    one = LearnerWorker("tiny-random", LearnerWorkerConfig(micro_batch_size=8), tmp_path / "k1")
    try:
        single = run(one)
    finally:
        one.close()
    two = LearnerWorker("tiny-random", LearnerWorkerConfig(world_size=2, micro_batch_size=8), tmp_path / "k2")
    try:
        group = run(two)
        assert two.stats["loads"] == 1  # the LoRA adapter, from its checkpoint after the switch back
    finally:
        two.close()

    def flat(rows: object) -> list[float]:
        assert isinstance(rows, list)
        return [x for row in rows for x in row]

    assert group["full_version"] == single["full_version"] == 1
    for key in ("lora", "full", "lora_again"):
        assert flat(group[key]) == pytest.approx(flat(single[key]), abs=1e-4), key
    assert flat(group["lora_again"]) == pytest.approx(flat(group["lora"]), abs=1e-6)
    assert flat(single["full"]) != pytest.approx(flat(single["lora"]), abs=1e-3)  # the two really differ


def test_a_learner_worker_holds_one_full_parameter_model_at_a_time(tmp_path: Path) -> None:
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import NotResident

    batch = (Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)),)
    worker = LearnerWorker("tiny-random", LearnerWorkerConfig(micro_batch_size=8), tmp_path)
    try:
        worker.ensure(wm.EnsureAdapter("a/1/x", 0, full=True))
        worker.forward_backward(wm.LearnerForwardBackward("a/1/x", batch, "cross_entropy", full=True))
        stepped = worker.step(wm.LearnerStep("a/1/x", 1e-3, 0.9, 0.95, 1e-8, 0.0, full=True))
        trained = worker.forward(wm.LearnerForward("a/1/x", batch, full=True))
        worker.ensure(wm.EnsureAdapter("a/2/y", 0, full=True))  # the next job's model replaces it
        assert worker.get_stats(wm.WorkerStats())["full_slots"] == 1
        with pytest.raises(NotResident):
            worker.forward(wm.LearnerForward("a/1/x", batch, full=True))
        worker.ensure(wm.EnsureAdapter("a/1/x", 1, wm.WeightsRef("a/1/x", stepped.version), full=True))
        assert worker.forward(wm.LearnerForward("a/1/x", batch, full=True)) == trained
    finally:
        worker.close()


def test_worker_threads_take_omp_num_threads_else_the_cores_shared_by_a_groups_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polytinker.engine.worker.server import worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads() == worker_threads(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert (worker_threads(), worker_threads(1), worker_threads(2), worker_threads(16)) == (8, 8, 4, 1)


def test_a_worker_process_takes_the_threads_its_role_and_group_size_give_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from polytinker.engine.worker.server import set_worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    given: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", given.append)
    config = RuntimeConfig(
        engines=(EngineWorkerConfig("engine-0"),),
        learners=(LearnerWorkerConfig("solo"), LearnerWorkerConfig("pair", world_size=2)),
    )
    for worker_id in ("engine-0", "solo", "pair"):
        set_worker_threads(config.worker_plan(worker_id))
    assert given == [8, 8, 4]  # a group's ranks share the cores
