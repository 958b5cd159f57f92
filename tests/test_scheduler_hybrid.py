"""Hybrid (colocated) workers in the policy and the simulator: placement, phase switching, a
training step waiting for the sampling batch in flight, full-parameter jobs, and audits over
random traces on hybrid and mixed clusters."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polytinker.errors import ConfigError
from polytinker.scheduler import (
    ClusterSpec,
    DecisionKind,
    EngineSpec,
    FairSharePolicy,
    FifoPolicy,
    HybridSpec,
    Job,
    JobKind,
    JobState,
    LearnerSpec,
    Placement,
    SchedulerPolicyConfig,
    SimulatorConfig,
    TraceConfig,
    default_cluster,
    generate_trace,
    simulate,
)
from polytinker.scheduler.trace import hybrid_cluster

pytestmark = pytest.mark.timeout(120)

ONE = ClusterSpec((), (), (HybridSpec("h0", "m", memory_gb=80.0, kv_memory_gb=60.0, adapter_slots=4),))
# Exact timings: no adapter load, no optimizer swap; phase switches 1 s (shared) and 3 s (full).
EXACT = SimulatorConfig(adapter_load_s=0.0, optimizer_swap_s=0.0, phase_switch_s=1.0, full_phase_switch_s=3.0)


def rl(job_id: str, steps: int = 1, sample_s: float = 4.0, step_s: float = 2.0, **kw: object) -> Job:
    fields: dict = dict(steps=steps, sample_s=sample_s, step_s=step_s, learner_mem_gb=10.0, engine_mem_gb=5.0)
    fields.update(kw)
    return Job(job_id, "t", JobKind.LORA_RL, "m", adapter=job_id, **fields)


def finish_s(result, job_id: str) -> float:
    return next(o.finish_s for o in result.outcomes if o.job_id == job_id)


def test_a_lone_job_pays_a_switch_each_way_between_its_phases():
    result = simulate([rl("a", steps=2)], ONE, FairSharePolicy, config=EXACT, audit=True)
    # Sample 0..4, switch 4..5, train 5..7, switch 7..8, sample 8..12, switch 12..13, train 13..15.
    # On a separate engine and learner group it would take 2 x (4 + 2) = 12 s.
    assert finish_s(result, "a") == pytest.approx(15.0)
    assert result.phase_switches == 3
    assert result.learner_time == {} and result.engine_time == {}  # no separate machines here
    free = simulate([rl("a", steps=2)], ONE, FairSharePolicy, config=replace(EXACT, phase_switch_s=0.0))
    assert finish_s(free, "a") == pytest.approx(12.0)


def test_a_training_step_waits_for_the_sampling_batch_in_flight():
    a = rl("a", sample_s=2.0, step_s=1.0)
    b = rl("b", sample_s=6.0, step_s=1.0)
    late = Job("c", "t", JobKind.INFERENCE, "m", steps=1, sample_s=1.0, engine_mem_gb=2.0, arrival_s=5.0)
    result = simulate([a, b, late], ONE, FairSharePolicy, config=EXACT, audit=True)
    # a and b sample together at half speed: a's batch is done at 4, b's has 4 s left. a's step waits
    # for b's batch (alone, full speed: done at 8), and c, placed at 5, may not start a batch while a
    # step waits. Switch 8..9, a trains 9..10, b 10..11, switch back 11..12, c samples 12..13.
    assert finish_s(result, "a") == pytest.approx(10.0)
    assert finish_s(result, "b") == pytest.approx(11.0)
    assert finish_s(result, "c") == pytest.approx(13.0)
    assert result.phase_switches == 2


def test_sampling_runs_between_training_rounds_and_time_is_accounted():
    jobs = [rl(f"j{i}", steps=3, sample_s=3.0, step_s=1.0) for i in range(3)]
    result = simulate(jobs, ONE, FairSharePolicy, config=EXACT, audit=True)
    # Three jobs, one round each step: sample together (9 s of work at full speed), switch, train three
    # steps (3 s), switch back. 3 rounds: 3 x (9 + 1 + 3) + 2 switches = 41.
    assert max(o.finish_s or 0.0 for o in result.outcomes) == pytest.approx(41.0)
    assert result.phase_switches == 5


def test_async_job_on_a_hybrid_worker_never_trains_while_it_samples():
    job = rl("a", steps=6, sample_s=3.0, step_s=2.0, max_staleness=1)
    result = simulate([job], ONE, FairSharePolicy, config=EXACT, audit=True)  # the audit checks the phases
    assert result.outcomes[0].finish_s is not None
    # Its own sampling and training cannot overlap on one worker: at least the sum of its work.
    assert result.outcomes[0].finish_s >= 6 * (3.0 + 2.0)
    assert result.outcomes[0].staleness <= 1


def test_full_parameter_job_takes_the_whole_worker_and_pays_the_full_switch():
    full = Job(
        "f", "t", JobKind.FULL_RL, "m", steps=1, sample_s=2.0, step_s=3.0, learner_mem_gb=70.0, engine_mem_gb=25.0
    )
    lora = rl("l", arrival_s=0.5)
    result = simulate([full, lora], ONE, FairSharePolicy, config=EXACT, audit=True)
    # f: sample 0..2, switch (its optimizer state comes back) 2..5, train 5..8. l waits for the worker.
    assert finish_s(result, "f") == pytest.approx(8.0)
    assert next(o.first_start_s for o in result.outcomes if o.job_id == "l") == pytest.approx(8.0)
    policy = FairSharePolicy(ONE)
    policy.submit(full, 0.0)
    [start] = policy.schedule(0.0)
    assert start.placement == Placement(learner="h0", engine="h0")
    infer = Job("i", "t", JobKind.INFERENCE, "m", steps=1, sample_s=1.0, engine_mem_gb=1.0)
    policy.submit(infer, 0.0)
    assert policy.schedule(0.0) == []  # not even a base-model sample beside a full-parameter job
    assert "hybrid worker" in policy.cluster.wants(infer, 0.0)


def test_placement_prefers_separate_machines_and_names_the_worker_once():
    mixed = ClusterSpec(
        (EngineSpec("e0", "m", 60.0, 1),),
        (LearnerSpec("g0", "m", 80.0, max_jobs=1),),
        (HybridSpec("h0", "m", 80.0, 60.0, adapter_slots=2),),
    )
    policy = FairSharePolicy(mixed)
    sft = Job("s", "t", JobKind.SFT, "m", steps=1, step_s=1.0, learner_mem_gb=4.0)
    infer = Job("i", "t", JobKind.INFERENCE, "m", steps=1, sample_s=1.0, engine_mem_gb=2.0, adapter="x")
    placed = {}
    for batch in ((rl("a"), rl("b")), (sft, infer)):
        for job in batch:
            policy.submit(job, 0.0)
        placed.update({d.job_id: d.placement for d in policy.schedule(0.0) if d.kind is DecisionKind.START})
    assert placed["a"] == Placement(learner="g0", engine="e0")  # separate first
    assert placed["b"] == Placement(learner="h0", engine="h0")  # the group is full: the hybrid worker
    assert placed["b"].resources() == ("h0",)
    assert placed["s"] == Placement(learner="h0")
    assert placed["i"] == Placement(engine="h0")
    assert policy.cluster.adapters.holders("b") == {"h0"}  # its adapter slot is on the worker


def test_admission_reasons_name_the_hybrid_workers():
    policy = FairSharePolicy(hybrid_cluster(("m",), machines_per_model=2))
    big = rl("big", learner_mem_gb=160.0)
    answer = policy.submit(big, 0.0)
    assert not answer.ok and "largest hybrid worker has 80 GB" in answer.decision.reason
    wide = rl("wide", engine_mem_gb=70.0)
    assert "largest hybrid worker has 60 GB" in policy.submit(wide, 0.0).decision.reason
    other = Job("o", "t", JobKind.SFT, "other", steps=1, step_s=1.0, learner_mem_gb=1.0)
    assert "no learner group serves base model other" in policy.submit(other, 0.0).decision.reason
    with pytest.raises(ConfigError):
        HybridSpec("h", "m", memory_gb=0.0, kv_memory_gb=60.0)
    with pytest.raises(ConfigError, match="unique"):
        ClusterSpec((EngineSpec("x", "m", 60.0, 1),), (), (HybridSpec("x", "m", 80.0, 60.0),))
    with pytest.raises(ConfigError, match="phase switches"):
        SimulatorConfig(phase_switch_s=-1.0)


def test_higher_priority_job_preempts_on_a_hybrid_worker():
    policy = FairSharePolicy(ONE)
    for i in range(16):  # fill its time slices
        policy.submit(Job(f"s{i}", "t", JobKind.SFT, "m", steps=5, step_s=1.0, learner_mem_gb=4.0), 0.0)
    policy.schedule(0.0)
    urgent = rl("u", priority=2)
    policy.submit(urgent, 1.0)
    decisions = policy.schedule(1.0)
    preempted = [d for d in decisions if d.kind is DecisionKind.PREEMPT]
    assert len(preempted) == 1 and preempted[0].for_job == "u"
    [reserve] = [d for d in decisions if d.kind is DecisionKind.RESERVE]
    assert reserve.placement == Placement(learner="h0", engine="h0")
    victim = preempted[0].job_id
    policy.job_stopped(victim, 2.0, 1)
    [start] = [d for d in policy.schedule(2.0) if d.kind is DecisionKind.START]
    assert start.job_id == "u" and policy.state(victim) is JobState.QUEUED


@pytest.mark.parametrize("policy", [FairSharePolicy, FifoPolicy])
@pytest.mark.parametrize("shape", ["hybrid", "mixed"])
def test_random_traces_never_over_commit_and_every_job_finishes(policy, shape):
    trace = generate_trace(TraceConfig(n_jobs=60, seed=7, mean_interarrival_s=5.0, base_models=("m",)))
    cluster = hybrid_cluster(("m",), machines_per_model=2)
    if shape == "mixed":
        sep = default_cluster(("m",), engines_per_model=1, learners_per_model=1)
        cluster = ClusterSpec(sep.engines, sep.learners, cluster.hybrids)
    result = simulate(trace, cluster, policy, audit=True)
    rejected = [o for o in result.outcomes if o.rejected is not None]
    assert all("160 GB" in (o.rejected or "") for o in rejected)
    assert len(result.jcts_s()) == len(trace) - len(rejected)
    assert 0 < result.hybrid_utilization <= 1.0 + 1e-9
    assert result.phase_switches > 0
    # Where the hybrid workers' time went accounts for all of it; busy is training plus sampling.
    assert sum(result.hybrid_time.values()) == pytest.approx(1.0)
    busy = result.hybrid_time["train"] + result.hybrid_time.get("sampling", 0.0)
    assert busy == pytest.approx(result.hybrid_utilization)
    assert result.hybrid_time["switch"] > 0
    assert 0 < result.counted_share <= 1


def test_a_cluster_without_hybrid_workers_reports_none():
    result = simulate(generate_trace(TraceConfig(n_jobs=40, seed=1)), default_cluster(), FairSharePolicy)
    assert math.isnan(result.hybrid_utilization)
    assert result.hybrid_time == {} and result.phase_switches == 0


def test_an_idle_job_on_a_hybrid_worker_is_reclaimed_for_a_waiting_one():
    cluster = ClusterSpec((), (), (HybridSpec("h0", "m", 80.0, 60.0, adapter_slots=1),))
    policy = FairSharePolicy(cluster)
    policy.submit(rl("quiet"), 0.0)
    policy.schedule(0.0)
    policy.submit(rl("waiting"), 1.0)
    assert policy.schedule(1.0) == []  # the worker's one adapter slot is held
    assert "none of its 1 has room" in policy.cluster.wants(rl("waiting"), 1.0)
    [reclaim] = policy.reclaim_idle(2.0, {"quiet": 120.0}, lambda job_id: job_id == "waiting")
    assert reclaim.for_job == "waiting" and reclaim.victims == ("quiet",)


MIXED = ClusterSpec(
    (EngineSpec("e1", "m1", 60.0, 2),),
    (LearnerSpec("g1", "m1", 80.0, max_jobs=2),),
    (HybridSpec("h1", "m1", 80.0, 60.0, adapter_slots=2, max_jobs=3), HybridSpec("h2", "m2", 80.0, 40.0, 1)),
)


@st.composite
def small_traces(draw):
    out, t = [], 0.0
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(list(JobKind)))
        t += draw(st.floats(0, 15))
        fields: dict = {"steps": draw(st.integers(1, 5)), "arrival_s": t, "priority": draw(st.integers(0, 2))}
        if kind.needs_learner:
            fields.update(step_s=draw(st.floats(0.5, 5)), learner_mem_gb=draw(st.floats(1, 90)))
        if kind.needs_engine:
            fields.update(sample_s=draw(st.floats(0.5, 5)), engine_mem_gb=draw(st.floats(1, 50)))
        if kind is JobKind.LORA_RL or (kind is JobKind.INFERENCE and draw(st.booleans())):
            fields["adapter"] = f"ad{draw(st.integers(0, 4))}"
        if kind in (JobKind.LORA_RL, JobKind.FULL_RL):
            fields["max_staleness"] = draw(st.integers(0, 2))
        out.append(Job(f"j{i}", draw(st.sampled_from("ab")), kind, draw(st.sampled_from(["m1", "m2"])), **fields))
    return out


EAGER = SchedulerPolicyConfig(starvation_s=5.0, backfill_depth=1, preempt_checks_per_pass=2)


@settings(max_examples=40, deadline=None)
@given(small_traces(), st.sampled_from([FairSharePolicy, FifoPolicy]), st.sampled_from([None, EAGER]))
def test_hybrid_and_separate_machines_together_never_over_commit(trace, policy, config):
    # audit=True also checks that no hybrid worker trains while it samples or works while it switches.
    result = simulate(trace, MIXED, policy, config, audit=True)
    for o, job in zip(result.outcomes, trace, strict=True):
        if o.rejected is None:
            assert o.finish_s is not None, f"{o.job_id} never finished"
            assert o.jct_s >= job.span_s() - 1e-9
            assert o.staleness <= job.max_staleness
        else:
            too_big = job.learner_mem_gb > 80 or job.engine_mem_gb > (60 if job.base_model == "m1" else 40)
            assert too_big
