"""The scheduling policy: fair share, priorities, backfill, preemption, admission, bounded queues."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import replace

import pytest

from polytinker.errors import ConfigError
from polytinker.scheduler import (
    Accepted,
    ClusterSpec,
    DecisionKind,
    EngineSpec,
    FairSharePolicy,
    FifoPolicy,
    Job,
    JobKind,
    JobState,
    LearnerSpec,
    Overloaded,
    Rejected,
    SchedulerPolicyConfig,
    SimulatorConfig,
    simulate,
)


def one_group(memory_gb: float = 80.0, engines: int = 0) -> ClusterSpec:
    return ClusterSpec(
        tuple(EngineSpec(f"e{i}", "base", memory_gb=40.0, adapter_slots=2) for i in range(engines)),
        # Host memory as small as the accelerator's: the sum of shared jobs' states is what binds.
        (LearnerSpec("g0", "base", memory_gb=memory_gb, host_memory_gb=memory_gb),),
    )


def sft(job_id: str, mem: float = 10.0, *, tenant: str = "t", priority: int = 0, steps: int = 5, at: float = 0) -> Job:
    return Job(job_id, tenant, JobKind.SFT, "base", priority, steps, 1.0, 0.0, mem, 0.0, arrival_s=at)


def started(decisions) -> list[str]:
    return [d.job_id for d in decisions if d.kind is DecisionKind.START]


def test_fair_share_converges_to_weights():
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    cfg = SchedulerPolicyConfig(tenant_weights=tuple(weights.items()))
    policy = FairSharePolicy(one_group(), cfg)
    for tenant in weights:
        for i in range(400):
            policy.submit(sft(f"{tenant}{i}", tenant=tenant), 0.0)
    running: deque[str] = deque()
    starts: Counter[str] = Counter()
    for t in range(600):
        for job_id in started(policy.schedule(float(t))):
            starts[job_id[0]] += 1
            running.append(job_id)
        policy.job_finished(running.popleft(), float(t) + 0.5)
    total = sum(starts.values())
    for tenant, w in weights.items():
        assert starts[tenant] / total == pytest.approx(w / sum(weights.values()), abs=0.02), starts


def test_idle_tenant_does_not_bank_credit():
    policy = FairSharePolicy(one_group(memory_gb=10.0))
    for i in range(50):
        policy.submit(sft(f"a{i}", tenant="a"), 0.0)
    for t in range(20):
        (job_id,) = started(policy.schedule(float(t)))
        policy.job_finished(job_id, t + 0.5)
    # b arrives late: it may go first now, but it must not then run 20 jobs in a row.
    for i in range(50):
        policy.submit(sft(f"b{i}", tenant="b"), 20.0)
    order = []
    for t in range(20, 40):
        (job_id,) = started(policy.schedule(float(t)))
        order.append(job_id[0])
        policy.job_finished(job_id, t + 0.5)
    assert 8 <= order.count("a") <= 12, order


def test_higher_priority_runs_first():
    policy = FairSharePolicy(one_group(memory_gb=10.0), SchedulerPolicyConfig(preemption=False))
    policy.submit(sft("low", tenant="x", priority=0), 0.0)
    policy.submit(sft("high", tenant="y", priority=2), 0.1)
    assert started(policy.schedule(1.0)) == ["high"]


def test_no_head_of_line_blocking():
    cluster = one_group(memory_gb=80.0)
    for policy_cls, expect in ((FairSharePolicy, ["small"]), (FifoPolicy, [])):
        policy = policy_cls(cluster)
        policy.submit(sft("running", mem=50.0), 0.0)
        assert started(policy.schedule(0.0)) == ["running"]
        policy.submit(sft("big", mem=60.0, steps=1), 1.0)  # fits the cluster, not now
        policy.submit(sft("small", mem=10.0, steps=50), 2.0)  # fits now, behind it
        assert started(policy.schedule(3.0)) == expect, policy.name
        assert policy.state("big") is JobState.QUEUED


def test_backfill_depth_bounds_the_search_but_fitting_jobs_still_start():
    policy = FairSharePolicy(one_group(memory_gb=80.0), SchedulerPolicyConfig(backfill_depth=3))
    policy.submit(sft("running", mem=50.0), 0.0)
    policy.schedule(0.0)
    for i in range(5):
        policy.submit(sft(f"big{i}", mem=60.0, steps=1), 1.0)
    policy.submit(sft("small", mem=10.0, steps=100), 1.0)
    # Ordered by size, the small-but-long job comes after the five big-but-short ones: out of reach.
    assert started(policy.schedule(2.0)) == []


def test_preemption_picks_lowest_priority_and_saves_state():
    policy = FairSharePolicy(one_group(memory_gb=80.0))
    policy.submit(sft("p0", mem=30.0, priority=0), 0.0)
    policy.submit(sft("p1", mem=30.0, priority=1), 0.0)
    assert sorted(started(policy.schedule(0.0))) == ["p0", "p1"]
    policy.submit(sft("urgent", mem=40.0, priority=2), 1.0)
    decisions = policy.schedule(1.0)
    preempts = [d for d in decisions if d.kind is DecisionKind.PREEMPT]
    assert [d.job_id for d in preempts] == ["p0"]
    assert preempts[0].save_state and preempts[0].for_job == "urgent" and "step boundary" in preempts[0].reason
    assert policy.state("p0") is JobState.PREEMPTING and policy.state("urgent") is JobState.QUEUED
    assert started(policy.schedule(1.5)) == []  # p0 holds its memory until its step ends
    requeue = policy.job_stopped("p0", 2.0, steps_done=2)
    assert requeue.kind is DecisionKind.REQUEUE and policy.steps_done("p0") == 2
    assert started(policy.schedule(2.0)) == ["urgent"]
    assert policy.state("p1") is JobState.RUNNING


def test_equal_priority_is_never_preempted():
    policy = FairSharePolicy(one_group(memory_gb=40.0))
    policy.submit(sft("a", mem=40.0, priority=1), 0.0)
    policy.schedule(0.0)
    policy.submit(sft("b", mem=40.0, priority=1), 1.0)
    assert not [d for d in policy.schedule(1.0) if d.kind is DecisionKind.PREEMPT]


def test_preemption_happens_at_step_boundaries_in_simulation():
    cluster = one_group(memory_gb=40.0)
    victim = Job("victim", "t", JobKind.SFT, "base", 0, 10, 10.0, 0.0, 40.0, 0.0, arrival_s=0.0)
    urgent = Job("urgent", "u", JobKind.SFT, "base", 5, 1, 1.0, 0.0, 40.0, 0.0, arrival_s=15.0)
    sim_cfg = SimulatorConfig(checkpoint_save_s=2.0, checkpoint_load_s=3.0)
    result = simulate([victim, urgent], cluster, FairSharePolicy, config=sim_cfg)
    log = {(d.kind, d.job_id): d for d in result.decisions}
    assert log[(DecisionKind.PREEMPT, "victim")].time_s == 15.0
    # Decided at 15 s, mid-step; the step ends at 20 s, state saved by 22 s.
    assert log[(DecisionKind.REQUEUE, "victim")].time_s == 22.0
    assert log[(DecisionKind.START, "urgent")].time_s == 22.0
    outcome = {o.job_id: o for o in result.outcomes}
    assert outcome["urgent"].finish_s == 23.0
    # Resumes at 23 s, loads its state (3 s), then its 8 remaining steps.
    assert outcome["victim"].finish_s == 23.0 + 3.0 + 80.0 and outcome["victim"].preemptions == 1


def test_admission_rejects_what_can_never_fit_and_queues_what_can_later():
    cluster = one_group(memory_gb=80.0, engines=1)
    for policy in (FairSharePolicy(cluster), FifoPolicy(cluster)):
        answer = policy.submit(sft("huge", mem=200.0), 0.0)
        assert isinstance(answer, Rejected) and "200 GB of learner memory" in answer.decision.reason
        other = Job("other", "t", JobKind.SFT, "other-model", 0, 1, 1.0, 0.0, 1.0, 0.0)
        assert "no learner group serves base model other-model" in policy.submit(other, 0.0).decision.reason
        kv = Job("kv", "t", JobKind.INFERENCE, "base", 0, 1, 0.0, 1.0, 0.0, 50.0)
        assert "engine memory" in policy.submit(kv, 0.0).decision.reason
        policy.submit(sft("filler", mem=80.0), 0.0)
        policy.schedule(0.0)
        assert isinstance(policy.submit(sft("later", mem=80.0), 1.0), Accepted)
        assert policy.state("later") is JobState.QUEUED


def test_bounded_queue_answers_overloaded_with_retry_after():
    cfg = SchedulerPolicyConfig(max_queued_jobs=3, max_queued_per_tenant=2, retry_after_min_s=1.0)
    policy = FairSharePolicy(one_group(memory_gb=10.0), cfg)
    assert isinstance(policy.submit(sft("a0", tenant="a"), 0.0), Accepted)
    assert isinstance(policy.submit(sft("a1", tenant="a"), 0.0), Accepted)
    per_tenant = policy.submit(sft("a2", tenant="a"), 0.0)
    assert isinstance(per_tenant, Overloaded) and 1.0 <= per_tenant.retry_after_s <= cfg.retry_after_max_s
    assert isinstance(policy.submit(sft("b0", tenant="b"), 0.0), Accepted)
    full = policy.submit(sft("c0", tenant="c"), 0.0)
    assert isinstance(full, Overloaded) and "queue full" in full.decision.reason
    assert policy.queued_count == 3
    # Completions every 5 s teach it how long to ask the client to wait.
    for t in range(3):
        (job_id,) = started(policy.schedule(5.0 * t))
        policy.job_finished(job_id, 5.0 * t + 5.0)
    for i in range(3):
        policy.submit(sft(f"d{i}", tenant=f"d{i}"), 20.0)
    again = policy.submit(sft("e0", tenant="e"), 20.0)
    assert isinstance(again, Overloaded) and again.retry_after_s == pytest.approx(5.0)


def test_starving_job_gets_a_reservation():
    cfg = SchedulerPolicyConfig(starvation_s=100.0, order_by_size=True)
    policy = FairSharePolicy(one_group(memory_gb=80.0), cfg)
    policy.submit(sft("big", mem=80.0, steps=100), 0.0)
    policy.submit(sft("s0", mem=10.0), 0.0)
    assert started(policy.schedule(0.0)) == ["s0"]
    policy.submit(sft("s1", mem=10.0), 50.0)
    assert started(policy.schedule(50.0)) == ["s1"]  # not starving yet: backfill goes on
    policy.submit(sft("s2", mem=10.0), 150.0)
    decisions = policy.schedule(150.0)
    assert [d.kind for d in decisions] == [DecisionKind.RESERVE] and decisions[0].job_id == "big"
    policy.job_finished("s0", 151.0)
    assert started(policy.schedule(151.0)) == []  # s2 may not take the reserved group
    policy.job_finished("s1", 152.0)
    assert started(policy.schedule(152.0)) == ["big"]


def test_cancel_and_misuse():
    policy = FairSharePolicy(one_group())
    policy.submit(sft("a"), 0.0)
    with pytest.raises(ConfigError, match="already submitted"):
        policy.submit(sft("a"), 0.0)
    assert policy.cancel("a", 1.0).kind is DecisionKind.CANCEL
    assert policy.queued_count == 0 and started(policy.schedule(1.0)) == []
    with pytest.raises(ConfigError):
        policy.cancel("a", 2.0)
    with pytest.raises(ConfigError, match="set step_s"):
        Job("x", "t", JobKind.LORA_RL, "base", adapter="ad")


def test_every_decision_has_a_reason():
    cluster = one_group(memory_gb=80.0, engines=2)
    jobs = [sft(f"s{i}", mem=30.0, priority=i % 3, at=float(i)) for i in range(12)]
    result = simulate(jobs, cluster, FairSharePolicy)
    assert result.decisions and all(d.reason for d in result.decisions)
    assert {DecisionKind.ADMIT, DecisionKind.START, DecisionKind.FINISH} <= {d.kind for d in result.decisions}


def test_one_pass_looks_at_a_bounded_number_of_jobs():
    cfg = SchedulerPolicyConfig(backfill_depth=16)
    policy = FairSharePolicy(one_group(memory_gb=80.0), cfg)
    policy.submit(sft("running", mem=80.0, priority=5), 0.0)
    policy.schedule(0.0)
    for i in range(10_000):
        policy.submit(sft(f"q{i}", mem=10.0, tenant=f"t{i % 7}", priority=i % 3, steps=1 + i % 50), 1.0)
    calls = 0
    fit = policy.cluster.fit

    def counting_fit(*args, **kwargs):
        nonlocal calls
        calls += 1
        return fit(*args, **kwargs)

    policy.cluster.fit = counting_fit  # type: ignore[method-assign]
    assert started(policy.schedule(2.0)) == []
    assert calls <= cfg.backfill_depth + 1  # not 10,000: a pass stops after backfill_depth misses


def test_overloaded_submissions_are_retried_in_simulation():
    cfg = SchedulerPolicyConfig(max_queued_jobs=2, retry_after_min_s=5.0)
    jobs = [sft(f"s{i}", mem=40.0) for i in range(8)]
    result = simulate(jobs, one_group(memory_gb=40.0), FairSharePolicy, cfg)
    assert all(o.finish_s is not None for o in result.outcomes)
    assert sum(o.retries for o in result.outcomes) > 0
    assert any(d.kind is DecisionKind.OVERLOADED for d in result.decisions)


def test_a_reserved_job_starts_even_behind_many_it_keeps_out():
    cfg = SchedulerPolicyConfig(starvation_s=10.0, backfill_depth=2)
    policy = FairSharePolicy(one_group(memory_gb=80.0), cfg)
    policy.submit(sft("running", mem=10.0, steps=1000), 0.0)
    policy.schedule(0.0)
    policy.submit(sft("big", mem=80.0, steps=100), 0.0)
    assert [d.kind for d in policy.schedule(20.0)] == [DecisionKind.RESERVE]
    for i in range(10):  # smaller, so ahead of "big" in the queue order; the reservation blocks them
        policy.submit(sft(f"small{i}", mem=10.0, steps=1), 21.0)
    assert started(policy.schedule(21.0)) == []
    policy.job_finished("running", 30.0)
    assert started(policy.schedule(30.0))[0] == "big"


def test_a_starving_job_that_fits_starts_even_beyond_the_backfill_depth():
    cfg = SchedulerPolicyConfig(starvation_s=10.0, backfill_depth=2)
    policy = FairSharePolicy(one_group(memory_gb=80.0), cfg)
    policy.submit(sft("running", mem=60.0, steps=1000), 0.0)
    policy.schedule(0.0)
    policy.submit(sft("old", mem=20.0, steps=500), 0.0)  # fits, but ranks behind the short jobs below
    for i in range(5):
        policy.submit(sft(f"short{i}", mem=30.0, steps=1), 0.0)  # none fits next to "running"
    assert started(policy.schedule(5.0)) == []  # "old" is out of the pass's reach, not yet starving
    assert started(policy.schedule(11.0)) == ["old"]


def lora(job_id: str, mem: float, *, steps: int, step_s: float, sample_s: float, at: float = 0) -> Job:
    return Job(job_id, "t", JobKind.LORA_RL, "base", 0, steps, step_s, sample_s, mem, 4.0, at, f"t/{job_id}")


@pytest.mark.parametrize("backfill", [True, False])
def test_backfill_on_a_reserved_group_only_when_done_before_it_frees(backfill):
    cfg = SchedulerPolicyConfig(starvation_s=10.0, backfill_reserved=backfill)
    policy = FairSharePolicy(one_group(memory_gb=80.0, engines=1), cfg)
    # Declared to hold the group until t=1000, training only 1 s in every 10.
    policy.submit(lora("running", 40.0, steps=100, step_s=1.0, sample_s=9.0), 0.0)
    assert started(policy.schedule(0.0)) == ["running"]
    policy.submit(sft("big", mem=80.0, steps=100), 0.0)
    decisions = policy.schedule(20.0)
    assert [d.kind for d in decisions] == [DecisionKind.RESERVE] and "expected free at 1000" in decisions[0].reason
    policy.submit(sft("long", mem=10.0, steps=2000), 21.0)  # 2000 s: would outlast the reservation
    policy.submit(sft("short", mem=10.0, steps=10), 21.0)  # 10 s of training in a window of 979 s
    assert started(policy.schedule(21.0)) == (["short"] if backfill else [])
    policy.job_finished("running", 1000.0)
    if backfill:
        policy.job_finished("short", 1000.0)
    assert started(policy.schedule(1000.0)) == ["big"]


def test_no_backfill_on_a_reserved_group_its_jobs_keep_busy():
    cfg = SchedulerPolicyConfig(starvation_s=10.0)
    policy = FairSharePolicy(one_group(memory_gb=80.0), cfg)
    policy.submit(sft("running", mem=40.0, steps=1000), 0.0)  # trains all the time until t=1000
    policy.schedule(0.0)
    policy.submit(sft("big", mem=80.0, steps=100), 0.0)
    assert [d.kind for d in policy.schedule(20.0)] == [DecisionKind.RESERVE]
    policy.submit(sft("short", mem=10.0, steps=10), 21.0)  # short, but the group has no time to spare
    assert started(policy.schedule(21.0)) == []


@pytest.mark.parametrize("staleness", [0, 1])
def test_reservation_windows_use_an_async_jobs_shorter_span(staleness):
    cfg = SchedulerPolicyConfig(starvation_s=10.0)
    policy = FairSharePolicy(one_group(memory_gb=80.0, engines=1), cfg)
    # 100 steps of sampling 9 s and training 1 s: 1000 s sync; async, 9 + 99 x 9 + 1 = 901 s.
    running = replace(lora("running", 40.0, steps=100, step_s=1.0, sample_s=9.0), max_staleness=staleness)
    policy.submit(running, 0.0)
    assert started(policy.schedule(0.0)) == ["running"]
    policy.submit(sft("big", mem=80.0, steps=100), 0.0)
    decisions = policy.schedule(20.0)
    assert [d.kind for d in decisions] == [DecisionKind.RESERVE]
    assert f"expected free at {901 if staleness else 1000}" in decisions[0].reason
    # 95 steps: 950 s of work, or 9 + 94 x 9 + 1 = 856 s async. The window at t=21 is 979 s after a
    # sync job, 880 s after an async one: a sync candidate fits only the first, an async one both.
    policy.submit(lora("sync", 10.0, steps=95, step_s=1.0, sample_s=9.0, at=21.0), 21.0)
    assert started(policy.schedule(21.0)) == ([] if staleness else ["sync"])
    if not staleness:
        policy.job_finished("sync", 22.0)
    async_job = replace(lora("async", 10.0, steps=95, step_s=1.0, sample_s=9.0, at=22.0), max_staleness=1)
    policy.submit(async_job, 22.0)
    assert started(policy.schedule(22.0)) == ["async"]


def slot_job(job_id: str, tenant: str, priority: int = 0) -> Job:
    """A LoRA RL job whose adapter slot binds (memory is plentiful)."""
    return Job(job_id, tenant, JobKind.LORA_RL, "base", priority, 5, 1.0, 1.0, 1.0, 1.0, 0.0, f"{tenant}/{job_id}")


def slots_held(priorities: dict[str, int] | None = None) -> FairSharePolicy:
    """Four adapter slots on one engine: tenant b holds three, tenant c one; tenant a waits."""
    engine = EngineSpec("e0", "base", memory_gb=40.0, adapter_slots=4)
    policy = FairSharePolicy(ClusterSpec((engine,), one_group().learners))
    for job_id in ("b1", "b2", "b3", "c1"):
        policy.submit(slot_job(job_id, job_id[0], (priorities or {}).get(job_id, 0)), 0.0)
    assert len(started(policy.schedule(0.0))) == 4
    policy.submit(slot_job("a1", "a"), 1.0)
    assert started(policy.schedule(1.0)) == []  # every slot is pinned by a running job
    return policy


def test_an_idle_job_of_a_tenant_over_its_share_goes_first_then_the_longest_idle():
    policy = slots_held()
    # c1 has been quiet longest, but tenant c holds 1/4 of the slots, within its share of 1/3;
    # b holds 3/4. Of b's idle jobs, b2 has been quiet longer; b3 is in use (not in idle_s).
    got = policy.reclaim_idle(30.0, {"b1": 10.0, "b2": 20.0, "c1": 100.0}, lambda j: True)
    assert [(r.for_job, r.victims) for r in got] == [("a1", ("b2",))]
    why = got[0].reasons[0]
    assert "tenant b" in why and "more than its fair share" in why and "a1" not in why and "tenant a" not in why
    assert policy.reclaim_idle(30.0, {"b1": 10.0, "b2": 20.0}, lambda j: False) == []  # no one waits on a1
    assert policy.reclaim_idle(30.0, {}, lambda j: True) == []  # nothing idle
    policy.cancel("b2", 30.0)  # the service's idle pause takes it out
    assert started(policy.schedule(30.0)) == ["a1"]


def test_an_idle_job_is_taken_only_within_the_fair_share_and_priority_rules():
    policy = slots_held()
    # a holds nothing, within its share: it may take c's idle job once b has none idle.
    assert [r.victims for r in policy.reclaim_idle(30.0, {"c1": 5.0}, lambda j: True)] == [("c1",)]
    policy.submit(slot_job("b4", "b"), 2.0)
    wanted_b4 = lambda j: j == "b4"  # noqa: E731
    # b, over its share, takes nothing from c, which is within its own; it may take its own idle job.
    assert policy.reclaim_idle(30.0, {"c1": 50.0}, wanted_b4) == []
    assert [r.victims for r in policy.reclaim_idle(30.0, {"c1": 50.0, "b1": 5.0}, wanted_b4)] == [("b1",)]
    # Two waiting jobs never share one victim.
    got = policy.reclaim_idle(30.0, {"b1": 5.0, "b3": 7.0}, lambda j: True)
    assert sorted(v for r in got for v in r.victims) == ["b1", "b3"] and len(got) == 2
    # A job of higher priority than the waiting one keeps its slot, however long it was quiet.
    high = slots_held({"b1": 1, "b2": 1, "b3": 1, "c1": 1})
    assert high.reclaim_idle(30.0, {"b1": 500.0, "c1": 500.0}, lambda j: True) == []
