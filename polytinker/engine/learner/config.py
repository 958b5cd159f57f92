"""Configuration of a learner: one frozen dataclass per concern.

- ``LearnerConfig``: the learner itself (LoRA or full parameters, micro-batching, gradient normalisation, KL).
- ``AdamParams``: the AdamW hyperparameters passed with each ``optim_step`` (as in Tinker).
- ``LossConfig``: per-call loss settings, parsed from a ``loss_fn_config`` mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, get_args

from polytinker.errors import ConfigError
from polytinker.transport.messages import register_message

LearnerMode = Literal["lora", "full"]
GradNormalization = Literal["sum", "per_token"]
FullSharding = Literal["fsdp", "replicate"]
FULL_SHARDINGS: tuple[str, ...] = get_args(FullSharding)


@dataclass(frozen=True)
class LearnerConfig:
    mode: LearnerMode = "lora"
    # "lora": one base model, many LoRA adapters, each with its own AdamW; the base stays frozen.
    # "full": every parameter of the model trains with one AdamW; there are no adapters.
    micro_batch_size: int = 8
    # Datums per forward/backward pass; a larger call is split so peak memory stays bounded.
    max_tokens_per_pass: int = 4096
    # Decoder positions per pass, too (datums x the longest, a shared prompt prefix counted once):
    # activation memory grows with positions, not datums, so 32 long datums run as several passes
    # (32 tic-tac-toe prompts in one pass took a learner to 11.6 GB). A longer datum runs alone.
    grad_normalization: GradNormalization = "sum"
    # "sum": gradients are of the summed per-token loss, as Tinker does; data-parallel ranks sum too.
    # "per_token": at optim_step the accumulated gradient is divided by the number of weighted tokens
    # seen since the last step, counted over every forward_backward call and every rank.
    kl_coef: float = 0.0
    # Default weight of the KL penalty against the base model (adapter disabled); a call's
    # loss_fn_config may override it. 0 turns the reference forward off.
    max_grad_norm: float | None = None
    # Clip the (reduced, normalised) gradient norm of the stepped parameters before AdamW; None: no clip.
    share_prefix: bool = True
    # Run a micro-batch's common token prefix (a GRPO group's prompt) once and its rows' suffixes on
    # its key/value cache; the same logprobs and gradients as the full pass, up to float rounding.
    full_sharding: FullSharding = "fsdp"
    # A full-parameter group of K > 1 ranks: "fsdp" keeps 1/K of every parameter, gradient and
    # AdamW state per rank (FSDP2, see sharding.py), so a model larger than one device trains;
    # "replicate" keeps a whole copy per rank and all-reduces gradients. LoRA groups replicate.
    gradient_checkpointing: bool = False
    # Decoder layers keep only their inputs for backward and recompute the rest there: less
    # activation memory (~190 MiB on the train benchmark's learner) for about twice the
    # forward_backward time there. Not applied to forward_backward_many's mixed-adapter passes.

    def sharded(self, world_size: int) -> bool:
        """Whether a learner of this config in a group of ``world_size`` is sharded with FSDP2."""
        return self.mode == "full" and world_size > 1 and self.full_sharding == "fsdp"

    def __post_init__(self) -> None:
        if self.mode not in ("lora", "full"):
            raise ConfigError(f"LearnerConfig.mode must be 'lora' or 'full', got {self.mode!r}")
        if self.micro_batch_size <= 0:
            raise ConfigError(f"LearnerConfig.micro_batch_size must be positive, got {self.micro_batch_size}")
        if self.max_tokens_per_pass <= 0:
            raise ConfigError(f"LearnerConfig.max_tokens_per_pass must be positive, got {self.max_tokens_per_pass}")
        if self.grad_normalization not in ("sum", "per_token"):
            raise ConfigError(
                f"LearnerConfig.grad_normalization must be 'sum' or 'per_token', got {self.grad_normalization!r}"
            )
        if self.full_sharding not in FULL_SHARDINGS:
            raise ConfigError(f"LearnerConfig.full_sharding: one of {FULL_SHARDINGS}, not {self.full_sharding!r}")
        if not 0 <= self.kl_coef < math.inf:
            raise ConfigError(f"LearnerConfig.kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.kl_coef > 0 and self.mode == "full":
            raise ConfigError("LearnerConfig.kl_coef > 0 needs mode='lora' (the reference is the adapter-less base)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"LearnerConfig.max_grad_norm must be positive or None, got {self.max_grad_norm}")


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyperparameters of one optimizer step (Tinker passes them with every step). The
    scheduler's ``sched.optim_step`` and the learner's ``sched.w.step`` carry one as it is
    (registered as ``sched.adam_params``), so its checks are the wire's too."""

    learning_rate: float = 1e-4
    # Step size.
    beta1: float = 0.9
    # Decay of the first-moment estimate.
    beta2: float = 0.95
    # Decay of the second-moment estimate.
    eps: float = 1e-12
    # Added to the denominator for numerical safety (Tinker's default).
    weight_decay: float = 0.0
    # Decoupled weight decay (AdamW), applied only to the stepped parameters.
    grad_clip_norm: float = 0.0
    # Clip the gradient's global norm to this before the step; 0: no clip (Tinker's meaning).

    def __post_init__(self) -> None:
        # A NaN or an infinity here would step every weight to NaN: each bound is written so that
        # NaN fails it too.
        if not 0 <= self.learning_rate <= 10:
            raise ConfigError(f"AdamParams.learning_rate must be in [0, 10], got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"AdamParams.{name} must be in [0, 1), got {value}")
        if not 0 < self.eps <= 1:
            raise ConfigError(f"AdamParams.eps must be in (0, 1], got {self.eps}")
        if not 0 <= self.grad_clip_norm < math.inf:
            raise ConfigError(f"AdamParams.grad_clip_norm must be finite and >= 0 (0: none), got {self.grad_clip_norm}")
        if not 0 <= self.weight_decay <= 10:
            raise ConfigError(f"AdamParams.weight_decay must be in [0, 10], got {self.weight_decay}")


register_message("sched.adam_params", AdamParams)


@dataclass(frozen=True)
class LossConfig:
    """Per-call loss settings; build one with :meth:`from_mapping` from a ``loss_fn_config``."""

    clip_low_threshold: float = 0.8
    # ppo: lower bound of the clipped probability ratio (1 - epsilon).
    clip_high_threshold: float = 1.2
    # ppo: upper bound of the clipped probability ratio (1 + epsilon).
    kl_coef: float | None = None
    # Weight of the KL penalty against the base model; None: the learner's default.
    beta: float = 0.05
    # dro: weight of the quadratic penalty 0.5 * beta * (logp - sampling_logp)^2.

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low_threshold <= 1.0 <= self.clip_high_threshold:
            raise ConfigError(
                "LossConfig needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                f"{self.clip_low_threshold} and {self.clip_high_threshold}"
            )
        if self.kl_coef is not None and not 0 <= self.kl_coef < math.inf:
            raise ConfigError(f"LossConfig.kl_coef must be finite and >= 0, got {self.kl_coef}")
        if not 0 <= self.beta < math.inf:
            raise ConfigError(f"LossConfig.beta must be finite and >= 0, got {self.beta}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, float] | None) -> LossConfig:
        """Accepts the field names, and ``clip_epsilon`` as shorthand for a symmetric clip."""
        if not mapping:
            return cls()
        values = dict(mapping)
        if "clip_epsilon" in values:
            eps = float(values.pop("clip_epsilon"))
            values.setdefault("clip_low_threshold", 1.0 - eps)
            values.setdefault("clip_high_threshold", 1.0 + eps)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown loss_fn_config keys {unknown}; known: {sorted(known | {'clip_epsilon'})}")
        return cls(**{k: float(v) for k, v in values.items()})


__all__ = ["AdamParams", "GradNormalization", "LearnerConfig", "LearnerMode", "LossConfig"]
