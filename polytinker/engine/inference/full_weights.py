"""Engines for full-parameter jobs' versions, beside an engine worker's multi-LoRA engine.

A LoRA version is a few megabytes that rides on the shared base weights; a full-parameter job's
version is a whole model. Each such version gets an ``InferenceEngine`` of its own, over a
transformers backend built from the base model's architecture with the version's weights copied
in from its checkpoint (the learner's checkpoint is the export: no second copy is written).

- Requests for one version meet in that version's batches. They cannot share a batch with LoRA
  requests: the weights under them differ.
- At most ``slots`` versions are resident. Beyond that the least recently used one with no request
  in flight is closed; a version with requests in flight is never closed under them (the bound is
  exceeded until they finish), so a request keeps the weights it started with.
- A vLLM engine worker serves its full-parameter versions this way too: vLLM would need one more
  ``LLM`` instance, and its memory, per version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.inference.engine import InferenceEngine
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner.state import load_full_weights
from polytinker.engine.models import load_model
from polytinker.errors import ConfigError

log = logging.getLogger("polytinker.engine.inference.full_weights")


@dataclass
class _Resident:
    engine: Any  # InferenceEngine
    users: int = 0  # requests in flight on it


class FullWeightEngines:
    """``use(key, version, checkpoint)`` yields the engine serving that full-parameter version."""

    def __init__(self, model: str, slots: int, engine_config: Any) -> None:
        if slots < 1:
            raise ConfigError(f"full-weight slots must be >= 1, got {slots}")
        self.model, self.slots, self.engine_config = model, slots, engine_config
        self.loads = 0
        self._resident: OrderedDict[tuple[str, int, str], _Resident] = OrderedDict()
        self._lock = threading.Lock()
        self._build = threading.Lock()  # one model built at a time: a second request for it waits

    def _make(self, checkpoint: str) -> Any:
        if not checkpoint or not Path(checkpoint).is_dir():
            raise ConfigError(f"full-parameter weights: no checkpoint at {checkpoint!r}")
        model, tokenizer = load_model(self.model)
        load_full_weights(checkpoint, model)
        backend = HFBackend(HFBackendConfig(model=self.model), model=model, tokenizer=tokenizer)
        return InferenceEngine(backend, self.engine_config)

    @contextlib.contextmanager
    def use(self, key: str, version: int, checkpoint: str) -> Iterator[Any]:
        slot = (key, version, checkpoint)  # a version reloaded from another checkpoint is another model
        entry = self._acquire(slot)
        if entry is None:
            with self._build:
                entry = self._acquire(slot)  # built by the request this one waited behind
                if entry is None:
                    engine = self._make(checkpoint)
                    with self._lock:
                        entry = self._resident[slot] = _Resident(engine, users=1)
                        self.loads += 1
                    log.info("full-parameter weights %s v%d resident (from %s)", key, version, checkpoint)
        try:
            yield entry.engine
        finally:
            with self._lock:
                entry.users -= 1
            self._evict()

    def _acquire(self, slot: tuple[str, int, str]) -> _Resident | None:
        with self._lock:
            entry = self._resident.get(slot)
            if entry is None:
                return None
            entry.users += 1
            self._resident.move_to_end(slot)
            return entry

    def _evict(self) -> None:
        closing = []
        with self._lock:
            idle = [s for s, e in self._resident.items() if e.users == 0]  # oldest use first
            while len(self._resident) > self.slots and idle:
                closing.append(self._resident.pop(idle.pop(0)).engine)
        for engine in closing:
            engine.close()

    def resident(self) -> list[str]:
        with self._lock:
            return [f"{key}@{version}" for key, version, _ in self._resident]

    def close(self) -> None:
        with self._lock:
            engines = [e.engine for e in self._resident.values()]
            self._resident.clear()
        for engine in engines:
            engine.close()


__all__ = ["FullWeightEngines"]
