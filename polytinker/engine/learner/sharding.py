"""Full-parameter learner groups sharded with torch's FSDP2 (``fully_shard``).

A full-parameter group of K > 1 ranks with ``LearnerConfig.full_sharding = "fsdp"`` (the default)
keeps 1/K of every parameter, of its gradient and of its AdamW state on each rank, so a model
larger than one device trains. Each decoder layer is its own FSDP unit (its weights are gathered
for its forward and its backward, then freed); the rest (embeddings, final norm, lm_head, tied or
not) belongs to the root unit, which is a :class:`ScoringRoot` around the model: ``scoring.score``
calls the decoder and the head separately, so the module whose forward FSDP hooks must be the one
that does both.

What FSDP asks of its callers, and where it is met:

- **Lockstep.** Every rank runs the same number of forward (and backward) passes, since each pass
  gathers every layer collectively. Ranks hold different numbers of datums (or none), so a call
  pads the short ranks with zero-weight filler passes (``Learner.lockstep``, driven by
  ``group._execute``), and a micro-batch with no weighted token still runs its backward (its loss
  is zero but differentiable). The shared-prefix pass (a second decoder call on some ranks only)
  is off in a sharded learner.
- **Summed gradients.** Losses are sums (``losses``), as in the replicated group whose ranks'
  gradients add; FSDP's reduce-scatter averages unless told otherwise:
  ``set_gradient_divide_factor(1.0)`` and plain-sum reductions on every unit.
- **Whole tensors in checkpoints.** ``save_state`` gathers each parameter and each AdamW state
  tensor (``full_tensor``, every rank in the same order; rank 0 writes), so a checkpoint is the
  same file a single process writes and loads into a group of any size; ``load_state`` cuts each
  whole tensor into this rank's shard (``distribute_tensor`` on local data, no communication).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from polytinker.engine.learner.distributed import DistInfo


class ScoringRoot(nn.Module):
    """The root FSDP unit: holds the model and runs a scoring function on it, so one forward
    (the unit's) covers the decoder and the head that ``score`` calls one after the other."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = run(self.model, *args, **kwargs)
        # Not a view: FSDP hooks its backward on the output, and an in-place op on a view would drop it.
        return out.clone()


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the first ``nn.ModuleList`` of the model (``model.layers`` in every
    Hugging Face causal LM); a model without one is sharded as a single unit."""
    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    return list(layers) if layers is not None else []


def shard_model(model: nn.Module, info: DistInfo) -> ScoringRoot:
    """Shard ``model`` over the group's ranks in place (its parameters become DTensors); returns
    the root unit to run scoring through."""
    # Imported here: FSDP's modules take ~1 s to import, which LoRA learners and engines never need.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if info.device.type == "cuda":
        # FSDP places each unit on the current device (and the mesh takes it too): this rank's.
        torch.cuda.set_device(info.device)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    units: list[Any] = [fully_shard(block, mesh=mesh) for block in _blocks(model)]
    root = ScoringRoot(model)
    units.append(fully_shard(root, mesh=mesh))
    for unit in units:
        assert isinstance(unit, FSDPModule)
        # Sums, as the replicated group's all_reduce makes; a plain SUM, which gloo supports
        # (a divide factor alone asks for PREMUL_SUM).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return root


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (never imports torch.distributed.tensor to find out: until
    something imported it, nothing is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def as_float(t: torch.Tensor) -> float:
    """A scalar's value, gathered first when it is a DTensor (a sharded grad norm is one)."""
    return float(_whole(t))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: gathered when sharded (collective), else ``t`` itself."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


def gather_full(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU. Collective: every rank calls it, in the same order."""
    out = {}
    for name, p in params.items():
        out[name] = _whole(p.detach()).to("cpu", copy=True)
    return out


def gather_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An AdamW ``state_dict()`` with every sharded state tensor gathered whole, on the CPU, so it
    is what an unsharded AdamW would save. Collective, as :func:`gather_full`."""
    per_param = {}
    for index in sorted(state["state"]):
        per_param[index] = {
            key: (value.full_tensor().cpu() if is_sharded(value) else value)
            for key, value in sorted(state["state"][index].items())
        }
    return {"state": per_param, "param_groups": state["param_groups"]}


def copy_into_shards(params: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors into (possibly sharded) parameters; each rank keeps its own shard."""
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_like(whole[name], p) if is_sharded(p) else whole[name])  # copy_ converts dtype and device


def shard_optimizer_state(state: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """An unsharded AdamW ``state_dict()`` with each state tensor of a parameter's shape cut like
    that (sharded) parameter, ready for ``load_state_dict`` on an AdamW over ``params``."""
    per_param = {}
    for index, entry in state["state"].items():
        p = params[int(index)]
        per_param[index] = {
            key: _like(value, p) if is_sharded(p) and torch.is_tensor(value) and value.shape == p.shape else value
            for key, value in entry.items()
        }
    return {"state": per_param, "param_groups": state["param_groups"]}


def _like(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``whole`` as the sharded ``p`` holds it: this rank's shard, in ``p``'s dtype and device
    (local data, no communication: every rank read the same whole tensor)."""
    from torch.distributed.tensor import distribute_tensor

    whole = whole.to(device=p.device, dtype=p.dtype)
    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)  # type: ignore[attr-defined]


__all__ = [
    "ScoringRoot",
    "as_float",
    "copy_into_shards",
    "gather_full",
    "gather_optimizer_state",
    "is_sharded",
    "shard_model",
    "shard_optimizer_state",
]
