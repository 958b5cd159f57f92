"""The runtime as the scheduler's pure policy sees it: its records turned into the policy's types.

- ``cluster_spec``: the engines and learner groups a runtime config declares.
- ``worker_spec``: one worker's capacity (a declared one's config, or what a worker that joins at
  run time registers with: ``Register.memory_gb`` and ``slots``).
- ``policy_job``: a job row of the job table as a policy ``Job``, with the costs the runtime
  config assumes for its kind (``[jobs]``).
"""

from __future__ import annotations

from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.state_rows import JobRow
from polytinker.scheduler.types import ClusterSpec, EngineSpec, Job, JobKind, LearnerSpec


def worker_spec(model: str, role: str, worker_id: str, memory_gb: float, slots: int) -> EngineSpec | LearnerSpec:
    """An engine's (``slots``: its adapter slots) or a learner group's (``slots``: its max jobs)."""
    if role == "engine":
        return EngineSpec(worker_id, model, memory_gb, slots)
    return LearnerSpec(worker_id, model, memory_gb, slots)


def cluster_spec(config: RuntimeConfig) -> ClusterSpec:
    engines = tuple(EngineSpec(e.engine_id, config.model, e.memory_gb, e.adapter_slots) for e in config.engines)
    learners = tuple(LearnerSpec(g.learner_id, config.model, g.memory_gb, g.max_jobs) for g in config.learners)
    return ClusterSpec(engines, learners)


def policy_job(
    config: RuntimeConfig, row: JobRow, policy_id: str, steps_done: int, now_s: float, adapter: str | None
) -> Job:
    """``row`` as the policy's job ``policy_id``, ``steps_done`` of its steps behind it; ``adapter``:
    its adapter's runtime-wide name (a LoRA RL job's), arriving at ``now_s``."""
    d = config.jobs
    kind = row.kind
    full = kind is JobKind.FULL_RL
    return Job(
        job_id=policy_id,
        tenant=row.tenant,
        kind=kind,
        base_model=row.base_model,
        priority=row.priority,
        steps=max(1, row.steps - min(steps_done, row.steps - 1)),
        step_s=d.step_s if kind.needs_learner else 0.0,
        sample_s=d.sample_s if kind.needs_engine else 0.0,
        learner_mem_gb=(d.full_learner_mem_gb if full else d.learner_mem_gb) if kind.needs_learner else 0.0,
        engine_mem_gb=d.engine_mem_gb if kind.needs_engine else 0.0,
        arrival_s=now_s,
        adapter=adapter if kind is JobKind.LORA_RL else None,
        max_staleness=row.max_staleness,
    )


__all__ = ["cluster_spec", "policy_job", "worker_spec"]
