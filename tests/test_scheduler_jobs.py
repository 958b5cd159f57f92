"""The scheduler service's ``JobManager`` over the policy, in one process: what job creation
refuses (LoRA settings no vLLM engine serves), a job's lifecycle and tenant isolation, a
full-parameter job queueing the rest, a full queue answering overloaded, recovery after a restart,
preemption at a step boundary, pausing idle jobs, and an async RL job's staleness."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _scheduler_helpers import KEY_A, KEY_B, config

from polytinker.errors import ConfigError
from polytinker.scheduler.service import (
    AuthError,
    EngineWorkerConfig,
    JobManager,
    JobNotRunning,
    LearnerWorkerConfig,
    OverloadedError,
    StateStore,
)
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.jobs import adapter_key
from polytinker.scheduler.service.policy_view import policy_job
from polytinker.scheduler.service.scheduler import SchedulerService
from polytinker.scheduler.service.tenants import Tenants


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


def test_a_job_that_ends_is_let_go_of_and_the_services_per_adapter_maps_stay_bounded(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    ended: list[str] = []
    mgr.when_final(ended.append)
    jobs = [create(mgr, "alice", KEY_A) for _ in range(3)]
    mgr.action("alice", jobs[0], "pause")  # paused is not an end: it may resume
    assert ended == []
    mgr.action("alice", jobs[1], "cancel")
    mgr.action("alice", jobs[2], "finish")
    assert ended == jobs[1:]

    # The service keeps, per adapter, the forward_backward ids of the step under way and the learner
    # that holds it: a scheduler that serves run after run must not keep them for runs that ended.
    svc = SchedulerService(config(tmp_path / "svc"), "worker-token-0123456789")
    try:
        handlers = svc.handlers()
        made = [
            handlers["sched.create_job"](m.CreateJob(KEY_B, "lora_rl", "tiny-random", rank=4)).job for _ in range(4)
        ]
        keys = {adapter_key("bob", j["job_id"], j["agent"]) for j in made}
        assert keys <= set(svc._fb_ids)
        for job, action in zip(made, ("finish", "cancel", "finish", "pause"), strict=True):
            handlers["sched.job_action"](m.JobAction(KEY_B, job["job_id"], action))
        paused = adapter_key("bob", made[3]["job_id"], made[3]["agent"])
        assert set(svc._fb_ids) & keys == {paused}
    finally:
        svc.stop()


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


def test_an_async_rl_job_tells_the_policy_how_far_it_samples_ahead(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    job = create(mgr, "alice", KEY_A, max_staleness=2)
    row = mgr.get("alice", job)
    assert row.max_staleness == 2 and row.public()["max_staleness"] == 2
    adapter = adapter_key(row.tenant, row.job_id, row.agent)
    assert policy_job(mgr.config, row, "p.1", 0, 0.0, adapter).max_staleness == 2  # what the policy plans the job with
    assert mgr.store.job(job) == row  # stored, so a restarted scheduler plans it the same way
    with pytest.raises(ConfigError, match="max_staleness is for RL jobs"):
        create(mgr, "alice", KEY_A, "sft", max_staleness=1)
