"""Learners: Tinker-style training primitives over one base model.

- ``MultiAdapterLearner``: many LoRA adapters on one frozen base model, each with its own AdamW.
- ``FullParamLearner``: every weight of one model trains (no adapters).
- ``make_learner(model, config)``: the one ``config.mode`` asks for.
- ``ForwardBackwardResult``: loss, per-datum logprobs and metrics of one ``forward_backward``.
- ``LearnerConfig``, ``AdamParams``, ``LossConfig``: configuration.
- ``LearnerGroup``: K data-parallel replicas led by rank 0 (``LearnerGroup.start``, or ``run_rank`` under torchrun).
- ``LearnerWorker`` (``worker.py``, not re-exported: it speaks the scheduler's messages): the
  learner process the runtime runs, one ``LearnerGroup`` serving the ``sched.w.*`` training calls.
- ``init_distributed``, ``DistInfo``: torch.distributed plumbing (gloo on CPU, NCCL on GPU).
- ``save_checkpoint`` / ``load_checkpoint``: the atomic on-disk state format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polytinker.engine.learner.config import AdamParams, LearnerConfig, LossConfig

if TYPE_CHECKING:
    from torch import nn

    from polytinker.engine.learner._base import ForwardBackwardResult, Learner
    from polytinker.engine.learner.distributed import SINGLE, DistInfo, init_distributed
    from polytinker.engine.learner.full_param import FULL_SLOT, FullParamLearner
    from polytinker.engine.learner.group import LearnerGroup, run_rank
    from polytinker.engine.learner.losses import LOSS_FNS
    from polytinker.engine.learner.multi_adapter import MultiAdapterLearner
    from polytinker.engine.learner.state import load_checkpoint, save_checkpoint

# Imported on first use (PEP 562): the configuration above is all a client needs, and importing
# the learners would pull torch, transformers and peft (~0.3 GiB) into every process that does.
_LAZY = {
    "ForwardBackwardResult": "_base",
    "Learner": "_base",
    "SINGLE": "distributed",
    "DistInfo": "distributed",
    "init_distributed": "distributed",
    "FULL_SLOT": "full_param",
    "FullParamLearner": "full_param",
    "LearnerGroup": "group",
    "run_rank": "group",
    "LOSS_FNS": "losses",
    "MultiAdapterLearner": "multi_adapter",
    "load_checkpoint": "state",
    "save_checkpoint": "state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def make_learner(
    model: nn.Module, config: LearnerConfig | None = None, dist: DistInfo | None = None, pad_token_id: int = 0
) -> MultiAdapterLearner | FullParamLearner:
    """The learner ``config.mode`` names, over ``model`` (moved to ``dist.device``; default: one CPU process)."""
    # torch, transformers and peft load when a learner is made: the package's names (configs, the
    # worker) are read by the scheduler and the client too.
    from polytinker.engine.learner.distributed import SINGLE
    from polytinker.engine.learner.full_param import FullParamLearner
    from polytinker.engine.learner.multi_adapter import MultiAdapterLearner

    config = config or LearnerConfig()
    dist = dist or SINGLE
    if config.mode == "full":
        return FullParamLearner(model, config, dist, pad_token_id=pad_token_id)
    return MultiAdapterLearner(model, config, dist, pad_token_id=pad_token_id)


__all__ = [
    "FULL_SLOT",
    "LOSS_FNS",
    "SINGLE",
    "AdamParams",
    "DistInfo",
    "ForwardBackwardResult",
    "FullParamLearner",
    "Learner",
    "LearnerConfig",
    "LearnerGroup",
    "LossConfig",
    "MultiAdapterLearner",
    "init_distributed",
    "load_checkpoint",
    "make_learner",
    "run_rank",
    "save_checkpoint",
]
