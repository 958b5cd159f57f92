"""Adapter checks and the zero adapter for the vllm backend.

**Shape checks.** vLLM 0.32 accepts an adapter whose tensors do not fit the model and fails
later, inside a forward step, which kills its engine process. Each adapter is therefore checked
against the model's linear modules (read from an empty, meta-device instance: nothing is
allocated) before vLLM sees it.

**The zero adapter.** vLLM marks a base-model row of a LoRA batch with slot index -1. Its GPU
kernels skip such rows, but the plain-torch LoRA ops of the CPU build (``lora/ops/torch_ops``)
index the slot tensor with it, and -1 selects the *last* slot: once an adapter occupies that
slot, base-model requests are served with that adapter's update. Routing base-model requests
through an adapter whose B matrix is zero gives every row a real slot and adds exactly zero.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.types import AdapterRef, LoraConfig
from polytinker.errors import ModelError

BASE_ADAPTER_NAME = "polytinker-base-model"
ZERO_RANK = 1  # the smallest rank vLLM accepts; the tensors are zeros anyway
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


def linear_shapes(model_path: Path) -> dict[str, tuple[int, int]]:
    """``{module path: (in_features, out_features)}`` for every linear module of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def check_adapter(ref: AdapterRef, shapes: dict[str, tuple[int, ...]], linears: dict[str, tuple[int, int]]) -> None:
    """Raise ModelError unless every tensor (by peft key, with its shape) fits the model."""
    if not shapes:
        raise ModelError(f"adapter {ref} has no tensors")
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            raise ModelError(
                f"adapter {ref}: tensor {key!r} is not in peft's layout "
                "(base_model.model.<module>.lora_A.weight / lora_B.weight)"
            )
        dims = linears.get(match["module"])
        if dims is None:
            raise ModelError(f"adapter {ref}: {match['module']!r} is not a linear module of the model")
        in_features, out_features = dims
        fits = (
            len(shape) == 2 and shape[1] == in_features
            if match["part"] == "A"
            else len(shape) == 2 and shape[0] == out_features
        )
        if not fits:
            expected = f"(rank, {in_features})" if match["part"] == "A" else f"({out_features}, rank)"
            raise ModelError(f"adapter {ref}: {key} has shape {tuple(shape)}, the model needs {expected}")


def zero_adapter(linears: dict[str, tuple[int, int]], target_modules: tuple[str, ...]) -> AdapterWeights:
    """A rank-1 adapter with B = 0 on the first linear module that ``target_modules`` names.
    One module is enough: vLLM zero-fills the modules an adapter does not cover."""
    for name, (in_features, out_features) in linears.items():
        suffix = name.rsplit(".", 1)[-1]
        if suffix in target_modules:
            prefix = f"base_model.model.{name}"
            tensors = {
                f"{prefix}.lora_A.weight": torch.zeros(ZERO_RANK, in_features),
                f"{prefix}.lora_B.weight": torch.zeros(out_features, ZERO_RANK),
            }
            lora = LoraConfig(rank=ZERO_RANK, alpha=ZERO_RANK, target_modules=(suffix,))
            return AdapterWeights.pack(AdapterRef(BASE_ADAPTER_NAME), lora, tensors)
    raise ModelError(f"no linear module of the model is named by lora_target_modules {target_modules}")


__all__ = ["BASE_ADAPTER_NAME", "check_adapter", "linear_shapes", "zero_adapter"]
