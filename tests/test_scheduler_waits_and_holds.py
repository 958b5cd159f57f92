"""What a queued run says while it waits, and which versions pruning keeps (a real policy, SQLite
state and weights catalogue on disk, no workers).

- A LoRA job that finds every adapter slot held is queued with a reason naming its place in the
  queue and what it waits for; ``polytinker jobs``, the "waiting" answer its calls get and the
  Tinker gateway's ``try_again`` (``paused_capacity``, which the official SDK's own type accepts)
  all carry that reason, and a run that runs answers ``active`` again.
- Pruning keeps a version's export while a client holds it or used it within ``sampler_keep_s``,
  drops its learner state, and prunes it once the hold is released; a holder holds at most
  ``max_held_versions``, its oldest hold going first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from polytinker.engine.worker.messages import WeightsRef
from polytinker.errors import AuthError, ConfigError, JobNotRunning
from polytinker.gateway.tinker_runs import queue_fields
from polytinker.scheduler.service import EngineWorkerConfig, RuntimeConfig, TenantConfig
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.audit import AuditLog
from polytinker.scheduler.service.jobs import JobManager, adapter_key
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.tenants import Tenants
from polytinker.scheduler.service.waits import MAX_NOTED
from polytinker.scheduler.service.weights import WeightsCatalog

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"


def setup(tmp_path: Path, **kw: object) -> tuple[RuntimeConfig, JobManager]:
    cfg = RuntimeConfig(
        model="tiny-random",
        state_dir=str(tmp_path),
        tenants=(TenantConfig("alice", api_key=KEY_A), TenantConfig("bob", api_key=KEY_B)),
        **kw,  # type: ignore[arg-type]
    )
    store = StateStore(cfg.state_path / "scheduler.sqlite3")
    tenants = Tenants(store)
    for t in cfg.tenants:
        tenants.add(t)
    return cfg, JobManager(cfg, store, tenants.weights())


def lora(mgr: JobManager, tenant: str = "alice") -> str:
    key = KEY_A if tenant == "alice" else KEY_B
    return mgr.create(tenant, m.CreateJob(key, "lora_rl", "tiny-random", rank=4)).job_id


def test_a_run_queued_for_an_adapter_slot_says_where_it_stands_everywhere(tmp_path: Path) -> None:
    try_again = pytest.importorskip("tinker.types.try_again_response")
    _, mgr = setup(tmp_path, engines=(EngineWorkerConfig(adapter_slots=2),))
    first, second = lora(mgr), lora(mgr, "bob")
    third, fourth = lora(mgr), lora(mgr, "bob")
    assert [mgr.get("alice", j).state for j in (first,)] == ["running"]
    assert mgr.get("bob", second).state == "running"
    waits = {j: mgr.get(t, j).reason for j, t in ((third, "alice"), (fourth, "bob"))}
    slots = "waiting for an adapter slot: all 2 on the 1 engine(s) of tiny-random are held by jobs"
    assert waits[third] == f"queued for capacity: position 1 in the queue; {slots}", waits
    assert waits[fourth] == f"queued for capacity: position 2 in the queue; {slots}", waits
    assert "bob" not in waits[third] and second not in waits[third]  # another tenant's jobs are not named

    with pytest.raises(JobNotRunning) as waiting:  # what a call of the queued run is answered
        mgr.running("alice", third)
    assert waits[third] in str(waiting.value)

    answer = {"type": "try_again", "request_id": "r1", "queue_state": "active"}
    answer |= queue_fields("session-x:train:2", mgr.get("alice", third).public(), {})
    parsed = try_again.TryAgainResponse.model_validate(answer)  # the SDK's own type of the answer
    assert parsed.queue_state == "paused_capacity"
    assert answer["queue_state_reason"] == f"training run {third} is {waits[third]}"

    mgr.action("alice", first, "finish")  # its slot goes back: the run ahead in the queue starts
    assert mgr.get("alice", third).state == "running"
    assert queue_fields("session-x:train:2", mgr.get("alice", third).public(), {}) == {}
    assert mgr.get("bob", fourth).reason.startswith("queued for capacity: position 1 in the queue;")
    mgr.action("alice", third, "pause")  # paused by its tenant: its calls wait, and say why
    paused = queue_fields("m", mgr.get("alice", third).public(), {})
    assert (
        paused["queue_state"] == "paused_capacity" and "pause requested by its tenant" in paused["queue_state_reason"]
    )


def test_a_run_pushed_behind_the_first_ones_in_the_queue_says_so(tmp_path: Path) -> None:
    _, mgr = setup(tmp_path, engines=(EngineWorkerConfig(adapter_slots=1),))
    lora(mgr)
    queued = [lora(mgr) for _ in range(MAX_NOTED)]
    assert mgr.get("alice", queued[-1]).reason.startswith(f"queued for capacity: position {MAX_NOTED} in the queue;")
    urgent = mgr.create("bob", m.CreateJob(KEY_B, "lora_rl", "tiny-random", rank=4, priority=5)).job_id
    assert mgr.get("bob", urgent).reason.startswith("queued for capacity: position 1 in the queue;")
    assert mgr.get("alice", queued[0]).reason.startswith("queued for capacity: position 2 in the queue;")
    assert mgr.get("alice", queued[-1]).reason == f"queued for capacity: behind the first {MAX_NOTED} in the queue"


def _versions(cfg: RuntimeConfig, mgr: JobManager, job_id: str, n: int) -> tuple[WeightsCatalog, str]:
    """A catalogue whose adapter of ``job_id`` has versions 1..n on disk, as a learner writes
    them (a checkpoint and an export each); pruned after each as the scheduler does."""
    store = mgr.store
    weights = WeightsCatalog(cfg.state_path, store, mgr, cfg, AuditLog(store, lambda key: "alice"))
    key = adapter_key("alice", job_id, "default")
    store.ensure_adapter(key, "alice", job_id, "default")
    for v in range(1, n + 1):
        ckpt, export = WeightsRef(key, v), WeightsRef(key, v, "export")
        for ref in (ckpt, export):
            where = cfg.state_path / ref.relative_path
            where.mkdir(parents=True)
            (where / "weights").write_bytes(b"x")
        store.record_version(key, v, ckpt.relative_path, export.relative_path)
        a = store.adapter(key)
        assert a is not None
        weights.prune(a, v)
    return weights, key


def test_a_held_version_outlives_pruning_until_released_and_keeps_only_its_export(tmp_path: Path) -> None:
    cfg, mgr = setup(tmp_path, keep_checkpoints=2, sampler_keep_s=0.0)
    job = lora(mgr)
    weights, key = _versions(cfg, mgr, job, 3)
    path = f"polytinker://{job}/default@3"
    assert weights.resolve("alice", path)[1] == 3
    weights.hold("alice", "session-1", path)
    with pytest.raises(AuthError):
        weights.hold("bob", "session-2", path)  # another tenant's unpublished version: nothing to hold
    a = mgr.store.adapter(key)
    assert a is not None
    for v in range(4, 14):  # ten more steps
        ckpt, export = WeightsRef(key, v), WeightsRef(key, v, "export")
        mgr.store.record_version(key, v, ckpt.relative_path, export.relative_path)
        weights.prune(a, v)
    assert weights.resolve("alice", path)[1] == 3  # held: still sampleable
    assert (cfg.state_path / WeightsRef(key, 3, "export").relative_path).is_dir()
    assert not (cfg.state_path / WeightsRef(key, 3).relative_path).exists()  # its learner state went
    with pytest.raises(AuthError):
        weights.resolve("alice", f"polytinker://{job}/default@2")  # not held: pruned as before
    assert weights.release("bob", "session-1") == 0  # another tenant cannot release alice's hold
    assert weights.release("alice", "session-1") == 1
    with pytest.raises(AuthError):
        weights.resolve("alice", path)
    assert not (cfg.state_path / WeightsRef(key, 3, "export").relative_path).exists()
    assert weights.resolve("alice", f"polytinker://{job}/default@13")[1] == 13  # the last keep_checkpoints stay


def test_a_version_used_within_sampler_keep_s_is_kept(tmp_path: Path) -> None:
    cfg, mgr = setup(tmp_path, keep_checkpoints=1, sampler_keep_s=600.0)
    job = lora(mgr)
    weights, key = _versions(cfg, mgr, job, 2)
    weights.used(key, 2)  # handed out (save_weights_for_sampler) at version 2
    a = mgr.store.adapter(key)
    assert a is not None
    for v in (3, 4, 5):
        mgr.store.record_version(key, v, WeightsRef(key, v).relative_path, WeightsRef(key, v, "export").relative_path)
        weights.prune(a, v)
    assert weights.resolve("alice", f"polytinker://{job}/default@2")[1] == 2
    with pytest.raises(AuthError):
        weights.resolve("alice", f"polytinker://{job}/default@3")  # never handed out: pruned by count
    weights.sampler_keep_s = 0.0  # the window has passed
    weights.prune(a, 5)
    with pytest.raises(AuthError):
        weights.resolve("alice", f"polytinker://{job}/default@2")


def test_a_holder_holds_at_most_max_held_versions_and_its_oldest_hold_goes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Tinker RL loop makes a sampler per step, each holding its version under the session: past
    max_held_versions the session's oldest hold goes (logged), and that version is pruned as any
    other; a version held again counts as new, and another holder's holds are its own."""
    cfg, mgr = setup(tmp_path, keep_checkpoints=1, sampler_keep_s=0.0, max_held_versions=3)
    job = lora(mgr)
    weights, key = _versions(cfg, mgr, job, 1)
    a = mgr.store.adapter(key)
    assert a is not None

    def step_and_hold(v: int, holder: str = "session-1") -> None:
        for ref in (WeightsRef(key, v), WeightsRef(key, v, "export")):
            (cfg.state_path / ref.relative_path).mkdir(parents=True)
        mgr.store.record_version(key, v, WeightsRef(key, v).relative_path, WeightsRef(key, v, "export").relative_path)
        weights.hold("alice", holder, f"polytinker://{job}/default@{v}")
        weights.prune(a, v)

    weights.hold("alice", "session-1", f"polytinker://{job}/default@1")
    weights.hold("alice", "session-2", f"polytinker://{job}/default@1")  # another holder: its own bound
    with caplog.at_level("INFO", logger="polytinker.scheduler.weights"):
        for v in range(2, 7):
            step_and_hold(v)
    assert weights.holds.count("alice", "session-1") == 3 and sorted(weights.holds.held(key)) == [1, 4, 5, 6]
    assert "session-1 of tenant alice holds 3 newer versions (max_held_versions)" in caplog.text
    for v in (2, 3):  # released and past keep_checkpoints: pruned, files and all
        with pytest.raises(AuthError):
            weights.resolve("alice", f"polytinker://{job}/default@{v}")
        assert not (cfg.state_path / WeightsRef(key, v, "export").relative_path).exists()
    assert weights.resolve("alice", f"polytinker://{job}/default@1")[1] == 1  # session-2 still holds it
    weights.hold("alice", "session-1", f"polytinker://{job}/default@4")  # held again: now its newest
    step_and_hold(7)
    assert sorted(v for v in weights.holds.held(key) if v != 1) == [4, 6, 7]  # 5 went, not 4
    with pytest.raises(AuthError):
        weights.resolve("alice", f"polytinker://{job}/default@5")
    with pytest.raises(ConfigError, match="max_held_versions must be a whole number >= 1"):
        RuntimeConfig(model="tiny-random", max_held_versions=0)


def test_a_hand_outs_window_outlives_a_scheduler_restart(tmp_path: Path) -> None:
    """A version handed out (save_weights) just before the scheduler restarts stays sampleable for
    the rest of its sampler_keep_s: the hand-out time is in the state, not in the old process. A
    version only sampled counts its window in the process, and a restart starts it again."""
    cfg, mgr = setup(tmp_path, keep_checkpoints=1, sampler_keep_s=600.0)
    job = lora(mgr)
    weights, key = _versions(cfg, mgr, job, 2)
    a = mgr.store.adapter(key)
    assert a is not None

    def step(catalogue: WeightsCatalog, v: int) -> None:
        mgr.store.record_version(key, v, WeightsRef(key, v).relative_path, WeightsRef(key, v, "export").relative_path)
        catalogue.prune(a, v)

    weights.handed_out("alice", key, 2)
    step(weights, 3)
    weights.used(key, 3)  # sampled
    step(weights, 4)
    assert {v for v in (2, 3) if weights.resolve("alice", f"polytinker://{job}/default@{v}")} == {2, 3}
    restarted = WeightsCatalog(cfg.state_path, mgr.store, mgr, cfg, AuditLog(mgr.store, lambda key: "alice"))
    step(restarted, 5)
    assert restarted.resolve("alice", f"polytinker://{job}/default@2")[1] == 2  # its window counts from the hand-out
    with pytest.raises(AuthError):
        restarted.resolve("alice", f"polytinker://{job}/default@3")  # its sampling window went with the process
    assert restarted.holds.count("alice", "") == 1  # the hand-out row; no client can name that holder
    restarted.sampler_keep_s = 0.0  # the window has passed: the version goes, and so does its row
    step(restarted, 6)
    with pytest.raises(AuthError):
        restarted.resolve("alice", f"polytinker://{job}/default@2")
    assert restarted.holds.count("alice", "") == 0
    with pytest.raises(ConfigError, match="holder"):
        restarted.release("alice", "")
