"""Job traces: generate a synthetic one (``TraceConfig``, ``generate_trace``), save and load JSONL.

The generator aims at what a shared RL runtime sees, not at what flatters a policy:

- Arrivals are bursty: a two-state modulated Poisson process (calm, and bursts at ``burst_factor``
  times the calm rate), so queues build up and drain.
- Sizes are heavy-tailed: steps per job are log-normal (most jobs short, a few very long).
- Kinds are mixed (LoRA RL, full-parameter RL, SFT, inference) with per-kind step times and memory;
  full-parameter jobs need a whole learner group.
- Tenants submit unequal shares of the jobs; priorities are mostly 0, some 1, a few 2.
- A small fraction of jobs ask for more memory than any machine has (they must be rejected).

Every draw comes from one ``numpy.random.Generator`` seeded by ``seed``: the same config gives the
same trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from polytinker.errors import ConfigError
from polytinker.scheduler.types import ClusterSpec, EngineSpec, Job, JobKind, LearnerSpec


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
    return [_job(cfg, rng, i, t) for i, t in enumerate(_arrivals(cfg, rng))]


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


__all__ = ["TraceConfig", "default_cluster", "generate_trace", "load_trace", "save_trace"]
