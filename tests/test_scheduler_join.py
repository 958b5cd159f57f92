"""Workers the config does not declare join at run time ([cluster] join_undeclared): the broker
admits one that proves the worker token and registers its capacity, and the policy places on it
from then on. The policy and the broker are real; the joining worker's link is a direct one."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from _scheduler_helpers import KEY_A, config

from polytinker.engine.worker.layout import read_state_id
from polytinker.engine.worker.messages import Leave, Register
from polytinker.engine.worker.replies import Left
from polytinker.errors import AuthError, ConfigError, WorkerUnavailable
from polytinker.scheduler import ClusterSpec, EngineSpec, FairSharePolicy, Job, JobKind, JobState, LearnerSpec
from polytinker.scheduler.service import LearnerWorkerConfig
from polytinker.scheduler.service.broker import Broker
from polytinker.scheduler.service.cluster import ClusterConfig
from polytinker.scheduler.service.jobs import JobManager
from polytinker.scheduler.service.messages import CreateJob
from polytinker.scheduler.service.state import StateStore
from polytinker.transport.direct import DirectClient

TOKEN = "worker-token-0123456789"
KEY = "k" * 40


def rl_job(job_id: str) -> Job:
    return Job(job_id, "t", JobKind.LORA_RL, "base", 0, 5, 1.0, 1.0, 1.0, 1.0, adapter=f"t/{job_id}/a")


def test_a_job_waiting_for_an_adapter_slot_runs_on_an_engine_that_joins() -> None:
    spec = ClusterSpec((EngineSpec("e0", "base", 40.0, adapter_slots=1),), (LearnerSpec("g0", "base", 80.0),))
    policy = FairSharePolicy(spec)
    for job_id in ("first", "second"):
        policy.submit(rl_job(job_id), 0.0)
    policy.schedule(0.0)
    assert policy.state("first") == JobState.RUNNING and policy.state("second") == JobState.QUEUED
    policy.cluster.add(EngineSpec("joined", "base", 40.0, adapter_slots=2))
    policy.schedule(1.0)
    placement = policy.placement("second")
    assert policy.state("second") == JobState.RUNNING and placement is not None and placement.engine == "joined"
    with pytest.raises(ConfigError, match="already in the cluster"):
        policy.cluster.add(LearnerSpec("joined", "base", 80.0))


def register(worker_id: str, role: str = "engine", *, token: str = TOKEN, **fields: object) -> Register:
    base: dict[str, object] = {
        "worker_id": worker_id,
        "role": role,
        "address": f"direct://{worker_id}",
        "incarnation": "i1",
        "base_model": "tiny-random",
        "curve_public_key": KEY,
        "memory_gb": 24.0,
        "slots": 4,
    }
    return Register.signed(token, **(base | fields))


def broker(tmp_path: Path, join: bool) -> tuple[Broker, list[Register]]:
    cfg = config(tmp_path, cluster=ClusterConfig(join_undeclared=join))
    b = Broker(cfg, TOKEN)
    b.connect = lambda msg: DirectClient(msg.worker_id, {})
    joined: list[Register] = []
    b.on_join = joined.append
    return b, joined


def test_an_undeclared_worker_is_refused_unless_the_config_lets_workers_join(tmp_path: Path) -> None:
    closed, _ = broker(tmp_path / "closed", join=False)
    with pytest.raises(ConfigError, match=r"join_undeclared = true"):
        closed.register(register("engine-9"))
    assert closed.workers() == []

    opened, joined = broker(tmp_path / "open", join=True)
    assert opened.register(register("engine-9")).known is False
    assert opened.register(register("learner-9", "learner", slots=8)).known is False
    assert [(m.worker_id, m.role, m.memory_gb, m.slots) for m in joined] == [
        ("engine-9", "engine", 24.0, 4),
        ("learner-9", "learner", 24.0, 8),
    ]
    assert "learner-9" in opened.slicers and "learner-9" in opened.batchers  # its jobs' turns and batches
    assert opened.register(dataclasses.replace(register("engine-9"), incarnation="i1")).known is True
    assert len(joined) == 2  # a heartbeat is not a second join
    assert {w["worker_id"] for w in opened.workers()} == {"engine-9", "learner-9"}


def test_a_joining_worker_proves_the_token_and_its_capacity_and_keeps_its_role(tmp_path: Path) -> None:
    b, joined = broker(tmp_path, join=True)
    with pytest.raises(AuthError):
        b.register(register("engine-9", token="another-token-0123456789"))
    tampered = dataclasses.replace(register("engine-9"), slots=4096)  # more slots than it signed for
    with pytest.raises(AuthError):
        b.register(tampered)
    with pytest.raises(ConfigError, match="no capacity"):
        b.register(register("engine-9", memory_gb=0.0, slots=0))
    with pytest.raises(ConfigError, match="serves other-model"):
        b.register(register("engine-9", base_model="other-model"))
    with pytest.raises(ConfigError, match="is this runtime's engine of tiny-random; it registered as learner"):
        b.register(register("engine-0", "learner"))  # a declared id keeps its declared role
    assert joined == []
    b.register(register("engine-9"))
    with pytest.raises(ConfigError, match="is this runtime's engine of tiny-random; it registered as learner"):
        b.register(register("engine-9", "learner", incarnation="i2"))  # nor does a joined one change role


def test_the_job_manager_places_on_a_worker_that_joined(tmp_path: Path) -> None:
    cfg = config(tmp_path, cluster=ClusterConfig(join_undeclared=True))
    b = Broker(cfg, TOKEN)
    b.connect = lambda msg: DirectClient(msg.worker_id, {})
    store = StateStore(tmp_path / "s.sqlite3")
    try:
        jobs = JobManager(cfg, store, (("alice", 1.0),))
        jobs.follow_workers(b)
        b.register(register("engine-9", slots=3))
        assert "engine-9" in jobs.policy.cluster.engines
        assert jobs.policy.cluster.engines["engine-9"].spec == EngineSpec("engine-9", cfg.model, 24.0, 3)
        assert jobs.policy.cluster.present("engine-9")  # registered and alive: placed on first
    finally:
        store.close()


def manager(tmp_path: Path, **kw: object) -> tuple[JobManager, Broker, StateStore]:
    cfg = config(tmp_path, **kw)
    b = Broker(cfg, TOKEN)
    b.connect = lambda msg: DirectClient(msg.worker_id, {})
    store = StateStore(tmp_path / "s.sqlite3")
    jobs = JobManager(cfg, store, (("alice", 1.0),))
    jobs.follow_workers(b)
    return jobs, b, store


def test_a_job_no_worker_can_run_waits_for_one_to_join_when_workers_may_join(tmp_path: Path) -> None:
    """A runtime of learners only, whose engines join: a sampling job waits queued (and is
    recovered queued after a restart) instead of being rejected, and runs once an engine joins."""
    learners_only = {"engines": (), "learners": (LearnerWorkerConfig(),)}
    closed, _, store = manager(tmp_path / "closed", **learners_only)
    try:
        job = closed.create("alice", CreateJob(KEY_A, "lora_rl", "tiny-random"))
        assert job.state == JobState.REJECTED and "no engine serves base model" in job.reason
    finally:
        store.close()

    root = tmp_path / "open"
    jobs, b, store = manager(root, cluster=ClusterConfig(join_undeclared=True), **learners_only)
    try:
        job = jobs.create("alice", CreateJob(KEY_A, "lora_rl", "tiny-random"))
        assert job.state == JobState.QUEUED
        assert job.reason == "waiting for a worker that can run it to join: no engine serves base model tiny-random"
        again = JobManager(jobs.config, store, (("alice", 1.0),))  # a restarted scheduler recovers it queued
        again.recover()
        assert store.job(job.job_id).state == JobState.QUEUED  # type: ignore[union-attr]

        b.register(register("engine-9"))
        jobs.schedule()
        row, placement = jobs.running("alice", job.job_id)
        assert row.state == JobState.RUNNING and placement.engine == "engine-9"
    finally:
        store.close()


def test_a_worker_that_left_is_placed_on_no_more_and_may_join_again() -> None:
    spec = ClusterSpec((EngineSpec("e0", "base", 40.0, adapter_slots=2),), ())
    policy = FairSharePolicy(spec)
    policy.cluster.add(LearnerSpec("g9", "base", 80.0))
    policy.cluster.add(EngineSpec("e9", "base", 40.0, adapter_slots=2))
    policy.submit(rl_job("one"), 0.0)
    policy.schedule(0.0)
    assert policy.placement("one") is not None and policy.placement("one").learner == "g9"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="still holds jobs"):
        policy.worker_left("g9")  # its jobs leave first
    policy.cancel("one", 1.0)
    policy.worker_left("g9")
    policy.worker_left("e9")
    assert "g9" not in policy.cluster.learners and "e9" not in policy.cluster.engines
    assert policy.cluster.adapters.engines_of("base") == ["e0"]
    with pytest.raises(ConfigError, match="not a joined engine or learner group"):
        policy.worker_left("g9")
    assert policy.cluster.impossible(rl_job("two")) is not None  # no learner group is left
    policy.cluster.add(LearnerSpec("g9", "base", 80.0))  # it comes back: it joins anew
    policy.submit(rl_job("two"), 2.0)
    policy.schedule(2.0)
    assert policy.state("two") == JobState.RUNNING


def test_a_joined_learner_gone_for_long_enough_has_left_and_its_jobs_are_queued_again(tmp_path: Path) -> None:
    """A joined learner group not there for ``joined_gone_s``: the broker forgets it, its job goes
    back to the queue (waiting for a worker to join: none is left), its history says why, and
    the same worker registering again joins anew and runs it. A declared worker that never came
    is never forgotten."""
    cluster = ClusterConfig(join_undeclared=True, joined_gone_s=0.2)
    jobs, b, store = manager(tmp_path, cluster=cluster, learners=(), worker_heartbeat_s=0.05, worker_silence_s=0.1)
    try:
        b.register(register("learner-9", "learner"))
        job = jobs.create("alice", CreateJob(KEY_A, "lora_rl", "tiny-random"))
        jobs.schedule()
        _, placement = jobs.running("alice", job.job_id)
        assert placement.learner == "learner-9"
        assert b.forget_gone() == []  # there: heartbeats count from its registration
        time.sleep(0.5)  # no heartbeat: not there for longer than joined_gone_s
        assert b.forget_gone() == ["learner-9"]
        row = store.job(job.job_id)
        assert row is not None and row.state == JobState.QUEUED
        assert (
            row.reason == "waiting for a worker that can run it to join: no learner group serves base model tiny-random"
        )
        events = [(e["kind"], e["reason"]) for e in store.events(job.job_id)]
        assert ("requeue", "learner-9 left the runtime; queued again at version 0") in events
        assert "learner-9" not in jobs.policy.cluster.learners and "learner-9" not in b.slicers
        with pytest.raises(WorkerUnavailable, match="left the runtime"):
            b.wait_for("learner-9", timeout_s=5.0)  # a call waiting for it fails over at once
        b.register(register("learner-9", "learner", incarnation="i2"))  # back: it joins anew
        jobs.schedule()
        row, placement = jobs.running("alice", job.job_id)
        assert row.state == JobState.RUNNING and placement.learner == "learner-9"
        assert "engine-0" not in b.forget_gone()  # declared, never registered: waited for, not forgotten
    finally:
        store.close()


def test_a_worker_that_says_it_leaves_is_forgotten_at_once_and_only_with_the_token(tmp_path: Path) -> None:
    """``Leave`` (a worker stopping on purpose): a joined learner group is forgotten at once, long
    before ``joined_gone_s``, and its job queued again; a Leave without the token, of another
    incarnation or said twice changes nothing; a declared worker that leaves counts as exited
    (calls to it wait for the next incarnation) and stays declared."""
    cluster = ClusterConfig(join_undeclared=True)  # joined_gone_s: 600 s
    jobs, b, store = manager(tmp_path, cluster=cluster, learners=())
    try:
        b.register(register("learner-9", "learner"))
        job = jobs.create("alice", CreateJob(KEY_A, "lora_rl", "tiny-random"))
        jobs.schedule()
        assert jobs.running("alice", job.job_id)[1].learner == "learner-9"
        with pytest.raises(AuthError):
            b.leave(Leave.signed("another-token-0123456789", "learner-9", "i1"))
        forged = dataclasses.replace(Leave.signed(TOKEN, "learner-9", "i1"), incarnation="i2")
        with pytest.raises(AuthError):
            b.leave(forged)  # the proof covers the incarnation
        assert b.leave(Leave.signed(TOKEN, "learner-9", "i0")) == Left(known=False)  # an earlier process's
        assert b.alive("learner-9")
        assert b.leave(Leave.signed(TOKEN, "learner-9", "i1")) == Left(known=True)
        assert "learner-9" not in {w["worker_id"] for w in b.workers()} and "learner-9" not in b.slicers
        row = store.job(job.job_id)
        assert row is not None and row.state == JobState.QUEUED
        events = [(e["kind"], e["reason"]) for e in store.events(job.job_id)]
        assert ("requeue", "learner-9 left the runtime; queued again at version 0") in events
        assert b.leave(Leave.signed(TOKEN, "learner-9", "i1")) == Left(known=False)  # said twice
        assert b.forget_gone() == []  # forgotten once, not twice

        b.register(register("engine-0", incarnation="e1"))  # declared
        assert b.leave(Leave.signed(TOKEN, "engine-0", "e1")) == Left(known=True)
        assert not b.alive("engine-0") and "engine-0" in {w["worker_id"] for w in b.workers()}
        b.register(register("engine-0", incarnation="e1"))  # a stale heartbeat does not bring it back
        assert not b.alive("engine-0")
        b.register(register("engine-0", incarnation="e2"))  # its next process does
        assert b.wait_for("engine-0", timeout_s=1.0, not_incarnation="e1").incarnation == "e2"
    finally:
        store.close()


def test_a_learner_that_does_not_see_the_runtimes_state_is_named_as_such(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The state root's ``state-id`` (written once by the scheduler's broker) read back by a
    worker whose state root is the same directory: it shares the state. A learner whose root is
    another directory (another machine's disk) is named in the log and in the workers' rows,
    since its checkpoints are not where another learner would resume its jobs from."""
    (tmp_path / "state").mkdir()
    b = Broker(config(tmp_path / "state", cluster=ClusterConfig(join_undeclared=True)), TOKEN)
    b.connect = lambda msg: DirectClient(msg.worker_id, {})
    assert b.state_id and read_state_id(tmp_path / "state") == b.state_id
    assert Broker(config(tmp_path / "state"), TOKEN).state_id == b.state_id  # made once, kept after a restart
    (tmp_path / "elsewhere").mkdir()
    assert read_state_id(tmp_path / "elsewhere") == ""
    b.register(register("learner-7", "learner", state_id=read_state_id(tmp_path / "state")))
    with caplog.at_level("WARNING", logger="polytinker.scheduler"):
        b.register(register("learner-8", "learner", state_id=read_state_id(tmp_path / "elsewhere")))
    assert "learner learner-8 does not see this runtime's state_dir" in caplog.text
    assert "learner-7" not in caplog.text
    rows = {w["worker_id"]: w["shares_state"] for w in b.workers()}
    assert rows == {"learner-7": True, "learner-8": False}
    with pytest.raises(AuthError):  # the id is signed with the rest
        b.register(dataclasses.replace(register("learner-8", "learner", incarnation="i2"), state_id=b.state_id))
