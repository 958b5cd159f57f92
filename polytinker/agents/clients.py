"""The training client of an agent: a LoRA job, or a full-parameter job for ``adapter.full``."""

from __future__ import annotations

from polytinker.agents.protocols import ServiceClientLike, TrainingClientLike
from polytinker.agents.spec import AgentSpec


def training_client(
    service: ServiceClientLike, spec: AgentSpec, steps: int, max_staleness: int = 0
) -> TrainingClientLike:
    """A ``TrainingClient`` for ``spec``'s weights on ``service`` (a ``ServiceClient``), for a job
    of ``steps`` optimizer steps whose loop samples up to ``max_staleness`` steps ahead."""
    if spec.adapter.full:
        return service.create_training_client(
            spec.base_model, agent=spec.name, steps=steps, max_staleness=max_staleness
        )
    return service.create_lora_training_client(
        spec.base_model,
        spec.adapter.rank,
        agent=spec.name,
        alpha=spec.adapter.alpha,
        seed=spec.seed,
        target_modules=spec.adapter.target_modules,
        steps=steps,
        max_staleness=max_staleness,
    )


__all__ = ["training_client"]
