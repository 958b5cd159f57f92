"""Inference engines: one base model, many LoRA adapters, mixed batches.

- ``InferenceBackend`` (``base.py``): the interface a backend implements, and its conventions
  (stop handling, logprob definitions, adapter tensor layout).
- ``HFBackend`` (``hf.py``): transformers on the CPU, adapters in multi-LoRA slots.
  The vLLM backend lives in ``vllm_backend.py`` and is imported only where vLLM is installed.
- ``InferenceEngine`` (``engine.py``): thread-safe ``submit`` with dynamic batching over a
  backend; ``AdapterSlots`` (``slots.py``): LRU residency, pinning, versions held by requests.
  Internals: ``_requests.py`` checks a request against the model and splits a big one into
  chunks; ``_queue.py`` keeps one lane per tenant and fills batches round-robin across them.
- ``EngineConfig`` / ``HFBackendConfig`` (``config.py``).
- ``EngineWorker`` (``worker.py``, not re-exported: it speaks the scheduler's messages): the
  engine process the runtime runs, serving ``sched.w.sample`` / ``logprobs`` / ``stats``.
- ``adapter_io``: adapter versions to and from peft directories; random adapters for tests.
"""

from polytinker.engine.inference.adapter_io import random_adapter, read_adapter_dir, write_adapter_dir
from polytinker.engine.inference.base import InferenceBackend, cut_at_stop, render_prompt
from polytinker.engine.inference.config import EngineConfig, HFBackendConfig
from polytinker.engine.inference.engine import EngineStats, InferenceEngine
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.inference.slots import AdapterSlots

__all__ = [
    "AdapterSlots",
    "EngineConfig",
    "EngineStats",
    "HFBackend",
    "HFBackendConfig",
    "InferenceBackend",
    "InferenceEngine",
    "cut_at_stop",
    "random_adapter",
    "read_adapter_dir",
    "render_prompt",
    "write_adapter_dir",
]
