"""The simulator: determinism, traces, known timings, and a property over random traces."""

from __future__ import annotations

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
    # over-committed (memory, adapter slots, or a shared full-parameter group).
    result = simulate(trace, CLUSTER, policy, config, audit=True)
    for o, job in zip(result.outcomes, trace, strict=True):
        if o.rejected is None:
            assert o.finish_s is not None, f"{o.job_id} never finished"
            assert o.jct_s >= job.work_s - 1e-9  # nothing runs faster than its declared work
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
