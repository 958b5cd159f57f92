"""No tenant starves another. Most tests drive a job manager (a real policy and SQLite state, no
workers) whose clock is moved by hand, running its idle pass as the scheduler's tick does, every
0.5 s; the last runs the in-process runtime with a real engine and learner (the runtime tier).

One tenant's LoRA jobs that hold every adapter slot of the engine and make no call give a slot to
another tenant's waiting job once they have been quiet for ``slot_reclaim_idle_s``: the quiet job
is paused as idle (its versions stay), and its next call queues it again. A job paused by its
tenant stays paused. Calls in flight are shared by weight between the tenants that want them."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum
from polytinker.errors import JobNotRunning, OverloadedError
from polytinker.scheduler.service import EngineWorkerConfig, RuntimeConfig, TenantConfig
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.jobs import JobManager, adapter_key
from polytinker.scheduler.service.load import CONTEND_S, Admission
from polytinker.scheduler.service.scheduler import SchedulerService
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.tenants import Tenants

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789ab"}
SLOTS = 8  # EngineWorkerConfig's default adapter_slots
TICK_S = 0.5  # the scheduler's tick: pause_idle, then schedule


class Clock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager(tmp_path: Path, clock: Clock, **kw: object) -> JobManager:
    tenants_cfg = tuple(TenantConfig(name, api_key=key) for name, key in KEYS.items())
    cfg = RuntimeConfig(model="tiny-random", state_dir=str(tmp_path), tenants=tenants_cfg, **kw)  # type: ignore[arg-type]
    store = StateStore(cfg.state_path / "scheduler.sqlite3")
    tenants = Tenants(store)
    for t in cfg.tenants:
        tenants.add(t)
    return JobManager(cfg, store, tenants.weights(), clock=clock)


def create(mgr: JobManager, tenant: str) -> str:
    row = mgr.create(tenant, m.CreateJob(KEYS[tenant], "lora_rl", "tiny-random"))
    mgr.store.ensure_adapter(adapter_key(tenant, row.job_id, row.agent), tenant, row.job_id, row.agent)
    return row.job_id


def call(mgr: JobManager, tenant: str, job_id: str) -> str:
    """One call naming the job, as a handler makes it: "placed", or the state of the "waiting" answer."""
    with mgr.activity.calls():
        try:
            mgr.running(tenant, job_id)
        except JobNotRunning as exc:
            return exc.state
    return "placed"


def tick(mgr: JobManager, clock: Clock) -> list[str]:
    clock.t += TICK_S
    changed = mgr.pause_idle()
    mgr.schedule()
    return changed


def until_placed(mgr: JobManager, clock: Clock, tenant: str, job_id: str, within_s: float) -> float:
    """Tick, and call the job after each tick as its client retries a "waiting" answer, until it is
    placed; returns the config time that took. Fails past ``within_s``."""
    start = clock.t
    while clock.t - start < within_s:
        tick(mgr, clock)
        if call(mgr, tenant, job_id) == "placed":
            return clock.t - start
    raise AssertionError(f"job {job_id} of {tenant} was not placed within {within_s} s")


def kinds(mgr: JobManager, job_id: str) -> list[str]:
    return [e["kind"] for e in mgr.store.events(job_id)]


def record_version(mgr: JobManager, tenant: str, job_id: str, version: int) -> str:
    """What a durable optim_step leaves in the table; returns the adapter key."""
    key = adapter_key(tenant, job_id, "default")
    mgr.store.record_version(key, version, f"checkpoints/{key}/v{version}", f"adapters/{key}/v{version}")
    return key


def idle_tenant_holding_every_slot(tmp_path: Path) -> tuple[JobManager, Clock, list[str], str]:
    """Bob's SLOTS jobs hold every slot; bob[0] (version 3) has been quiet longest; alice's job waits
    and alice keeps asking. Returns the manager, its clock, bob's jobs and alice's job."""
    clock = Clock()
    mgr = manager(tmp_path, clock)
    bob = [create(mgr, "bob") for _ in range(SLOTS)]
    assert all(call(mgr, "bob", j) == "placed" for j in bob)
    record_version(mgr, "bob", bob[0], 3)
    clock.t += 2.0
    assert all(call(mgr, "bob", j) == "placed" for j in bob[1:])  # bob[0]'s client went quiet 2 s sooner
    alice = create(mgr, "alice")
    assert call(mgr, "alice", alice) == "queued"  # no slot is free
    return mgr, clock, bob, alice


def test_an_idle_tenant_holding_every_slot_gives_one_to_a_waiting_tenant_within_the_reclaim_time(
    tmp_path: Path,
) -> None:
    mgr, clock, bob, alice = idle_tenant_holding_every_slot(tmp_path)
    limit_s = mgr.config.slot_reclaim_idle_s
    assert limit_s == 5.0  # the default: a few seconds, not job_idle_pause_s's hour
    waited_s = until_placed(mgr, clock, "alice", alice, within_s=60.0)
    # bob[0] went quiet 2 s before alice's job queued: it is taken on the first tick it has been
    # quiet for limit_s, not before (the bound: limit_s after the last call, plus one tick).
    assert limit_s - 2.0 <= waited_s <= limit_s - 2.0 + TICK_S
    victim = mgr.get("bob", bob[0])  # the longest idle
    assert victim.state == "paused" and victim.reason.startswith("idle:")
    assert kinds(mgr, bob[0])[-1] == "pause" and "cancel" not in kinds(mgr, bob[0])
    assert "alice" not in victim.reason and alice not in victim.reason  # bob learns nothing of alice
    assert all(mgr.get("bob", j).state == "running" for j in bob[1:])
    assert kinds(mgr, alice)[-2:] == ["reclaim", "start"]
    assert mgr.activity.stats()[alice]["calls"] >= 1


def test_an_evicted_job_comes_back_on_its_next_call_with_its_version(tmp_path: Path) -> None:
    mgr, clock, bob, alice = idle_tenant_holding_every_slot(tmp_path)
    until_placed(mgr, clock, "alice", alice, within_s=mgr.config.slot_reclaim_idle_s + TICK_S)
    assert mgr.get("bob", bob[0]).state == "paused"
    for _ in range(20):  # no call: nothing brings it back by itself
        tick(mgr, clock)
        call(mgr, "alice", alice)
        for j in bob[1:]:
            call(mgr, "bob", j)
    assert mgr.get("bob", bob[0]).state == "paused"
    assert call(mgr, "bob", bob[0]) == "queued"  # queued again: the client is answered "waiting"
    assert kinds(mgr, bob[0])[-1] == "admit"
    # Every other job keeps calling: none is idle, and nothing is taken from a job in use.
    for _ in range(int(3 * mgr.config.slot_reclaim_idle_s / TICK_S)):
        assert tick(mgr, clock) == []
        assert call(mgr, "bob", bob[0]) == "queued"
        call(mgr, "alice", alice)
        for j in bob[1:]:
            call(mgr, "bob", j)
    # Alice goes quiet too: still nothing, as bob holds more than his share and alice less.
    for _ in range(int(3 * mgr.config.slot_reclaim_idle_s / TICK_S)):
        assert tick(mgr, clock) == []
        assert call(mgr, "bob", bob[0]) == "queued"
        for j in bob[1:]:
            call(mgr, "bob", j)
    mgr.action("alice", alice, "finish")  # a slot frees: bob[0] is placed again
    assert call(mgr, "bob", bob[0]) == "placed"
    key = adapter_key("bob", bob[0], "default")
    got = mgr.store.adapter(key)
    assert got is not None and got.version == 3 and mgr.store.version_row(key, 3) is not None


def test_a_job_the_tenant_paused_stays_paused(tmp_path: Path) -> None:
    mgr, clock, bob, alice = idle_tenant_holding_every_slot(tmp_path)
    mgr.action("bob", bob[1], "pause")  # frees a slot: alice's job takes it
    assert call(mgr, "alice", alice) == "placed"
    for _ in range(int(3 * mgr.config.slot_reclaim_idle_s / TICK_S)):
        tick(mgr, clock)
        assert call(mgr, "bob", bob[1]) == "paused"  # a call does not resume it: its tenant paused it
        call(mgr, "alice", alice)
    row = mgr.get("bob", bob[1])
    assert row.state == "paused" and row.reason == "pause requested by its tenant"
    assert mgr.action("bob", bob[1], "resume").state == "queued"  # its tenant resumes it


def test_nothing_is_taken_while_no_one_waits(tmp_path: Path) -> None:
    clock = Clock()
    mgr = manager(tmp_path, clock)
    bob = [create(mgr, "bob") for _ in range(SLOTS)]
    for _ in range(int(30 / TICK_S)):  # quiet for 30 s, and no job queued
        assert tick(mgr, clock) == []
    alice = create(mgr, "alice")  # created, and then its client never asks
    clock.t += 11.0
    assert mgr.pause_idle() == [] and mgr.get("alice", alice).state == "queued"
    assert call(mgr, "alice", alice) == "queued"  # it asks: someone waits now
    assert len(tick(mgr, clock)) == 1 and call(mgr, "alice", alice) == "placed"
    assert sum(mgr.get("bob", j).state == "running" for j in bob) == SLOTS - 1


def test_a_call_in_flight_keeps_a_job_from_being_taken(tmp_path: Path) -> None:
    clock = Clock()
    mgr = manager(tmp_path, clock, engines=(EngineWorkerConfig(adapter_slots=1),))
    bob = create(mgr, "bob")
    alice = create(mgr, "alice")
    started, release = threading.Event(), threading.Event()

    def long_call() -> None:  # one call of bob's that outlasts the limit several times
        with mgr.activity.calls():
            mgr.running("bob", bob)
            started.set()
            release.wait()

    th = threading.Thread(target=long_call)
    th.start()
    started.wait()
    for _ in range(int(20 / TICK_S)):
        assert tick(mgr, clock) == []
        assert call(mgr, "alice", alice) == "queued"
    release.set()
    th.join()
    for _ in range(int(mgr.config.slot_reclaim_idle_s / TICK_S) + 1):  # idle time counts from its end
        tick(mgr, clock)
        call(mgr, "alice", alice)
    assert call(mgr, "alice", alice) == "placed" and mgr.get("bob", bob).state == "paused"


def test_a_taken_jobs_call_is_answered_waiting_by_the_service(tmp_path: Path) -> None:
    """Through the scheduler's handlers (real time, short limits): the evicted job's training call
    is answered "waiting" (the client retries it), as is a call of a job its tenant paused."""
    tenants_cfg = tuple(TenantConfig(name, api_key=key) for name, key in KEYS.items())
    one_slot = (EngineWorkerConfig(adapter_slots=1),)
    cfg = RuntimeConfig(
        model="tiny-random", state_dir=str(tmp_path), tenants=tenants_cfg, engines=one_slot, slot_reclaim_idle_s=0.2
    )
    svc = SchedulerService(cfg, "worker-token-0123456789")
    try:
        h = svc.handlers()
        bob = h["sched.create_job"](m.CreateJob(KEYS["bob"], "lora_rl", "tiny-random")).job["job_id"]
        alice = h["sched.create_job"](m.CreateJob(KEYS["alice"], "lora_rl", "tiny-random")).job["job_id"]
        assert svc.jobs.get("alice", alice).state == "queued"
        time.sleep(0.3)
        assert svc.jobs.pause_idle() == [bob] and svc.jobs.get("alice", alice).state == "running"
        fb = m.ForwardBackward(KEYS["bob"], bob, (Datum([1, 2, 3], [2, 3, 4], [1.0, 1.0, 1.0]),))
        answer = h["sched.forward_backward"](fb)
        assert isinstance(answer, r.WaitingReply) and answer.state == "queued"
        h["sched.job_action"](m.JobAction(KEYS["bob"], bob, "pause"))
        answer = h["sched.forward_backward"](fb)
        assert isinstance(answer, r.WaitingReply) and answer.state == "paused"
        assert svc.jobs.get("bob", bob).reason == "pause requested by its tenant"
    finally:
        svc.stop()


def test_one_tenant_cannot_hold_all_of_a_shared_bound() -> None:
    clock = Clock()
    tenants_cfg = (TenantConfig("alice", api_key=KEYS["alice"]), TenantConfig("bob", api_key=KEYS["bob"], weight=3.0))
    cfg = RuntimeConfig(model="tiny-random", tenants=tenants_cfg, max_inflight_train=4)
    admission = Admission(cfg, clock=clock)

    def try_admit(stack: contextlib.ExitStack, tenant: str) -> bool:
        try:
            stack.enter_context(admission.admit(tenant, "train"))
        except OverloadedError:
            return False
        return True

    bob_calls = [contextlib.ExitStack() for _ in range(4)]
    assert all(try_admit(s, "bob") for s in bob_calls)  # alone, bob may use the whole bound
    alice_call = contextlib.ExitStack()
    assert not try_admit(alice_call, "alice")  # the bound is full: alice now contends
    bob_calls[0].close()
    assert not try_admit(bob_calls[0], "bob")  # bob is at his share (3 of 4, by weight 3:1)
    assert try_admit(alice_call, "alice")  # the freed place is alice's
    assert admission.tenant_status("alice")["in_flight"] == 1
    alice_call.close()
    assert not try_admit(bob_calls[0], "bob")  # alice was refused within CONTEND_S: her place stays hers
    clock.t += CONTEND_S + 1.0  # alice stopped asking: bob may use the whole bound again
    assert try_admit(bob_calls[0], "bob")
    with pytest.raises(OverloadedError, match="in the runtime"), admission.admit("alice", "train"):
        pass
    for s in bob_calls:
        s.close()


def test_end_to_end_the_waiting_tenant_trains_and_the_evicted_job_trains_on_from_its_version(tmp_path: Path) -> None:
    """The in-process runtime (a real engine and learner, tiny-random): bob's two jobs hold both
    adapter slots and go quiet; alice's training call, answered "waiting" and retried by the client,
    runs within slot_reclaim_idle_s + a tick + the client's 2 s back-off cap (+ the call); bob's
    evicted job, called again, comes back and steps from its version 1 to 2."""
    from polytinker.client._connection import Connection
    from polytinker.scheduler.service import InprocRuntime, LearnerWorkerConfig

    tenants_cfg = tuple(TenantConfig(name, api_key=key) for name, key in KEYS.items())
    cfg = RuntimeConfig(
        model="tiny-random",
        state_dir=str(tmp_path / "state"),
        tenants=tenants_cfg,
        engines=(EngineWorkerConfig(adapter_slots=2),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        slot_reclaim_idle_s=1.0,
        start_timeout_s=240.0,
    )
    data = (Datum([5, 6, 7, 8, 9], [6, 7, 8, 9, 10], [0.0, 1.0, 1.0, 1.0, 1.0]),)
    with InprocRuntime(cfg) as rt:
        conns = {t: Connection("", key, rpc=rt.client(), job_wait_s=60.0) for t, key in KEYS.items()}

        def create(t: str) -> str:
            job = m.CreateJob(KEYS[t], "lora_rl", "tiny-random", rank=4)
            return str(conns[t].request("sched.create_job", job, r.JobReply).job["job_id"])

        def step(t: str, job_id: str) -> int:
            fb = m.ForwardBackward(KEYS[t], job_id, data)
            conns[t].request("sched.forward_backward", fb, r.ForwardBackwardReply)
            opt = m.OptimStep(KEYS[t], job_id, AdamParams(learning_rate=1e-2))
            return conns[t].request("sched.optim_step", opt, r.OptimStepReply).version

        bob = [create("bob") for _ in range(2)]
        assert [step("bob", j) for j in bob] == [1, 1]
        alice = create("alice")
        assert rt.service is not None and rt.service.jobs.get("alice", alice).state == "queued"
        start = time.monotonic()
        assert step("alice", alice) == 1
        waited_s = time.monotonic() - start
        assert waited_s < cfg.slot_reclaim_idle_s + TICK_S + 2.0 + 5.0, waited_s  # 5 s for the call on a busy machine
        evicted = rt.service.jobs.get("bob", bob[0])  # the longer idle of bob's two
        assert evicted.state == "paused" and evicted.reason.startswith("idle:")
        assert step("bob", bob[0]) == 2  # queued again on its call, placed in an idle job's slot
        assert rt.service.jobs.get("bob", bob[0]).state == "running"
