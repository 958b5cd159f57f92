"""Inference engines: one base model, many LoRA adapters, mixed batches.

- ``InferenceBackend`` (``base.py``): the interface a backend implements (``hf``: transformers
  + peft; ``vllm``: vLLM with LoRA).
- ``adapter_io``: adapter versions to and from peft directories.
"""

from polytinker.engine.inference.adapter_io import random_adapter, read_adapter_dir, write_adapter_dir
from polytinker.engine.inference.base import InferenceBackend, cut_at_stop, render_prompt

__all__ = [
    "InferenceBackend",
    "cut_at_stop",
    "random_adapter",
    "read_adapter_dir",
    "render_prompt",
    "write_adapter_dir",
]
