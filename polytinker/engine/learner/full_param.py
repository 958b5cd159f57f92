"""Full-parameter training of a model with no adapter (``FullParamLearner``).

Every parameter trains with one AdamW. The one slot is addressed as ``adapter=None`` and its
versions are reported as ``AdapterRef(FULL_SLOT, n)``. A KL term against the base model is
refused: the reference would need a second copy of the weights. In a group of K > 1 ranks the
model is sharded with FSDP2 unless ``LearnerConfig.full_sharding = "replicate"`` (``sharding``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from polytinker.engine.learner._base import Learner, Slot, new_adamw
from polytinker.engine.learner.config import LearnerConfig
from polytinker.engine.learner.distributed import SINGLE, DistInfo, broadcast_
from polytinker.engine.learner.sharding import gather_full, gather_optimizer_state, shard_model, shard_optimizer_state
from polytinker.engine.learner.state import Checkpoint, copy_full_weights, load_checkpoint, save_checkpoint
from polytinker.engine.types import AdapterName, AdapterRef
from polytinker.errors import ConfigError, NotBuiltError

FULL_SLOT = "full"


class FullParamLearner(Learner):
    """A learner that trains every weight of one model."""

    def __init__(
        self, model: nn.Module, config: LearnerConfig | None = None, dist: DistInfo = SINGLE, pad_token_id: int = 0
    ):
        config = config or LearnerConfig(mode="full")
        if config.mode != "full":
            raise ConfigError("FullParamLearner needs LearnerConfig(mode='full'); use MultiAdapterLearner for LoRA")
        super().__init__(model, config, dist, pad_token_id)
        for p in self.base_model.parameters():
            p.requires_grad_(True)
        self.sharded = config.sharded(dist.world_size)
        if self.sharded:
            # No broadcast first: the model is still on the CPU, which NCCL cannot broadcast from;
            # every rank loaded the same weights (a checkpoint, or a seeded random preset).
            self._scoring_root = shard_model(self.base_model, dist)  # parameters become DTensors
        else:
            broadcast_(list(self.base_model.parameters()))
        self._slot_ = Slot(FULL_SLOT, dict(self.base_model.named_parameters()))

    def _slot(self, adapter: AdapterName | None) -> Slot:
        if adapter not in (None, FULL_SLOT):
            raise ConfigError(f"a full-parameter learner has no adapters; pass adapter=None, not {adapter!r}")
        return self._slot_

    @contextlib.contextmanager
    def _selected(self, adapter: AdapterName | None) -> Iterator[None]:
        self._slot(adapter)
        yield

    def _reference(self) -> contextlib.AbstractContextManager[None]:
        raise NotBuiltError("a KL reference in full-parameter mode would need a second copy of the model")

    def version(self) -> AdapterRef:
        return self._slot_.ref()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A CPU snapshot of every weight (``state_dict`` keys), e.g. for an engine to reload."""
        if self.sharded:
            raise ConfigError("a sharded learner's whole weights are gathered by save_state, which every rank runs")
        return {k: v.detach().to("cpu", copy=True) for k, v in self.base_model.state_dict().items()}

    def save_state(self, path: str | os.PathLike[str], adapter: AdapterName | None = None) -> Path:
        slot = self._slot(adapter)
        opt_state = slot.optimizer.state_dict() if slot.optimizer is not None else None
        meta = {"mode": "full", "adapter": FULL_SLOT, "version": slot.version}
        # Tied weights (embeddings / lm_head) share storage; save each parameter once, by parameter name.
        tensors = {k: p.detach() for k, p in slot.params.items()}
        if self.sharded:  # every rank gathers (collective); rank 0 writes what one process would
            tensors = gather_full(slot.params)
            opt_state = gather_optimizer_state(opt_state) if opt_state is not None else None
            if not self.dist.is_main:
                return Path(path)
        return save_checkpoint(path, Checkpoint(tensors, opt_state, meta))

    def load_state(
        self, path: str | os.PathLike[str], adapter: AdapterName | None = None, *, optimizer: bool = True
    ) -> AdapterRef:
        slot = self._slot(adapter)
        ckpt = load_checkpoint(path)
        copy_full_weights(path, ckpt, slot.params)
        for p in slot.params.values():
            p.grad = None
        slot.optimizer = None
        if optimizer and ckpt.optimizer_state is not None:
            params = list(slot.params.values())
            slot.optimizer = new_adamw(params)
            state = ckpt.optimizer_state
            slot.optimizer.load_state_dict(shard_optimizer_state(state, params) if self.sharded else state)
        slot.version = int(ckpt.meta["version"])
        slot.pending_tokens = 0.0
        return slot.ref()


__all__ = ["FULL_SLOT", "FullParamLearner"]
