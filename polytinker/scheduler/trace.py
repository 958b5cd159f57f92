"""Job traces: generate a synthetic one (``TraceConfig``, ``generate_trace``), save and load JSONL.

The generator aims at what a shared RL runtime sees, not at what flatters a policy:

- Arrivals are bursty: a two-state modulated Poisson process (calm, and bursts at ``burst_factor``
  times the calm rate), so queues build up and drain.
- Sizes are heavy-tailed: steps per job are log-normal (most jobs short, a few very long).
- Kinds are mixed (LoRA RL, full-parameter RL, SFT, inference) with per-kind step times and memory;
  full-parameter jobs need a whole learner group.
- Tenants submit unequal shares of the jobs; priorities are mostly 0, some 1, a few 2.
- A small fraction of jobs ask for more memory than any machine has (they must be rejected).
- A share of the RL jobs (LoRA and full-parameter) run their loop async (``async_rl_share``,
  ``async_max_staleness``): they sample step k+1 while step k trains.

Every draw comes from generators seeded by ``seed``: the same config gives the same trace. Which RL
jobs run async is drawn from a second stream of the same seed, one draw per job, so the jobs
themselves (arrivals, kinds, sizes) do not depend on ``async_rl_share``, and raising the share only
turns more of the same jobs async: ``async_rl_share=0`` gives the trace of earlier versions.

``default_cluster`` is the fixed cluster the benchmark's figures are quoted on; ``sized_cluster``
splits the same number of machines per base model between engines and learner groups in proportion
to what a trace asks of each (an option of the benchmark, never used silently); ``hybrid_cluster``
makes the same machines hybrid workers, each sampling and training the jobs placed on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from polytinker.errors import ConfigError
from polytinker.scheduler.types import ClusterSpec, EngineSpec, HybridSpec, Job, JobKind, LearnerSpec


@dataclass(frozen=True)
class TraceConfig:
    n_jobs: int = 2000
    """Jobs in the trace."""

    seed: int = 0
    """Seed of the one random generator every draw comes from."""

    mean_interarrival_s: float = 45.0
    """Mean gap between arrivals over the whole trace (calm and burst periods together)."""

    burst_factor: float = 8.0
    """Arrival rate during a burst relative to the calm rate."""

    burst_fraction: float = 0.2
    """Fraction of time spent in bursts."""

    mean_period_s: float = 1800.0
    """Mean length of one calm or burst period."""

    kind_mix: tuple[tuple[JobKind, float], ...] = (
        (JobKind.LORA_RL, 0.55),
        (JobKind.SFT, 0.2),
        (JobKind.INFERENCE, 0.2),
        (JobKind.FULL_RL, 0.05),
    )
    """Probability of each job kind."""

    tenants: tuple[tuple[str, float], ...] = (("alpha", 0.45), ("beta", 0.3), ("gamma", 0.15), ("delta", 0.1))
    """(tenant, share of submitted jobs)."""

    priorities: tuple[tuple[int, float], ...] = ((0, 0.7), (1, 0.25), (2, 0.05))
    """(priority, probability)."""

    median_steps: float = 20.0
    """Median steps of a job; steps are log-normal around it."""

    steps_sigma: float = 1.2
    """Log-normal sigma of steps: 1.2 puts the 99th percentile near 16x the median."""

    max_steps: int = 2000
    """Cap on steps per job."""

    oversized_fraction: float = 0.01
    """Fraction of jobs that ask for more learner memory than the cluster's largest group."""

    base_models: tuple[str, ...] = ("llama-8b", "qwen-7b")
    """Base models jobs use (uniformly)."""

    async_rl_share: float = 0.5
    """Share of RL jobs (LoRA and full-parameter) whose loop runs async (``Job.max_staleness`` =
    ``async_max_staleness``); the rest run sync. Half: async with one step of staleness is the usual
    setting when throughput matters (sampling and training overlap; importance-sampling or PPO losses
    correct for the off-policy step), but this project's own loop defaults to sync, only those losses
    correct for staleness, and exactly on-policy runs (reproductions, debugging, small jobs where
    the overlap buys little) stay common. 0 gives the all-sync trace of earlier versions; the
    benchmark prints its figures for both."""

    async_max_staleness: int = 1
    """``max_staleness`` of the async RL jobs (the training loop's default)."""

    def __post_init__(self) -> None:
        if self.n_jobs <= 0 or self.mean_interarrival_s <= 0 or self.mean_period_s <= 0:
            raise ConfigError("n_jobs, mean_interarrival_s and mean_period_s must be positive")
        if self.burst_factor < 1 or not 0 <= self.burst_fraction < 1:
            raise ConfigError("burst_factor must be >= 1 and burst_fraction in [0, 1)")
        for name in ("kind_mix", "tenants", "priorities"):
            weights = [w for _, w in getattr(self, name)]
            if not weights or min(weights) < 0 or sum(weights) <= 0:
                raise ConfigError(f"TraceConfig.{name}: give at least one entry with non-negative weights")
        if self.median_steps < 1 or self.steps_sigma < 0 or self.max_steps < 1:
            raise ConfigError("median_steps >= 1, steps_sigma >= 0, max_steps >= 1")
        if not 0 <= self.oversized_fraction < 1 or not self.base_models:
            raise ConfigError("oversized_fraction in [0, 1) and at least one base model")
        if not 0 <= self.async_rl_share <= 1:
            raise ConfigError(f"async_rl_share must be in [0, 1], got {self.async_rl_share}")
        if isinstance(self.async_max_staleness, bool) or not isinstance(self.async_max_staleness, int):
            raise ConfigError(f"async_max_staleness must be an int, got {self.async_max_staleness!r}")
        if self.async_max_staleness < 1:
            raise ConfigError(f"async_max_staleness must be >= 1 (0 is sync), got {self.async_max_staleness}")


def default_cluster(
    base_models: Sequence[str] = ("llama-8b", "qwen-7b"),
    engines_per_model: int = 4,
    learners_per_model: int = 2,
) -> ClusterSpec:
    """A cluster of 80 GB machines: per base model, engines (8 adapter slots, 60 GB beyond the
    base weights) and learner groups (80 GB for adapters, optimizer states, activations)."""
    engines = tuple(
        EngineSpec(f"{m}/engine{i}", m, memory_gb=60.0, adapter_slots=8)
        for m in base_models
        for i in range(engines_per_model)
    )
    learners = tuple(
        LearnerSpec(f"{m}/learner{i}", m, memory_gb=80.0) for m in base_models for i in range(learners_per_model)
    )
    return ClusterSpec(engines, learners)


def hybrid_cluster(base_models: Sequence[str] = ("llama-8b", "qwen-7b"), machines_per_model: int = 6) -> ClusterSpec:
    """``default_cluster``'s machines (6 per base model: its 4 engines and 2 learner groups) as hybrid
    workers: each holds its base model once, samples with an engine's memory and slots (60 GB, 8
    adapter slots) and trains with a learner group's (80 GB, 16 time-sliced jobs), one phase at a time."""
    if machines_per_model < 1:
        raise ConfigError(f"hybrid_cluster needs at least 1 machine per base model, got {machines_per_model}")
    hybrids = tuple(
        HybridSpec(f"{m}/hybrid{i}", m, memory_gb=80.0, kv_memory_gb=60.0, adapter_slots=8)
        for m in base_models
        for i in range(machines_per_model)
    )
    return ClusterSpec((), (), hybrids)


def _pick(rng: np.random.Generator, table: Sequence[tuple[object, float]]) -> object:
    total = sum(w for _, w in table)
    x = rng.random() * total
    for value, w in table:
        x -= w
        if x < 0:
            return value
    return table[-1][0]


def _arrivals(cfg: TraceConfig, rng: np.random.Generator) -> list[float]:
    # Rates chosen so the long-run mean gap is mean_interarrival_s.
    calm_rate = 1.0 / (cfg.mean_interarrival_s * ((1 - cfg.burst_fraction) + cfg.burst_fraction * cfg.burst_factor))
    times: list[float] = []
    t, in_burst = 0.0, False
    period_end = rng.exponential(cfg.mean_period_s * (1 - cfg.burst_fraction) * 2)
    while len(times) < cfg.n_jobs:
        rate = calm_rate * (cfg.burst_factor if in_burst else 1.0)
        t += rng.exponential(1.0 / rate)
        if t > period_end:
            t, in_burst = period_end, not in_burst
            share = cfg.burst_fraction if in_burst else 1 - cfg.burst_fraction
            period_end = t + rng.exponential(cfg.mean_period_s * share * 2)
            continue
        times.append(t)
    return times


def _job(cfg: TraceConfig, rng: np.random.Generator, i: int, arrival_s: float) -> Job:
    kind = JobKind(str(_pick(rng, cfg.kind_mix)))
    tenant = str(_pick(rng, cfg.tenants))
    steps = int(min(cfg.max_steps, max(1, round(cfg.median_steps * math.exp(rng.normal(0, cfg.steps_sigma))))))
    base = cfg.base_models[int(rng.integers(len(cfg.base_models)))]
    fields: dict[str, object] = {}
    if kind is JobKind.LORA_RL:
        fields = dict(step_s=rng.uniform(2, 6), sample_s=rng.uniform(4, 10), learner_mem_gb=rng.uniform(4, 16))
        fields.update(engine_mem_gb=rng.uniform(2, 8), adapter=f"{tenant}/a{i}")
    elif kind is JobKind.FULL_RL:
        fields = dict(step_s=rng.uniform(10, 20), sample_s=rng.uniform(8, 15), learner_mem_gb=rng.uniform(60, 80))
        fields.update(engine_mem_gb=rng.uniform(20, 30))
    elif kind is JobKind.SFT:
        fields = dict(step_s=rng.uniform(1, 3), learner_mem_gb=rng.uniform(4, 16))
    else:
        # Half of inference jobs serve an adapter trained by an earlier job of the same tenant.
        adapter = f"{tenant}/a{int(rng.integers(max(1, i)))}" if rng.random() < 0.5 else None
        fields = dict(sample_s=rng.uniform(2, 5), engine_mem_gb=rng.uniform(2, 10), adapter=adapter)
    if kind.needs_learner and rng.random() < cfg.oversized_fraction:
        fields["learner_mem_gb"] = 160.0  # twice the largest group: must be rejected
    for k, v in fields.items():
        if isinstance(v, float):
            fields[k] = round(v, 3)
    return Job(
        job_id=f"j{i:06d}",
        tenant=tenant,
        kind=kind,
        base_model=base,
        priority=int(str(_pick(rng, cfg.priorities))),
        steps=steps,
        arrival_s=round(arrival_s, 3),
        **fields,  # type: ignore[arg-type]
    )


def generate_trace(cfg: TraceConfig | None = None) -> list[Job]:
    cfg = cfg or TraceConfig()
    rng = np.random.default_rng(cfg.seed)
    jobs = [_job(cfg, rng, i, t) for i, t in enumerate(_arrivals(cfg, rng))]
    # The loop modes come from their own stream, one draw per job: the jobs above do not depend on them.
    modes = np.random.default_rng([cfg.seed, 1]).random(len(jobs))
    return [
        replace(j, max_staleness=cfg.async_max_staleness)
        if j.kind in (JobKind.LORA_RL, JobKind.FULL_RL) and u < cfg.async_rl_share
        else j
        for j, u in zip(jobs, modes, strict=True)
    ]


def sized_cluster(
    trace: Sequence[Job],
    machines_per_model: int = 6,
    base_models: Sequence[str] | None = None,
) -> ClusterSpec:
    """Machines like ``default_cluster``'s, ``machines_per_model`` per base model (default 6, as
    there), split between engines and learner groups in proportion to what ``trace`` asks of each:
    learner-group time (training, plus the time a full-parameter job holds its group idle while it
    samples: all its sampling when sync, only what training does not overlap when async) against
    engine time (sampling). At least one of each."""
    if machines_per_model < 2:
        raise ConfigError(f"sized_cluster needs at least 2 machines per base model, got {machines_per_model}")
    models = list(base_models) if base_models is not None else sorted({j.base_model for j in trace})
    engines: list[EngineSpec] = []
    learners: list[LearnerSpec] = []
    for m in models:
        jobs = [j for j in trace if j.base_model == m]
        learner_s = sum(learner_demand_s(j) for j in jobs)
        engine_s = sum(j.steps * j.sample_s for j in jobs)
        total = learner_s + engine_s
        n_learners = round(machines_per_model * learner_s / total) if total else machines_per_model // 2
        n_learners = min(machines_per_model - 1, max(1, n_learners))
        engines += [EngineSpec(f"{m}/engine{i}", m, 60.0, 8) for i in range(machines_per_model - n_learners)]
        learners += [LearnerSpec(f"{m}/learner{i}", m, 80.0) for i in range(n_learners)]
    return ClusterSpec(tuple(engines), tuple(learners))


def learner_demand_s(job: Job) -> float:
    """Learner-group seconds ``job`` occupies if it ran alone: its training, and for a full-parameter
    job (a group to itself) also the time its group waits on its sampling (``span_s`` minus training)."""
    return job.span_s() if job.kind.exclusive_learner else job.steps * job.step_s


def save_trace(jobs: Iterable[Job], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for job in jobs:
            f.write(json.dumps(asdict(job), sort_keys=True) + "\n")


def load_trace(path: str | Path) -> list[Job]:
    jobs = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                raw["kind"] = JobKind(raw["kind"])
                jobs.append(Job(**raw))
            except (ValueError, TypeError, KeyError) as exc:
                raise ConfigError(f"{path}:{n}: not a job record ({exc})") from exc
    return jobs


__all__ = [
    "TraceConfig",
    "default_cluster",
    "generate_trace",
    "hybrid_cluster",
    "learner_demand_s",
    "load_trace",
    "save_trace",
    "sized_cluster",
]
