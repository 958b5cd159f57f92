"""A LoRA training client's adapter: Tinker's options, and the ``lora`` fields of its job.

- ``LORA_KINDS``: the job kinds a LoRA training client makes (``lora_rl``, which samples too, and
  ``sft``, which has no engine).
- ``lora_modules``: the target modules of Tinker's ``train_mlp`` / ``train_attn`` /
  ``train_unembed`` switches, unless ``target_modules`` names them.
- ``lora_fields``: the ``lora`` a new job is created with and its ``TrainingClient`` keeps
  (``rank``, ``alpha``, ``seed``, ``target_modules``).
- ``lora_options``: the other way, for ``create_training_client_from_state``: the
  ``create_lora_training_client`` arguments of a job shaped like a saved one (its kind and
  ``lora``, as ``weights_info`` answers them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polytinker.engine.types import ATTN_MODULES, DEFAULT_TARGET_MODULES, MLP_MODULES, UNEMBED_MODULE
from polytinker.errors import ConfigError
from polytinker.scheduler.types import JobKind

LORA_KINDS = (JobKind.LORA_RL, JobKind.SFT)  # the kinds a LoRA training client makes


def lora_modules(
    train_mlp: bool, train_attn: bool, train_unembed: bool, target_modules: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The LoRA target modules: ``target_modules`` when given, else Tinker's switches (attention and
    MLP without the unembedding: ``()``, the learner's default of every linear projection)."""
    if target_modules:
        return tuple(target_modules)
    if train_mlp and train_attn and not train_unembed:
        return ()
    modules = (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
    modules += (UNEMBED_MODULE,) if train_unembed else ()
    if not modules:
        raise ConfigError("train_attn, train_mlp and train_unembed are all False: LoRA would train nothing")
    return modules


def lora_fields(rank: int, alpha: int | None, seed: int | None, target_modules: tuple[str, ...]) -> dict[str, Any]:
    """A new job's ``lora``: ``alpha`` None (or 0) is ``rank``, ``seed`` (of the adapter's
    initialisation) None is 0; ``target_modules`` as ``lora_modules`` gives them."""
    return {
        "rank": rank,
        "alpha": alpha or rank,
        "seed": 0 if seed is None else int(seed),
        "target_modules": target_modules,
    }


def lora_options(kind: str, lora: Mapping[str, Any]) -> dict[str, Any]:
    """The ``create_lora_training_client`` keywords (``kind``, ``rank``, ``alpha``, ``seed``,
    ``target_modules``) of a job shaped like a saved one of ``kind`` with ``lora``; a kind that
    is not a LoRA one gives ``lora_rl``."""
    return {
        "kind": kind if kind in LORA_KINDS else JobKind.LORA_RL,
        "rank": int(lora.get("rank", 32)),
        "alpha": int(lora.get("alpha") or 0) or None,
        # None named: the learner's default then (every projection, not the unembedding).
        "target_modules": tuple(lora.get("target_modules") or DEFAULT_TARGET_MODULES),
        "seed": lora.get("seed"),
    }


__all__ = ["LORA_KINDS", "lora_fields", "lora_modules", "lora_options"]
