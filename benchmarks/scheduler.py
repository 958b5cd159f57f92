"""Scheduler benchmark: our policy against FIFO with head-of-line blocking, on the same trace.

    python benchmarks/scheduler.py --quick      # under a minute on two CPU cores
    python benchmarks/scheduler.py              # a longer trace
    python benchmarks/scheduler.py --trace jobs.jsonl --save-log decisions.jsonl
    python benchmarks/scheduler.py --quick --async-share 0       # every RL loop sync (earlier traces)
    python benchmarks/scheduler.py --quick --engines-per-model 2   # another cluster shape
    python benchmarks/scheduler.py --quick --cluster sized         # machines split by offered load

Prints which trace and cluster it used, then ``mean_jct_ratio`` and ``p99_jct_ratio`` (ours / FIFO),
``utilization`` (ours) and ``fifo_utilization``, ``utilization_ceiling``, ``decision_us_10k`` (median
microseconds of one scheduling pass with 10,000 jobs queued), the trace's size, async RL jobs and
offered loads; then, when the trace has async RL jobs, ``all_sync``: the same figures for the same
jobs and cluster with every RL loop sync (what earlier versions, whose traces had no async jobs,
printed); then the absolute figures of both policies. Both policies replay the same trace, with the
same loop modes. The trace and the cluster are described in docs/scheduler.md.

The trace (``TraceConfig``) runs half of its RL jobs async (``async_rl_share`` 0.5, one step of
staleness): they sample step k+1 while step k trains. The cluster is ``default_cluster`` (4 engines
and 2 learner groups per base model) unless ``--cluster sized`` splits the same machines by the
trace's offered loads (``sized_cluster``); the ``cluster`` line says which.

Utilization (computed by the simulator, the same for both policies): busy resource-time over
available resource-time, summed over all engines and learner groups. An engine is busy while it
samples for some job (at full throughput) for a step that gets trained; a learner group while it
trains a step (optimizer swaps, loads and saves are not busy). Rollouts an async job sampled ahead
and threw away when preempted are not busy (``discarded_sampling``). A resource counts as available
only while some queued job needs that kind of resource (engine or learner group) of that base model,
so idle tails with nothing queued, and idle capacity no waiting job could use, are left out.

``utilization_ceiling`` is what that figure would be if every resource of a base model were
available until the trace's work is done, no faster than its busiest kind of resource allows:
per base model, busy time (learner training plus engine sampling) over (engines + groups) x T, where
T is the larger of the engines' share of sampling and the learner groups' share of training plus
the time full-parameter jobs hold their group idle while they sample (such a job holds its group
alone): all its sampling when sync; when async, only what its training does not overlap (its first
sample, and per step any excess of sampling over training: ``Job.span_s`` minus its training). It
is the utilization of a cluster saturated with this trace's mix of work, with every sample at an
engine's full speed; a queue that only fills in bursts can land above or below it, but raising the
load does not raise it (see docs/scheduler.md).

Hybrid workers (``hybrid_*`` lines): the same machines per base model as hybrid workers
(``hybrid_cluster``: each holds the base once, samples and trains the jobs placed on it, one phase at
a time, paying ``phase_switch_s`` per switch), the same trace. ``hybrid_utilization`` is ours there;
``hybrid_mean_jct_ratio`` is ours there against FIFO on the separate cluster (the baseline of the
lines above); ``hybrid_vs_separate_mean_jct_ratio`` is ours there against ours on the separate
cluster, and the ``hybrid_fifo_*`` figures FIFO there, which separate the cluster's part from the
policy's. ``hybrid_utilization_ceiling``: a worker wastes no time on role imbalance, so what bounds
it is switching: per base model, busy time over busy time plus the least switching a saturated
worker pays, two switches per round in which each of its jobs takes one step (a full-parameter RL
job holds a worker alone: two switches per step at ``full_phase_switch_s``; LoRA RL jobs share a
round's two switches among as many as a worker holds, the smaller of its ``max_jobs`` and its
adapter slots). ``hybrid_switch_x4`` repeats ours with four times the switch costs.
``hybrid_counted_share`` and ``separate_counted_share`` say how much of each run (all resource-time
up to its end) the utilization figures speak for: the time work was queued.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from polytinker.scheduler import (
    ClusterSpec,
    FairSharePolicy,
    FifoPolicy,
    HybridSpec,
    Job,
    JobState,
    SchedulingPolicy,
    SimResult,
    SimulatorConfig,
    TraceConfig,
    default_cluster,
    generate_trace,
    load_trace,
    simulate,
)
from polytinker.scheduler.trace import hybrid_cluster, learner_demand_s, sized_cluster


def offered_load(trace: list[Job], cluster: ClusterSpec) -> float:
    """Learner-group seconds the trace asks for (training; a full-parameter job also holds its group
    while its sampling is not overlapped by its training: all of it when sync) over learner-group
    seconds available between the first and last arrival."""
    span = max(j.arrival_s for j in trace) - min(j.arrival_s for j in trace)
    demand = sum(learner_demand_s(j) for j in trace)
    return demand / (len(cluster.learners) * span) if span else float("nan")


def offered_engine_load(trace: list[Job], cluster: ClusterSpec) -> float:
    """Engine seconds the trace asks for over engine seconds available between the first and last arrival."""
    span = max(j.arrival_s for j in trace) - min(j.arrival_s for j in trace)
    demand = sum(j.steps * j.sample_s for j in trace)
    return demand / (len(cluster.engines) * span) if span else float("nan")


def utilization_ceiling(trace: list[Job], cluster: ClusterSpec) -> float:
    """The utilization of a cluster saturated with the trace's work (see the module docstring).
    Jobs that can never run (more memory than any group or engine has) are left out."""
    busy = capacity = 0.0
    for base in {g.base_model for g in cluster.learners} | {e.base_model for e in cluster.engines}:
        groups = [g for g in cluster.learners if g.base_model == base]
        engines = [e for e in cluster.engines if e.base_model == base]
        biggest_group = max((g.memory_gb for g in groups), default=0.0)
        biggest_engine = max((e.memory_gb for e in engines), default=0.0)
        jobs = [
            j
            for j in trace
            if j.base_model == base
            and (not j.kind.needs_learner or j.learner_mem_gb <= biggest_group)
            and (not j.kind.needs_engine or j.engine_mem_gb <= biggest_engine)
        ]
        train = sum(j.steps * j.step_s for j in jobs)
        # A full-parameter job's group idles while it samples and does not train: every sample when
        # sync; when async, the first sample and any step whose sampling outlasts its training.
        held = sum(learner_demand_s(j) - j.steps * j.step_s for j in jobs if j.kind.exclusive_learner)
        sample = sum(j.steps * j.sample_s for j in jobs)
        span = max(
            (train + held) / len(groups) if groups else 0.0,
            sample / len(engines) if engines else 0.0,
        )
        busy += train + sample
        capacity += (len(groups) + len(engines)) * span
    return busy / capacity if capacity else float("nan")


def hybrid_utilization_ceiling(trace: list[Job], cluster: ClusterSpec, config: SimulatorConfig) -> float:
    """The utilization a saturated hybrid cluster could reach on this trace: busy time over busy time
    plus the least switching (see the module docstring). Jobs no worker can hold are left out."""
    busy = switching = 0.0
    for base in {h.base_model for h in cluster.hybrids}:
        workers = [h for h in cluster.hybrids if h.base_model == base]
        memory_gb, kv_gb = max(h.memory_gb for h in workers), max(h.kv_memory_gb for h in workers)
        per_round = max(min(h.max_jobs, h.adapter_slots) for h in workers)
        for j in trace:
            if j.base_model != base or j.learner_mem_gb > memory_gb or j.engine_mem_gb > kv_gb:
                continue
            busy += j.steps * j.step_work_s
            if j.kind.exclusive_learner:
                switching += 2 * j.steps * config.full_phase_switch_s
            elif j.kind.needs_engine and j.kind.needs_learner:
                switching += 2 * j.steps * config.phase_switch_s / max(1, per_round)
    return busy / (busy + switching) if busy else float("nan")


def same_machines_hybrid(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster``'s engines and learner groups, per base model, as as many hybrid workers."""
    models = sorted({e.base_model for e in cluster.engines} | {g.base_model for g in cluster.learners})
    hybrids: list[HybridSpec] = []
    for m in models:
        n = sum(e.base_model == m for e in cluster.engines) + sum(g.base_model == m for g in cluster.learners)
        hybrids += hybrid_cluster((m,), machines_per_model=n).hybrids
    return ClusterSpec((), (), tuple(hybrids))


def compare_hybrid(
    trace: list[Job], cluster: ClusterSpec, separate: dict[str, tuple[SimResult, float]]
) -> tuple[dict[str, float | int], dict[str, tuple[SimResult, float]], str]:
    """Ours and FIFO on the same machines as hybrid workers, against the separate cluster's results;
    then ours with four times the switch costs (the returned line)."""
    hybrid = same_machines_hybrid(cluster)
    results = {}
    for policy_cls in (FairSharePolicy, FifoPolicy):
        t0 = time.perf_counter()
        results[policy_cls.name] = (simulate(trace, hybrid, policy_cls), time.perf_counter() - t0)
    ours, fifo = results["fair_share"][0], results["fifo"][0]
    sep_ours, sep_fifo = separate["fair_share"][0], separate["fifo"][0]
    config = SimulatorConfig()
    figures: dict[str, float | int] = {
        "hybrid_utilization": round(ours.hybrid_utilization, 3),
        "hybrid_mean_jct_ratio": round(ours.mean_jct_s() / sep_fifo.mean_jct_s(), 3),
        "hybrid_p99_jct_ratio": round(ours.percentile_jct_s(99) / sep_fifo.percentile_jct_s(99), 3),
        "hybrid_utilization_ceiling": round(hybrid_utilization_ceiling(trace, hybrid, config), 3),
        "hybrid_vs_separate_mean_jct_ratio": round(ours.mean_jct_s() / sep_ours.mean_jct_s(), 3),
        "hybrid_fifo_utilization": round(fifo.hybrid_utilization, 3),
        "hybrid_fifo_mean_jct_ratio": round(fifo.mean_jct_s() / sep_fifo.mean_jct_s(), 3),
        "hybrid_switch_share": round(ours.hybrid_time.get("switch", 0.0), 3),
        # How much of each run the utilization figures speak for (time work was queued).
        "hybrid_counted_share": round(ours.counted_share, 3),
        "separate_counted_share": round(sep_ours.counted_share, 3),
        "hybrid_phase_switches": ours.phase_switches,
    }
    x4 = SimulatorConfig(phase_switch_s=4 * config.phase_switch_s, full_phase_switch_s=4 * config.full_phase_switch_s)
    slow = simulate(trace, hybrid, FairSharePolicy, config=x4)
    line = (
        f"hybrid_switch_x4 (phase_switch_s={x4.phase_switch_s:g}, full_phase_switch_s={x4.full_phase_switch_s:g}) "
        f"utilization={slow.hybrid_utilization:.3f} mean_jct_ratio={slow.mean_jct_s() / sep_fifo.mean_jct_s():.3f} "
        f"ceiling={hybrid_utilization_ceiling(trace, hybrid, x4):.3f} "
        f"switch_share={slow.hybrid_time.get('switch', 0.0):.3f}"
    )
    return figures, {f"hybrid_{k}": v for k, v in results.items()}, line


def decision_us(policy_cls: type[SchedulingPolicy], cluster: ClusterSpec, queued: int, reps: int) -> float:
    """Median time of one scheduling pass with ``queued`` jobs waiting: fill the cluster, queue the
    rest, then repeatedly finish one running job and time the pass that refills its room."""
    # A larger cluster runs more of the jobs at once: more of them, so that ``queued`` still wait
    # (default_cluster, 12 resources, keeps the 1,000 extra and the one fill it always had).
    extra = 1000 * -(-(len(cluster.engines) + len(cluster.learners)) // 12)
    trace = generate_trace(TraceConfig(n_jobs=queued + extra, seed=12345, oversized_fraction=0.0))
    policy = policy_cls(cluster, None)
    submitted = queued + 200
    for job in trace[:submitted]:
        policy.submit(job, 0.0)
    policy.schedule(0.0)
    while policy.queued_count < queued and submitted < len(trace):
        for job in trace[submitted : submitted + 200]:
            policy.submit(job, 0.0)
        submitted += 200
        policy.schedule(0.0)
    times = []
    for rep in range(reps):
        running = [j for j in policy.running() if policy.state(j) is JobState.RUNNING]
        now = 1.0 + rep
        if running:
            policy.job_finished(running[rep % len(running)], now)
        t0 = time.perf_counter()
        policy.schedule(now)
        times.append(time.perf_counter() - t0)
    assert policy.queued_count >= queued - reps, "the queue drained: the measurement would be of a short queue"
    return statistics.median(times) * 1e6


def describe(r: SimResult, wall_s: float) -> dict[str, float | int | str]:
    return {
        "policy": r.policy,
        "finished": len(r.jcts_s()),
        "rejected": sum(o.rejected is not None for o in r.outcomes),
        "unfinished": sum(o.rejected is None and o.finish_s is None for o in r.outcomes),
        "mean_jct_s": round(r.mean_jct_s(), 1),
        "p50_jct_s": round(r.percentile_jct_s(50), 1),
        "p99_jct_s": round(r.percentile_jct_s(99), 1),
        "utilization": round(r.utilization, 3),
        "learner_utilization": round(r.learner_utilization, 3),
        "engine_utilization": round(r.engine_utilization, 3),
        "preemptions": sum(o.preemptions for o in r.outcomes),
        "discarded_samples": sum(o.discarded_samples for o in r.outcomes),
        "end_s": round(r.end_s, 1),
        "sim_wall_s": round(wall_s, 2),
        "learner_time": " ".join(f"{k}:{v:.3f}" for k, v in r.learner_time.items()),
        "engine_time": " ".join(f"{k}:{v:.3f}" for k, v in r.engine_time.items()),
    }


def describe_hybrid(r: SimResult, wall_s: float) -> dict[str, float | int | str]:
    row = describe(r, wall_s)
    for key in ("utilization", "learner_utilization", "engine_utilization", "learner_time", "engine_time"):
        del row[key]  # no separate machines: the hybrid workers' figures below
    row["hybrid_utilization"] = round(r.hybrid_utilization, 3)
    row["phase_switches"] = r.phase_switches
    row["hybrid_time"] = " ".join(f"{k}:{v:.3f}" for k, v in r.hybrid_time.items())
    return row


def compare(
    trace: list[Job], cluster: ClusterSpec
) -> tuple[dict[str, float | int], dict[str, tuple[SimResult, float]]]:
    """Both policies on the same trace and cluster: the headline figures and each policy's result."""
    results = {}
    for policy_cls in (FairSharePolicy, FifoPolicy):
        t0 = time.perf_counter()
        results[policy_cls.name] = (simulate(trace, cluster, policy_cls), time.perf_counter() - t0)
    ours, fifo = results["fair_share"][0], results["fifo"][0]
    figures: dict[str, float | int] = {
        "mean_jct_ratio": round(ours.mean_jct_s() / fifo.mean_jct_s(), 3),
        "p99_jct_ratio": round(ours.percentile_jct_s(99) / fifo.percentile_jct_s(99), 3),
        "utilization": round(ours.utilization, 3),
        "fifo_utilization": round(fifo.utilization, 3),
        "utilization_ceiling": round(utilization_ceiling(trace, cluster), 3),
    }
    return figures, results


def describe_cluster(cluster: ClusterSpec, how: str) -> str:
    models = sorted({e.base_model for e in cluster.engines} | {g.base_model for g in cluster.learners})
    shape = ", ".join(
        f"{m}: {sum(e.base_model == m for e in cluster.engines)} engines "
        f"+ {sum(g.base_model == m for g in cluster.learners)} learner groups"
        for m in models
    )
    return f"{how} ({shape})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 1,500-job trace (default 5,000)")
    p.add_argument("--jobs", type=int, default=None, help="jobs in the generated trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interarrival", type=float, default=None, help="mean seconds between arrivals (default 45)")
    p.add_argument(
        "--async-share",
        type=float,
        default=None,
        help=f"share of RL jobs whose loop runs async (default {TraceConfig.async_rl_share}; 0: the all-sync trace)",
    )
    p.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace instead of generating one")
    p.add_argument("--save-log", type=Path, default=None, help="write our policy's decision log here (JSONL)")
    p.add_argument(
        "--cluster",
        choices=("default", "sized"),
        default="default",
        help="default: default_cluster with --engines-per-model / --learners-per-model; sized: the same "
        "machines per base model split by the trace's offered loads (sized_cluster)",
    )
    p.add_argument("--engines-per-model", type=int, default=4, help="engines per base model (default 4)")
    p.add_argument("--learners-per-model", type=int, default=2, help="learner groups per base model (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)

    if args.engines_per_model < 1 or args.learners_per_model < 1:
        p.error("--engines-per-model and --learners-per-model must be at least 1")
    if args.async_share is not None and args.trace:
        p.error("--async-share applies to a generated trace, not to --trace (its jobs carry their mode)")
    n_jobs = args.jobs or (1500 if args.quick else 5000)
    trace_cfg = TraceConfig(n_jobs=n_jobs, seed=args.seed)
    if args.interarrival:
        trace_cfg = replace(trace_cfg, mean_interarrival_s=args.interarrival)
    if args.async_share is not None:
        trace_cfg = replace(trace_cfg, async_rl_share=args.async_share)
    trace = load_trace(args.trace) if args.trace else generate_trace(trace_cfg)
    rl = [j for j in trace if j.kind.needs_engine and j.kind.needs_learner]
    n_async = sum(j.is_async for j in rl)
    if args.trace:
        trace_desc = f"file {args.trace}"
    else:
        trace_desc = (
            f"generated (seed={trace_cfg.seed}, n_jobs={trace_cfg.n_jobs}, "
            f"mean_interarrival_s={trace_cfg.mean_interarrival_s:g}, async_rl_share={trace_cfg.async_rl_share:g}, "
            f"async_max_staleness={trace_cfg.async_max_staleness})"
        )
    trace_desc += f": {n_async} of {len(rl)} RL jobs async"
    machines = args.engines_per_model + args.learners_per_model
    if args.cluster == "sized":
        cluster = sized_cluster(trace, machines_per_model=machines)
        cluster_desc = describe_cluster(
            cluster, f"sized_cluster: {machines} machines per base model split by offered load"
        )
    else:
        cluster = default_cluster(engines_per_model=args.engines_per_model, learners_per_model=args.learners_per_model)
        cluster_desc = describe_cluster(cluster, "default_cluster")
    figures, results = compare(trace, cluster)
    ours = results["fair_share"][0]
    figures.update(
        {
            "decision_us_10k": round(decision_us(FairSharePolicy, cluster, 10_000, 40 if args.quick else 200), 1),
            "fifo_decision_us_10k": round(decision_us(FifoPolicy, cluster, 10_000, 40 if args.quick else 200), 1),
            "jobs": len(trace),
            "async_rl_jobs": n_async,
            "offered_learner_load": round(offered_load(trace, cluster), 3),
            "offered_engine_load": round(offered_engine_load(trace, cluster), 3),
        }
    )
    # The same jobs with every RL loop sync: the figures of earlier versions, on the same cluster.
    sync_figures: dict[str, float | int] = {}
    if n_async:
        sync_trace = [replace(j, max_staleness=0) for j in trace]
        sync_figures, _ = compare(sync_trace, cluster)
        sync_figures["offered_learner_load"] = round(offered_load(sync_trace, cluster), 3)
    hybrid_figures, hybrid_results, switch_x4 = compare_hybrid(trace, cluster, results)
    absolute = {name: describe(r, wall) for name, (r, wall) in results.items()}
    hybrid_absolute = {name: describe_hybrid(r, wall) for name, (r, wall) in hybrid_results.items()}
    if args.save_log:
        with args.save_log.open("w") as f:
            for d in ours.decisions:
                f.write(json.dumps(asdict(d), default=str) + "\n")
    if args.json:
        print(
            json.dumps(
                {
                    "trace": trace_desc,
                    "cluster": cluster_desc,
                    **figures,
                    "all_sync": sync_figures,
                    **hybrid_figures,
                    "hybrid_switch_x4": switch_x4,
                    "policies": absolute | hybrid_absolute,
                }
            )
        )
        return 0
    print(f"trace {trace_desc}")
    print(f"cluster {cluster_desc}")
    for key, value in figures.items():
        print(f"{key} {value}")
    if sync_figures:
        print(
            "all_sync (same jobs and cluster, every RL loop sync) "
            + " ".join(f"{k}={v}" for k, v in sync_figures.items())
        )
    for key, value in hybrid_figures.items():
        print(f"{key} {value}")
    print(switch_x4)
    for name, row in absolute.items():
        print(
            f"[{name}] "
            + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("policy", "learner_time", "engine_time"))
        )
    for name, row in hybrid_absolute.items():
        print(f"[{name}] " + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("policy", "hybrid_time")))
    for name, row in absolute.items():
        print(f"[{name}] learner time while learner work was queued: {row['learner_time']}")
        print(f"[{name}] engine time while engine work was queued: {row['engine_time']}")
    for name, row in hybrid_absolute.items():
        print(f"[{name}] hybrid worker time while work was queued: {row['hybrid_time']}")
    print(
        "targets: mean_jct_ratio <= 0.6: " + ("met" if figures["mean_jct_ratio"] <= 0.6 else "MISSED"),
        "| utilization >= 0.9: " + ("met" if figures["utilization"] >= 0.9 else "MISSED"),
        f"(saturated ceiling of this trace on this cluster: {figures['utilization_ceiling']})",
    )
    print(
        "targets (hybrid workers): hybrid_mean_jct_ratio <= 0.5: "
        + ("met" if hybrid_figures["hybrid_mean_jct_ratio"] <= 0.5 else "MISSED"),
        "| hybrid_utilization >= 0.9: " + ("met" if hybrid_figures["hybrid_utilization"] >= 0.9 else "MISSED"),
        f"(ceiling of this trace on these machines as hybrid workers: {hybrid_figures['hybrid_utilization_ceiling']})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
