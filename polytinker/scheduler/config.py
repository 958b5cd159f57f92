"""Settings of the scheduling policy (``SchedulerPolicyConfig``) and of the simulator (``SimulatorConfig``).

Both are frozen and validated on construction; an invalid value raises ``ConfigError`` saying how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polytinker.errors import ConfigError


@dataclass(frozen=True)
class SchedulerPolicyConfig:
    max_queued_jobs: int = 100_000
    """Bound on queued jobs across all tenants; a submission beyond it answers Overloaded."""

    max_queued_per_tenant: int = 50_000
    """Bound per tenant, so one tenant cannot fill the queue for everyone."""

    tenant_weights: tuple[tuple[str, float], ...] = ()
    """(tenant, weight) pairs: a tenant with weight 2 gets twice the resource-time of one with weight 1."""

    default_weight: float = 1.0
    """Weight of a tenant not named in tenant_weights."""

    backfill_depth: int = 64
    """Queued jobs a pass may find not fitting before it stops looking (bounds one decision's cost,
    as Slurm's backfill does); jobs that fit never count against it."""

    starvation_s: float = 900.0
    """A job queued this long gets resources reserved for it, so smaller jobs cannot starve it forever."""

    backfill_reserved: bool = True
    """Whether a job may use resources reserved for a starving job when, by declared sizes, it is done
    before they are expected to be free (EASY backfilling); off: nothing of equal or lower priority
    is placed on a reserved resource."""

    preemption: bool = True
    """Whether a waiting job may preempt running jobs of strictly lower priority (at step boundaries)."""

    preempt_checks_per_pass: int = 4
    """Waiting jobs per pass for which the policy looks for lower-priority jobs to preempt (each look
    scans the running jobs; a bound keeps one decision cheap with a long queue)."""

    order_by_size: bool = True
    """Within one tenant and priority, run the job with the least declared work first (else arrival order)."""

    retry_after_min_s: float = 1.0
    """Floor of the retry_after_s an Overloaded answer carries."""

    retry_after_max_s: float = 300.0
    """Ceiling of the retry_after_s an Overloaded answer carries."""

    def __post_init__(self) -> None:
        if self.max_queued_jobs <= 0 or self.max_queued_per_tenant <= 0:
            raise ConfigError("max_queued_jobs and max_queued_per_tenant must be positive (they bound memory use)")
        names = [t for t, _ in self.tenant_weights]
        if len(set(names)) != len(names):
            raise ConfigError("tenant_weights names a tenant twice: give each tenant one weight")
        if any(not (w > 0 and math.isfinite(w)) for _, w in self.tenant_weights) or not self.default_weight > 0:
            raise ConfigError("tenant weights and default_weight must be positive finite numbers")
        if self.preempt_checks_per_pass < 0:
            raise ConfigError(f"preempt_checks_per_pass must be >= 0, got {self.preempt_checks_per_pass}")
        if self.backfill_depth <= 0:
            raise ConfigError(f"backfill_depth must be >= 1, got {self.backfill_depth}")
        if not self.starvation_s > 0:
            raise ConfigError(f"starvation_s must be > 0 (use math.inf to never reserve), got {self.starvation_s}")
        if not 0 < self.retry_after_min_s <= self.retry_after_max_s:
            raise ConfigError("need 0 < retry_after_min_s <= retry_after_max_s")

    def weight(self, tenant: str) -> float:
        for name, w in self.tenant_weights:
            if name == tenant:
                return w
        return self.default_weight


@dataclass(frozen=True)
class SimulatorConfig:
    optimizer_swap_s: float = 0.1
    """Learner time to move one LoRA job's optimizer state out and the next job's in, paid when a
    shared learner group switches between jobs at a step boundary (rank-16 Adam state of an 8B model
    is about 0.5 GB: tens of milliseconds each way over PCIe)."""

    checkpoint_save_s: float = 2.0
    """Time a preempted job holds its resources after its last step while its state is saved."""

    checkpoint_load_s: float = 2.0
    """Extra time at the start of a resumed job to load its saved state."""

    engine_full_speed_jobs: int = 1
    """Jobs an engine samples for at full speed at once; with more, they share its throughput (each
    runs at this / k). 1: one RL job's rollout batch already fills an engine (processor sharing)."""

    adapter_load_s: float = 0.5
    """Engine time to load an adapter that is not resident on the engine chosen."""

    phase_switch_s: float = 1.0
    """Time a hybrid worker takes to change phase, each way, while it holds only LoRA (shared) jobs:
    sampling to training releases the KV cache for the step's activations and hands the sampler's
    view of the adapters to the learner in place; training back to sampling allocates the KV cache
    again. With vLLM's public API that is sleep (level 1) and wake_up, which also move the base
    weights out to host memory and back: 16 GB of an 8B model in bf16 at about 25 GB/s over PCIe is
    0.65 s each way; 1 s covers that and the synchronisation. No work is done meanwhile."""

    full_phase_switch_s: float = 3.0
    """The same for a hybrid worker holding a full-parameter job: its Adam moments (fp32, 2 x 32 GB
    for 8B parameters) leave for host memory before sampling and come back before training,
    about 2.6 s each way at 25 GB/s."""

    max_time_s: float = math.inf
    """Stop the simulation at this simulated time (jobs not finished then have no JCT)."""

    def __post_init__(self) -> None:
        costs = (self.optimizer_swap_s, self.checkpoint_save_s, self.checkpoint_load_s, self.adapter_load_s)
        costs_s = (*costs, self.phase_switch_s, self.full_phase_switch_s)
        if any(c < 0 or not math.isfinite(c) for c in costs_s):
            raise ConfigError(
                "simulator costs (swap, checkpoint save/load, adapter load, phase switches) must be finite and >= 0"
            )
        if self.engine_full_speed_jobs < 1:
            raise ConfigError(f"engine_full_speed_jobs must be >= 1, got {self.engine_full_speed_jobs}")
        if not self.max_time_s > 0:
            raise ConfigError(f"max_time_s must be > 0, got {self.max_time_s}")


__all__ = ["SchedulerPolicyConfig", "SimulatorConfig"]
