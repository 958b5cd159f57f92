"""Adapter versions to and from peft directories, and polytinker's LoraConfig as peft's.

A peft adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
keys look like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the layout
:class:`~polytinker.engine.adapter_weights.AdapterWeights` uses in memory, so both directions are
a copy of a dict. vLLM loads adapters from such directories; the hf backend loads either.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.types import AdapterRef, LoraConfig
from polytinker.errors import ModelError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def to_peft_config(lora: LoraConfig, base_model_path: str | None = None) -> Any:
    """peft's LoraConfig for polytinker's (causal LM task, no bias)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def peft_config_dict(lora: LoraConfig, base_model_path: str | None = None) -> dict[str, Any]:
    """``adapter_config.json``'s content for ``lora`` (sets as sorted lists, as JSON holds them)."""
    config = to_peft_config(lora, base_model_path).to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def from_peft_config(raw: dict[str, Any]) -> LoraConfig:
    """polytinker's LoraConfig from a parsed ``adapter_config.json``."""
    targets = raw.get("target_modules") or ()
    if isinstance(targets, str):
        # peft allows a regex here; polytinker's adapters always name modules, so reject it clearly.
        raise ModelError(f"adapter_config.json names target_modules by regex ({targets!r}); list module names")
    return LoraConfig(
        rank=int(raw["r"]),
        alpha=int(raw.get("lora_alpha", raw["r"])),
        target_modules=tuple(sorted(targets)),
        dropout=float(raw.get("lora_dropout", 0.0)),
    )


def write_adapter_dir(weights: AdapterWeights, path: Path, base_model_path: str | None = None) -> Path:
    """Write ``weights`` as a peft directory at ``path``, atomically (temp dir, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        config = peft_config_dict(weights.config, base_model_path)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n")
        tensors = {k: t.detach().to("cpu").contiguous() for k, t in weights.tensors.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"polytinker_ref": str(weights.ref)})
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_adapter_dir(ref: AdapterRef, path: Path) -> AdapterWeights:
    """Read a peft adapter directory into memory as ``ref``."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ModelError(f"{path} is not a peft adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = from_peft_config(json.loads(config_file.read_text()))
    tensors: dict[str, torch.Tensor] = load_file(str(weights_file))
    return AdapterWeights.pack(ref, config, tensors)


def random_adapter(
    model: torch.nn.Module, ref: AdapterRef, config: LoraConfig | None = None, *, seed: int = 0, scale: float = 0.02
) -> AdapterWeights:
    """An adapter for ``model`` with random A and B (peft starts B at zero, which would make every
    adapter equal the base model): for tests and benchmarks that need adapters that differ."""
    config = config or LoraConfig()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        # A layer already wrapped for LoRA (here: .base; peft: .base_layer) keeps its linear inside.
        linear = next(
            (
                m
                for m in (module, getattr(module, "base", None), getattr(module, "base_layer", None))
                if isinstance(m, torch.nn.Linear)
            ),
            None,
        )
        if name.rsplit(".", 1)[-1] not in config.target_modules or linear is None:
            continue
        prefix = f"base_model.model.{name}"
        a_shape, b_shape = (config.rank, linear.in_features), (linear.out_features, config.rank)
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(a_shape, generator=generator) * scale
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(b_shape, generator=generator) * scale
    if not tensors:
        raise ModelError(f"no module of the model matches target_modules {config.target_modules}")
    return AdapterWeights.pack(ref, config, tensors)


__all__ = ["from_peft_config", "random_adapter", "read_adapter_dir", "to_peft_config", "write_adapter_dir"]
