"""A LoRA adapter that changes nothing, standing in for "no adapter" on vLLM's CPU build.

vLLM marks a base-model row of a LoRA batch with slot index -1. Its GPU kernels skip such rows,
but the plain-torch LoRA ops of the CPU build (vLLM 0.32, ``lora/ops/torch_ops``) index the
slot tensor with it, and -1 selects the *last* slot: once an adapter occupies that slot, base
requests are served with that adapter's update. Routing base requests through an adapter whose
B matrix is zero gives every row a real slot and adds exactly zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytinker.engine.types import AdapterRef, AdapterWeights, LoraConfig
from polytinker.errors import ModelError

BASE_ADAPTER_NAME = "polytinker-base-model"
RANK = 1  # the smallest rank vLLM accepts; the tensors are zeros anyway


def zero_adapter(model_path: Path, target_modules: tuple[str, ...]) -> AdapterWeights:
    """A rank-1 adapter on the first linear module that ``target_modules`` names, with B = 0.

    One module is enough: vLLM zero-fills the modules an adapter does not cover. The model's
    shapes come from an empty (meta-device) instance, so nothing is loaded or allocated.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for name, module in model.named_modules():
        suffix = name.rsplit(".", 1)[-1]
        if suffix in target_modules and isinstance(module, torch.nn.Linear):
            prefix = f"base_model.model.{name}"
            tensors = {
                f"{prefix}.lora_A.weight": torch.zeros(RANK, module.in_features),
                f"{prefix}.lora_B.weight": torch.zeros(module.out_features, RANK),
            }
            lora = LoraConfig(rank=RANK, alpha=RANK, target_modules=(suffix,))
            return AdapterWeights(ref=AdapterRef(BASE_ADAPTER_NAME), config=lora, tensors=tensors)
    raise ModelError(f"no linear module of {model_path} is named by lora_target_modules {target_modules}")


__all__ = ["BASE_ADAPTER_NAME", "zero_adapter"]
