"""The engine worker: one inference backend behind the scheduler, with dynamic batching.

Sample requests from every job and tenant go into one queue. A batching thread takes the first,
waits ``batch_window_s`` for more (up to ``max_batch_size`` sequences) and serves them as one
mixed batch: each request names its own adapter version, so requests of different jobs share the
base model's matmuls (``InferenceBackend.sample``). Adapter versions are loaded on demand from the
peft directory the scheduler names, and the least recently used one is unloaded beyond
``adapter_slots``. ``stats`` counts batches, and those that mixed adapters or tenants.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import EngineWorkerConfig
from polytinker.scheduler.service.messages import EngineLogprobs, EngineSample, SamplingMsg, WorkerStats

log = logging.getLogger("polytinker.scheduler.engine_worker")


def make_backend(model: str, cfg: EngineWorkerConfig) -> Any:
    if cfg.backend == "vllm":
        from polytinker.engine.inference.vllm_backend import VllmBackend, VllmBackendConfig

        return VllmBackend(VllmBackendConfig(model=model, max_loras=cfg.adapter_slots))
    from polytinker.engine.inference.config import HFBackendConfig
    from polytinker.engine.inference.hf import HFBackend

    return HFBackend(HFBackendConfig(model=model))


def _params(p: SamplingMsg, n: int) -> Any:
    from polytinker.engine.types import SamplingParams

    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed,
        n=n,
        ignore_eos=p.ignore_eos,
    )


class EngineWorker:
    """Handlers for the scheduler: ``sched.w.sample``, ``sched.w.logprobs``, ``sched.w.stats``."""

    def __init__(self, model: str, cfg: EngineWorkerConfig, backend: Any = None) -> None:
        self.cfg = cfg
        self.backend = backend if backend is not None else make_backend(model, cfg)
        self._lock = threading.Lock()  # residency and backend calls
        # (adapter, version, directory) -> the backend's ref; LRU first. The directory is part of the
        # key: a version reloaded from another checkpoint (load_state) is other weights, same number.
        self._resident: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self._queue: queue.Queue[tuple[EngineSample, Future[Any]] | None] = queue.Queue()
        self.stats = {
            "batches": 0,
            "requests": 0,
            "mixed_adapter_batches": 0,
            "mixed_tenant_batches": 0,
            "adapter_loads": 0,
            "max_batch_requests": 0,
        }
        self._closed = False
        self._thread = threading.Thread(target=self._batch_loop, name="engine-batcher", daemon=True)
        self._thread.start()

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {"sched.w.sample": self.sample, "sched.w.logprobs": self.logprobs, "sched.w.stats": self.get_stats}

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(5.0)
        self.backend.close()

    # --- handlers ------------------------------------------------------------------------------
    def sample(self, msg: EngineSample) -> list[dict[str, Any]]:
        fut: Future[Any] = Future()
        self._queue.put((msg, fut))
        result: list[dict[str, Any]] = fut.result()
        return result

    def logprobs(self, msg: EngineLogprobs) -> list[list[float]]:
        with self._lock:
            ref = self._ensure(msg.adapter, msg.version, msg.adapter_dir)
            out: list[list[float]] = self.backend.compute_logprobs([list(s) for s in msg.sequences], ref)
            return out

    def get_stats(self, _msg: WorkerStats) -> dict[str, Any]:
        return {**self.stats, "resident": [f"{a}@{v}" for a, v, _ in self._resident]}

    # --- batching ------------------------------------------------------------------------------
    def _batch_loop(self) -> None:
        while not self._closed:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            seqs = first[0].num_samples
            deadline = time.monotonic() + self.cfg.batch_window_s
            while seqs < self.cfg.max_batch_size:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self._closed = True
                    break
                batch.append(item)
                seqs += item[0].num_samples
            self._serve(batch)

    def _serve(self, batch: list[tuple[EngineSample, Future[Any]]]) -> None:
        try:
            results = self._run([m for m, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                batch[0][1].set_exception(exc)
                return
            # One bad request (an adapter that will not load) must not fail the others: serve each alone.
            for item in batch:
                self._serve([item])
            return
        for (_, fut), res in zip(batch, results, strict=True):
            fut.set_result(res)

    def _run(self, msgs: list[EngineSample]) -> list[list[dict[str, Any]]]:
        from polytinker.engine.types import SampleRequest

        with self._lock:
            refs = [self._ensure(m.adapter, m.version, m.adapter_dir) for m in msgs]
            requests = [
                SampleRequest(
                    prompt_token_ids=tuple(m.prompt_token_ids), adapter=ref, params=_params(m.params, m.num_samples)
                )
                for m, ref in zip(msgs, refs, strict=True)
            ]
            results = self.backend.sample(requests)
        self._count(msgs)
        return [
            [
                {
                    "tokens": list(s.token_ids),
                    "logprobs": list(s.logprobs),
                    "text": s.text,
                    "stop_reason": str(s.finish_reason),
                }
                for s in r.sequences
            ]
            for r in results
        ]

    def _count(self, msgs: list[EngineSample]) -> None:
        s = self.stats
        s["batches"] += 1
        s["requests"] += len(msgs)
        s["max_batch_requests"] = max(s["max_batch_requests"], len(msgs))
        if len({(m.adapter, m.version) for m in msgs}) > 1:
            s["mixed_adapter_batches"] += 1
        if len({m.tag for m in msgs}) > 1:
            s["mixed_tenant_batches"] += 1

    def _ensure(self, adapter: str, version: int, adapter_dir: str) -> Any:
        """The backend's ref for the version, loaded now if it is not resident (call under the lock)."""
        from polytinker.engine.types import AdapterRef

        if not adapter:
            return None
        key = (adapter, version, adapter_dir)
        ref = self._resident.get(key)
        if ref is not None:
            self._resident.move_to_end(key)
            return ref
        if not adapter_dir or not Path(adapter_dir).is_dir():
            raise ConfigError(f"adapter {adapter}@{version}: no exported weights at {adapter_dir!r}")
        while len(self._resident) >= self.cfg.adapter_slots:
            _, old = self._resident.popitem(last=False)
            self.backend.unload_adapter(old)
        tag = hashlib.sha1(adapter_dir.encode()).hexdigest()[:8]
        ref = AdapterRef(f"{adapter}#{tag}", version)
        self.backend.load_adapter_dir(ref, Path(adapter_dir))
        self._resident[key] = ref
        self.stats["adapter_loads"] += 1
        return ref


__all__ = ["EngineWorker", "make_backend"]
