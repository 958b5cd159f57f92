"""The idle rules and job history of the job manager (a real policy and SQLite state, no
workers): activity of any kind keeps a job live, a call in flight too; an idle pause is recorded
as a pause with its reason, never a cancel; an idle inference job is paused sooner, finished once
its client is surely gone, and pruned; the client's back-off has full jitter under a cap."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from polytinker.client._connection import backoff_s
from polytinker.scheduler.service import RuntimeConfig, TenantConfig
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.idle import idle_verdict
from polytinker.scheduler.service.jobs import JobManager
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.tenants import Tenants

KEY_A = "alice-key-0123456789"


def manager(tmp_path: Path, **kw: object) -> JobManager:
    cfg = RuntimeConfig(
        model="tiny-random", state_dir=str(tmp_path), tenants=(TenantConfig("alice", api_key=KEY_A),), **kw
    )  # type: ignore[arg-type]
    store = StateStore(cfg.state_path / "scheduler.sqlite3")
    tenants = Tenants(store)
    tenants.add(cfg.tenants[0])
    return JobManager(cfg, store, tenants.weights())


def create(mgr: JobManager, kind: str) -> str:
    return mgr.create("alice", m.CreateJob(KEY_A, kind, "tiny-random")).job_id


def kinds(mgr: JobManager, job_id: str) -> list[str]:
    return [e["kind"] for e in mgr.store.events(job_id)]


def test_the_idle_rules() -> None:
    cfg = RuntimeConfig(model="tiny-random", inference_idle_s=10.0, job_idle_pause_s=100.0)
    v = lambda kind, state, idle_s, placed=True, busy=0, reason="": idle_verdict(  # noqa: E731
        cfg, kind, state, reason, placed=placed, idle_s=idle_s, in_flight=busy
    )
    assert v("inference", "running", 9.9) is None and v("inference", "running", 10.0) == "pause"
    assert v("inference", "running", 1e6, busy=1) is None  # a call in flight: never idle
    assert v("inference", "queued", 10.0, placed=False) == "pause"  # no client asks for it any more
    assert v("lora_rl", "queued", 1e6, placed=False) is None  # training jobs wait in the queue
    assert v("lora_rl", "running", 99.0) is None and v("lora_rl", "running", 100.0) == "pause"
    idle = "idle: no call for 10 s"
    assert v("inference", "paused", 109.0, placed=False, reason=idle) is None
    assert v("inference", "paused", 110.0, placed=False, reason=idle) == "finish"
    assert v("inference", "paused", 1e6, placed=False, reason="pause requested by its tenant") is None
    assert v("lora_rl", "paused", 1e6, placed=False, reason=idle) is None  # it holds state: stays paused


def test_an_idle_pause_is_a_pause_in_the_history_and_any_call_keeps_a_job_live(tmp_path: Path) -> None:
    mgr = manager(tmp_path, job_idle_pause_s=0.3, inference_idle_s=0.3)
    trainer, sampler = create(mgr, "lora_rl"), create(mgr, "inference")
    assert mgr.get("alice", trainer).state == mgr.get("alice", sampler).state == "running"
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # the trainer's adapter is sampled, the sampler samples
        mgr.touch(trainer)
        mgr.running("alice", sampler)
        assert mgr.pause_idle() == []
        time.sleep(0.05)
    release, started = threading.Event(), threading.Event()

    def long_call() -> None:  # one call that outlasts the idle limit
        with mgr.activity.calls():
            mgr.running("alice", trainer)
            started.set()
            release.wait()

    th = threading.Thread(target=long_call)
    th.start()
    started.wait()
    time.sleep(0.4)
    assert mgr.pause_idle() == [sampler]  # the trainer's call is in flight; the sampler went quiet
    assert mgr.activity.stats()[trainer]["in_flight"] == 1
    row = mgr.get("alice", sampler)
    assert row.state == "paused" and row.reason.startswith("idle:")
    assert kinds(mgr, sampler)[-1] == "pause" and "cancel" not in kinds(mgr, sampler)
    assert mgr.running("alice", sampler)[0].state == "running"  # its next call resumes it
    mgr.action("alice", sampler, "finish")
    assert kinds(mgr, sampler)[-1] == "finish" and "cancel" not in kinds(mgr, sampler)
    release.set()
    th.join()
    assert mgr.activity.stats()[trainer] | {"idle_s": 0} == {"calls": 1, "in_flight": 0, "idle_s": 0}
    time.sleep(0.35)  # idle time counts from the end of its last call
    assert mgr.pause_idle() == [trainer]
    row = mgr.get("alice", trainer)
    assert row.state == "paused" and row.reason.startswith("idle:")
    assert kinds(mgr, trainer)[-1] == "pause" and "cancel" not in kinds(mgr, trainer)


def test_a_forgotten_sampler_is_finished_and_finished_samplers_are_pruned(tmp_path: Path) -> None:
    mgr = manager(tmp_path, job_idle_pause_s=0.3, inference_idle_s=0.2, keep_finished_inference=2)
    forgotten = create(mgr, "inference")
    time.sleep(0.25)
    assert mgr.pause_idle() == [forgotten] and mgr.get("alice", forgotten).state == "paused"
    time.sleep(0.3)
    assert mgr.pause_idle() == [forgotten]
    row = mgr.get("alice", forgotten)
    assert row.state == "done" and row.reason.startswith("idle:") and kinds(mgr, forgotten)[-2:] == ["pause", "finish"]
    assert mgr.running("alice", forgotten)[0].state == "running"  # its client was only quiet: resumed
    mgr.action("alice", forgotten, "finish")
    closed = [create(mgr, "inference") for _ in range(3)]
    for job_id in closed:
        mgr.action("alice", job_id, "finish")
    trainer = create(mgr, "sft")
    mgr.action("alice", trainer, "finish")
    assert sorted(mgr.prune_finished()) == sorted([forgotten, closed[0]])  # the two newest stay
    left = {r.job_id for r in mgr.store.jobs("alice")}
    assert left == {*closed[1:], trainer} and mgr.store.events(forgotten) == []


def test_the_back_off_is_exponential_with_full_jitter_and_capped() -> None:
    rng = random.Random(0)
    waits = [[backoff_s(1.0, tries, 10.0, rng) for _ in range(2000)] for tries in range(6)]
    for tries, w in enumerate(waits):
        ceiling = min(10.0, 2.0**tries)
        assert min(w) >= 0.0 and max(w) <= ceiling
        assert abs(sum(w) / len(w) - ceiling / 2) < 0.1 * ceiling  # uniform over [0, ceiling]


def test_refusals_are_counted_per_tenant_and_logged_rate_limited(tmp_path: Path, caplog) -> None:
    from polytinker.errors import OverloadedError
    from polytinker.scheduler.service.load import Admission

    cfg = RuntimeConfig(model="tiny-random", max_inflight_per_tenant=2, retry_after_s=0.5)
    admission = Admission(cfg, log_period_s=60.0)
    with caplog.at_level("WARNING", logger="polytinker.scheduler.service"):
        with admission.admit("alice", "sample"), admission.admit("alice", "train"):
            for _ in range(5):
                try:
                    with admission.admit("alice", "sample"):
                        raise AssertionError("admitted past the per-tenant bound")
                except OverloadedError as exc:
                    assert exc.retry_after_s == 0.5 and "max_inflight_per_tenant=2" in str(exc)
            with admission.admit("bob", "sample"):  # another tenant's bound is its own
                assert admission.tenant_status("alice")["in_flight"] == 2
        admission.waited("bob")
    assert admission.tenant_status("alice") == {"in_flight": 0, "completed": 2, "failed": 0, "refused": 5, "waiting": 0}
    assert admission.tenant_status("bob") == {"in_flight": 0, "completed": 1, "failed": 0, "refused": 0, "waiting": 1}
    totals = admission.totals()
    assert totals["refused"] == 5 and totals["completed"] == 3 and totals["in_flight"] == {"sample": 0, "train": 0}
    refusals = [r for r in caplog.records if "overloaded: refused" in r.getMessage()]
    assert len(refusals) == 1 and "tenant alice" in refusals[0].getMessage()  # the rest wait for the next summary
