"""The simulator: determinism, traces, known timings, and a property over random traces."""

from __future__ import annotations

import json
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
    Job,
    JobKind,
    LearnerSpec,
    SchedulerPolicyConfig,
    SimulatorConfig,
    TraceConfig,
    default_cluster,
    generate_trace,
    load_trace,
    save_trace,
    simulate,
)
from polytinker.scheduler.trace import learner_demand_s, sized_cluster

SMALL = TraceConfig(n_jobs=120, seed=3, mean_interarrival_s=20.0)


def test_same_trace_same_result():
    trace = generate_trace(SMALL)
    assert trace == generate_trace(SMALL)
    assert trace != generate_trace(TraceConfig(n_jobs=120, seed=4, mean_interarrival_s=20.0))
    a = simulate(trace, default_cluster(), FairSharePolicy)
    b = simulate(trace, default_cluster(), FairSharePolicy)
    assert a == b
    assert len(a.jcts_s()) > 100


def test_trace_round_trips_through_jsonl(tmp_path):
    trace = generate_trace(TraceConfig(n_jobs=50, seed=1))
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace
    path.write_text('{"job_id": "x"}\n')
    with pytest.raises(ConfigError, match=r"trace\.jsonl:1"):
        load_trace(path)


def test_trace_is_mixed_heavy_tailed_and_multi_tenant():
    trace = generate_trace(TraceConfig(n_jobs=2000, seed=0))
    assert {j.kind for j in trace} == set(JobKind)
    assert len({j.tenant for j in trace}) >= 3 and len({j.priority for j in trace}) >= 3
    steps = sorted(j.steps for j in trace)
    assert steps[int(0.99 * len(steps))] > 8 * steps[len(steps) // 2]  # heavy tail
    # Bursty: arrivals per 10-minute window vary far more than a Poisson process's (variance = mean).
    counts = [0] * (int(trace[-1].arrival_s // 600) + 1)
    for j in trace:
        counts[int(j.arrival_s // 600)] += 1
    mean = sum(counts) / len(counts)
    assert sum((c - mean) ** 2 for c in counts) / len(counts) > 3 * mean


def test_rl_step_timing_and_learner_time_slicing():
    cluster = ClusterSpec((EngineSpec("e0", "m", 40.0, 4),), (LearnerSpec("g0", "m", 40.0),))

    def rl(job_id: str) -> Job:
        return Job(job_id, "t", JobKind.LORA_RL, "m", 0, 2, 2.0, 3.0, 10.0, 5.0, adapter=job_id)

    cfg = SimulatorConfig(optimizer_swap_s=0.5, adapter_load_s=1.0, engine_full_speed_jobs=2)
    alone = simulate([rl("a")], cluster, FairSharePolicy, config=cfg)
    # Load 1 s, then per step: sample 3 s, train 2 s.
    assert alone.outcomes[0].finish_s == pytest.approx(1.0 + 2 * 5.0)
    pair = simulate([rl("a"), rl("b")], cluster, FairSharePolicy, config=cfg)
    finish = sorted(o.finish_s or 0.0 for o in pair.outcomes)
    # Both sample at full speed (the engine runs two at once); the learner trains them in turn.
    # a: 1+3 -> train 4..6; b: swap 6..6.5, train ..8.5; a: sampled 6..9, swap, train 9.5..11.5
    # b: sampled 8.5..11.5, its state back in 11.5..12, train ..14.
    assert finish == pytest.approx([11.5, 14.0])


def test_engine_throughput_is_shared_among_sampling_jobs():
    cluster = ClusterSpec((EngineSpec("e0", "m", 40.0, 4),), (LearnerSpec("g0", "m", 40.0),))

    def rl(job_id: str) -> Job:
        return Job(job_id, "t", JobKind.LORA_RL, "m", 0, 2, 2.0, 3.0, 10.0, 5.0, adapter=job_id)

    cfg = SimulatorConfig(optimizer_swap_s=0.5, adapter_load_s=1.0, engine_full_speed_jobs=1)
    pair = simulate([rl("a"), rl("b")], cluster, FairSharePolicy, config=cfg)
    finish = sorted(o.finish_s or 0.0 for o in pair.outcomes)
    # Both sample at half speed 1..7. a trains 7..9; b swaps in 9..9.5, trains ..11.5. a samples alone
    # 9..11.5 (2.5 of 3 s done), then at half speed with b until 12.5; swap, train 13..15. b: 0.5 s done
    # by 12.5, alone until 15; a has left, b's state comes back in 15..15.5, train ..17.5.
    assert finish == pytest.approx([15.0, 17.5])


def test_time_breakdown_accounts_for_all_pending_time():
    result = simulate(generate_trace(SMALL), default_cluster(), FairSharePolicy)
    assert sum(result.learner_time.values()) == pytest.approx(1.0)
    assert sum(result.engine_time.values()) == pytest.approx(1.0)
    assert result.learner_time["train"] == pytest.approx(result.learner_utilization)
    assert result.engine_time["sampling"] == pytest.approx(result.engine_utilization)


def test_fifo_blocks_and_ours_backfills_on_the_same_trace():
    trace = generate_trace(SMALL)
    ours = simulate(trace, default_cluster(), FairSharePolicy)
    fifo = simulate(trace, default_cluster(), FifoPolicy)
    assert ours.mean_jct_s() < fifo.mean_jct_s()
    assert not [d for d in fifo.decisions if d.kind in (DecisionKind.PREEMPT, DecisionKind.RESERVE)]


KINDS = st.sampled_from(list(JobKind))


@st.composite
def jobs(draw):
    n = draw(st.integers(1, 14))
    out = []
    t = 0.0
    for i in range(n):
        kind = draw(KINDS)
        t += draw(st.floats(0, 20))
        steps = draw(st.integers(1, 6))
        learner = draw(st.floats(1, 90)) if kind.needs_learner else 0.0
        engine = draw(st.floats(1, 50)) if kind.needs_engine else 0.0
        adapter = None
        if kind is JobKind.LORA_RL or (kind is JobKind.INFERENCE and draw(st.booleans())):
            adapter = f"ad{draw(st.integers(0, 5))}"
        out.append(
            Job(
                f"j{i}",
                draw(st.sampled_from(["a", "b", "c"])),
                kind,
                draw(st.sampled_from(["m1", "m2"])),
                draw(st.integers(0, 2)),
                steps,
                draw(st.floats(0.5, 5)) if kind.needs_learner else 0.0,
                draw(st.floats(0.5, 5)) if kind.needs_engine else 0.0,
                learner,
                engine,
                arrival_s=t,
                adapter=adapter,
                max_staleness=draw(st.integers(0, 2)) if kind in (JobKind.LORA_RL, JobKind.FULL_RL) else 0,
            )
        )
    return out


CLUSTER = ClusterSpec(
    (EngineSpec("e1", "m1", 60.0, 2), EngineSpec("e2", "m1", 40.0, 1), EngineSpec("e3", "m2", 60.0, 2)),
    (LearnerSpec("g1", "m1", 80.0), LearnerSpec("g2", "m1", 40.0), LearnerSpec("g3", "m2", 80.0)),
)


# Quick starvation and a one-job backfill depth, so reservations and preemptions happen in small traces.
EAGER = SchedulerPolicyConfig(starvation_s=5.0, backfill_depth=1, preempt_checks_per_pass=2)


@settings(max_examples=60, deadline=None)
@given(jobs(), st.sampled_from([FairSharePolicy, FifoPolicy]), st.sampled_from([None, EAGER]))
def test_no_resource_is_ever_over_committed(trace, policy, config):
    # audit=True recounts every engine and learner group after every event and raises if one is
    # over-committed (memory, adapter slots, or a shared full-parameter group), or if a job samples
    # further ahead of its training than its max_staleness allows.
    result = simulate(trace, CLUSTER, policy, config, audit=True)
    for o, job in zip(result.outcomes, trace, strict=True):
        if o.rejected is None:
            assert o.finish_s is not None, f"{o.job_id} never finished"
            assert o.jct_s >= job.span_s() - 1e-9  # nothing runs faster than it would alone
            assert o.staleness <= job.max_staleness
            assert o.discarded_samples <= o.preemptions * job.max_staleness
        else:
            assert job.learner_mem_gb > 80 or job.engine_mem_gb > 60 or (job.needs_slot and job.base_model == "m2")
    assert all(d.reason for d in result.decisions)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_admitted_job_finishes_under_stress(seed):
    # Overloaded, with quick starvation and a shallow backfill: reservations pile up and a pass
    # meets many jobs they keep out. Every admitted job must still finish (no deadlock).
    trace = generate_trace(TraceConfig(n_jobs=300, seed=seed, mean_interarrival_s=8.0, median_steps=6))
    cfg = SchedulerPolicyConfig(starvation_s=60.0, backfill_depth=2, preempt_checks_per_pass=1)
    result = simulate(trace, default_cluster(), FairSharePolicy, cfg)
    unfinished = [o.job_id for o in result.outcomes if o.rejected is None and o.finish_s is None]
    assert not unfinished
    assert any(d.kind is DecisionKind.RESERVE for d in result.decisions)
    assert any(d.kind is DecisionKind.PREEMPT for d in result.decisions)


# --- async RL loops (Job.max_staleness) -----------------------------------------------------------

ONE = ClusterSpec((EngineSpec("e0", "m", 40.0, 4),), (LearnerSpec("g0", "m", 40.0),))


def _blocker() -> Job:
    # Waits (same priority, a group to itself) until the job under test is done, so that every
    # resource counts as available for utilization all along; it then runs with nothing queued.
    return Job("z", "t", JobKind.FULL_RL, "m", 0, 50, 1.0, 1.0, 30.0, 10.0, 0.0)


@pytest.mark.parametrize(
    ("staleness", "finish", "learner_util", "engine_util"),
    [
        # Sync: 1 s adapter load, then 3 x (sample 3 s, train 2 s).
        (0, 1.0 + 3 * 5.0, 6 / 16, 9 / 16),
        # Async: load, sample 1 (1..4); train 1 (4..6) while sample 2 (4..7); train 2 (7..9) while
        # sample 3 (7..10); train 3 (10..12). The same busy time in less wall time.
        (1, 12.0, 6 / 12, 9 / 12),
    ],
)
def test_async_rl_job_samples_its_next_step_while_this_one_trains(staleness, finish, learner_util, engine_util):
    job = Job("a", "t", JobKind.LORA_RL, "m", 0, 3, 2.0, 3.0, 10.0, 5.0, adapter="a", max_staleness=staleness)
    assert job.span_s() == finish - 1.0
    result = simulate([job, _blocker()], ONE, FairSharePolicy, config=SimulatorConfig(adapter_load_s=1.0), audit=True)
    a, z = result.outcomes
    assert a.finish_s == pytest.approx(finish)
    assert z.first_start_s == pytest.approx(finish)  # z was queued, needing both resources, until then
    # Counted from 0 to `finish`: training 3 x 2 s on the group, sampling 3 x 3 s on the engine.
    assert result.learner_utilization == pytest.approx(learner_util)
    assert result.engine_utilization == pytest.approx(engine_util)
    assert result.utilization == pytest.approx((learner_util + engine_util) / 2)
    assert a.staleness == staleness and a.discarded_samples == 0


@pytest.mark.parametrize(("staleness", "finish", "held"), [(0, 21.0, 9 / 21), (1, 15.0, 3 / 15)])
def test_async_full_rl_job_keeps_its_group_training_while_it_samples(staleness, finish, held):
    # Training (4 s) outlasts sampling (3 s): async, the group idles only during the first sample.
    job = Job("a", "t", JobKind.FULL_RL, "m", 0, 3, 4.0, 3.0, 30.0, 5.0, max_staleness=staleness)
    blocker = Job("z", "t", JobKind.LORA_RL, "m", 0, 60, 1.0, 1.0, 20.0, 5.0, adapter="z")
    result = simulate([job, blocker], ONE, FairSharePolicy, audit=True)
    assert result.outcomes[0].finish_s == pytest.approx(finish)
    assert result.learner_time["full_rl_sampling"] == pytest.approx(held)
    assert result.learner_time["train"] == pytest.approx(12.0 / finish)


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_sampling_never_runs_more_than_max_staleness_steps_ahead(staleness):
    # Sampling (1 s) is far faster than training (4 s): only the bound holds it back. Training is
    # the bottleneck, so the job ends at 1 + 6 x 4 s whatever the bound; what the bound decides is
    # how far ahead it samples, and so how many untrained steps a preemption throws away.
    job = Job("a", "t", JobKind.LORA_RL, "m", 0, 6, 4.0, 1.0, 10.0, 5.0, adapter="a", max_staleness=staleness)
    alone = simulate([job], ONE, FairSharePolicy, config=SimulatorConfig(adapter_load_s=0.0), audit=True)
    assert alone.outcomes[0].finish_s == pytest.approx(25.0)
    assert alone.outcomes[0].staleness == staleness
    urgent = Job("h", "t", JobKind.FULL_RL, "m", 1, 1, 1.0, 1.0, 30.0, 5.0, arrival_s=4.5)
    cfg = SimulatorConfig(adapter_load_s=0.0, checkpoint_save_s=0.0, checkpoint_load_s=0.0)
    preempted = simulate([job, urgent], ONE, FairSharePolicy, config=cfg, audit=True)
    a = preempted.outcomes[0]
    assert a.preemptions == 1 and a.staleness == staleness
    # Step 1 trains 1..5 while steps 2, 3, 4 could sample at 1..2, 2..3, 3..4: only `staleness` of
    # them do. PREEMPT at 4.5, obeyed at the end of step 1 (t=5): those are thrown away.
    assert a.discarded_samples == staleness
    # h samples and trains 5..7; a resumes at step 2: sample 7..8, then 5 x 4 s of training.
    assert a.finish_s == pytest.approx(7.0 + 1.0 + 5 * 4.0)


def test_async_job_told_to_stop_samples_no_further():
    # As above with max_staleness 3, but PREEMPT comes at t=2.5, while step 3 samples (2..3): step 4
    # (3..4) is not started, so steps 2 and 3 are all a preemption at t=5 throws away.
    job = Job("a", "t", JobKind.LORA_RL, "m", 0, 6, 4.0, 1.0, 10.0, 5.0, adapter="a", max_staleness=3)
    urgent = Job("h", "t", JobKind.FULL_RL, "m", 1, 1, 1.0, 1.0, 30.0, 5.0, arrival_s=2.5)
    cfg = SimulatorConfig(adapter_load_s=0.0, checkpoint_save_s=0.0, checkpoint_load_s=0.0)
    a = simulate([job, urgent], ONE, FairSharePolicy, config=cfg, audit=True).outcomes[0]
    assert (a.preemptions, a.discarded_samples) == (1, 2)


def test_preempted_async_job_discards_what_it_sampled_ahead():
    cfg = SimulatorConfig(adapter_load_s=0.0, checkpoint_save_s=2.0, checkpoint_load_s=2.0)

    def rl(staleness: int) -> Job:
        return Job("a", "t", JobKind.LORA_RL, "m", 0, 4, 2.0, 3.0, 10.0, 5.0, adapter="a", max_staleness=staleness)

    urgent = Job("h", "u", JobKind.FULL_RL, "m", 1, 1, 1.0, 1.0, 30.0, 10.0, arrival_s=4.0)
    result = simulate([rl(1), urgent], ONE, FairSharePolicy, config=cfg, audit=True)
    a, h = result.outcomes
    # a: sample 1 (0..3); train 1 (3..5) while sample 2 (3..). h arrives at 4: PREEMPT a. At its step
    # boundary (5) a stops sampling step 2 (2 of 3 s done: thrown away), saves 5..7. h: 7..9.
    # a resumes: load 9..11, sample 2 (11..14), train 2 (14..16) || sample 3 (14..17), train 3
    # (17..19) || sample 4 (17..20), train 4 (20..22).
    assert h.first_start_s == pytest.approx(7.0) and h.finish_s == pytest.approx(9.0)
    assert a.finish_s == pytest.approx(22.0)
    assert (a.preemptions, a.discarded_samples) == (1, 1)
    kinds = [(d.kind, d.job_id) for d in result.decisions if d.kind is not DecisionKind.ADMIT]
    assert kinds[:4] == [
        (DecisionKind.START, "a"),
        (DecisionKind.PREEMPT, "a"),
        (DecisionKind.RESERVE, "h"),
        (DecisionKind.REQUEUE, "a"),
    ]
    # Work was queued from 4 to 9 (h, then a). Engine: a sampled 4..5 for nothing, h sampled 7..8;
    # the thrown-away second is not busy. Group: a trained 4..5, h 8..9.
    assert result.engine_utilization == pytest.approx(1 / 5)
    assert result.engine_time["discarded_sampling"] == pytest.approx(1 / 5)
    assert result.engine_time["sampling"] == pytest.approx(1 / 5)
    assert result.learner_utilization == pytest.approx(2 / 5)
    # The same job sync: nothing sampled ahead, nothing thrown away; it resumes at step 2 all the same.
    sync = simulate([rl(0), urgent], ONE, FairSharePolicy, config=cfg, audit=True).outcomes[0]
    assert (sync.preemptions, sync.discarded_samples, sync.finish_s) == (1, 0, pytest.approx(11.0 + 3 * 5.0))


def test_async_share_only_changes_loop_modes():
    sync = generate_trace(TraceConfig(n_jobs=400, seed=5, async_rl_share=0.0))
    half = generate_trace(TraceConfig(n_jobs=400, seed=5))
    full = generate_trace(TraceConfig(n_jobs=400, seed=5, async_rl_share=1.0, async_max_staleness=2))
    assert [replace(j, max_staleness=0) for j in half] == sync == [replace(j, max_staleness=0) for j in full]
    rl = [j for j in half if j.kind in (JobKind.LORA_RL, JobKind.FULL_RL)]
    assert 0.4 < sum(j.is_async for j in rl) / len(rl) < 0.6
    assert not any(j.is_async for j in half if j not in rl)
    assert {j.max_staleness for j in full if j.kind in (JobKind.LORA_RL, JobKind.FULL_RL)} == {2}
    # A job async at a lower share is async at a higher one (one draw per job).
    assert all(f.is_async for h, f in zip(half, full, strict=True) if h.is_async)
    assert sum(j.is_async for j in sync) == 0


def test_trace_files_keep_the_loop_mode_and_read_older_ones(tmp_path):
    trace = generate_trace(TraceConfig(n_jobs=60, seed=2))
    assert any(j.is_async for j in trace)
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace
    # A file written before the field existed: every job sync.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        del r["max_staleness"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_trace(path) == [replace(j, max_staleness=0) for j in trace]
    records[0]["max_staleness"] = -1
    path.write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(ConfigError, match=r"trace\.jsonl:1"):
        load_trace(path)


def test_loop_mode_is_validated():
    with pytest.raises(ConfigError, match="only RL jobs run async"):
        Job("s", "t", JobKind.SFT, "m", 0, 1, 1.0, 0.0, 1.0, 0.0, max_staleness=1)
    with pytest.raises(ConfigError, match="only RL jobs run async"):
        Job("i", "t", JobKind.INFERENCE, "m", 0, 1, 0.0, 1.0, 0.0, 1.0, max_staleness=1)
    for bad in (-1, 1.0, True):
        with pytest.raises(ConfigError, match="max_staleness"):
            Job("a", "t", JobKind.FULL_RL, "m", 0, 1, 1.0, 1.0, 1.0, 1.0, max_staleness=bad)
    for share in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="async_rl_share"):
            TraceConfig(async_rl_share=share)
    with pytest.raises(ConfigError, match="async_max_staleness"):
        TraceConfig(async_max_staleness=0)


def test_span_is_the_time_alone():
    def full(staleness: int, step_s: float, sample_s: float) -> Job:
        return Job("a", "t", JobKind.FULL_RL, "m", 0, 5, step_s, sample_s, 1.0, 1.0, max_staleness=staleness)

    assert full(0, 2.0, 3.0).span_s() == full(0, 2.0, 3.0).work_s == 25.0
    assert full(1, 2.0, 3.0).span_s() == 3.0 + 4 * 3.0 + 2.0  # sampling-bound
    assert full(2, 3.0, 2.0).span_s() == 2.0 + 4 * 3.0 + 3.0  # training-bound
    assert full(1, 2.0, 3.0).span_s(1) == 5.0 and full(1, 2.0, 3.0).span_s(0) == 0.0
    for job in (full(1, 2.0, 3.0), full(2, 3.0, 2.0), full(1, 3.0, 2.0)):
        assert simulate([job], ONE, FairSharePolicy, audit=True).outcomes[0].finish_s == pytest.approx(job.span_s())


def test_sized_cluster_splits_machines_by_offered_load():
    trace = generate_trace(TraceConfig(n_jobs=400, seed=0))
    cluster = sized_cluster(trace, machines_per_model=6)
    for m in ("llama-8b", "qwen-7b"):
        engines = [e for e in cluster.engines if e.base_model == m]
        groups = [g for g in cluster.learners if g.base_model == m]
        assert len(engines) + len(groups) == 6 and len(engines) >= 1 and len(groups) >= 1
        learner = sum(learner_demand_s(j) for j in trace if j.base_model == m)
        engine = sum(j.steps * j.sample_s for j in trace if j.base_model == m)
        assert len(groups) == min(5, max(1, round(6 * learner / (learner + engine))))
    # Only learner work: as many groups as allowed, one engine kept.
    sft_only = [j for j in trace if j.kind is JobKind.SFT]
    assert len(sized_cluster(sft_only, 4, base_models=["llama-8b"]).learners) == 3
