"""The engine worker: one ``InferenceEngine`` (dynamic batching over a backend) behind the scheduler.

Sample requests from every job and tenant go into the engine's queue and are served in mixed
batches: each request names its own adapter version, so requests of different jobs share the base
model's matmuls. The message's tag (the tenant) is the engine's tenant: batches take turns across
tenants, and a request of many samples runs in chunks (engine.py). Sizes in a message are bounded
here and checked against the model by the engine, never trusted.

Adapter versions are registered from the peft directory the scheduler names by ids
(``WeightsRef``: the path is made under this worker's state root, never taken from a message) and
made resident by the engine when a batch needs them (least recently used evicted beyond
``adapter_slots``). ``stats`` counts batches, those that mixed adapters, and those that failed,
and the sequences answered.

A full-parameter job's version (``full`` in the request) is a whole model: it is served by an
engine of its own, built from the version's checkpoint (``FullWeightEngines``, at most
``full_weight_slots`` resident).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polytinker.engine.device import resolve_device, resolve_dtype
from polytinker.engine.inference._resends import Resends
from polytinker.engine.inference.config import EngineConfig, HFBackendConfig
from polytinker.engine.inference.engine import InferenceEngine
from polytinker.engine.inference.full_weights import FullWeightEngines
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.inference.vllm_backend import VllmBackend
from polytinker.engine.models import ModelConfig
from polytinker.engine.types import MAX_SAMPLES, AdapterRef, SampleRequest, SamplingParams
from polytinker.engine.worker.config import EngineWorkerConfig
from polytinker.engine.worker.layout import under
from polytinker.engine.worker.messages import (
    EngineHasWeights,
    EngineLogprobs,
    EnginePutAdapter,
    EngineSample,
    WeightsRef,
    WorkerStats,
)
from polytinker.engine.worker.replies import LogprobsReply, SampleReply, SequenceReply
from polytinker.errors import ConfigError, NotResident
from polytinker.transport.requests import handler_table

log = logging.getLogger("polytinker.engine.inference.worker")


def make_backend(model: str, cfg: EngineWorkerConfig) -> Any:
    if cfg.backend == "vllm":
        return VllmBackend(cfg.vllm_config(model))

    device = resolve_device(cfg.device)  # ConfigError before the model loads
    dtype = resolve_dtype(cfg.dtype, device)
    return HFBackend(HFBackendConfig(model=model, model_config=ModelConfig(dtype=dtype), device=str(device)))


def _params(msg: EngineSample) -> SamplingParams:
    """The request's sampling parameters, once the message's sizes are checked: nothing in a
    message is trusted, and a bad one is refused before its adapter is loaded. ``SamplingParams``
    checked its own fields when it was built (``max_tokens`` among them), and the backend clips
    ``max_tokens`` to the room the prompt leaves; the engine refuses a prompt the model cannot read."""
    n = msg.num_samples
    # As many as the scheduler's Sample allows. The engine splits them into batches of its
    # max_batch_size, so the bound caps one request's queue entries.
    if type(n) is not int or not 0 < n <= MAX_SAMPLES:
        raise ConfigError(f"EngineSample.num_samples must be in 1..{MAX_SAMPLES}, got {n!r}")
    if not msg.prompt_token_ids:
        raise ConfigError("EngineSample.prompt_token_ids: the prompt is empty; give at least one token")
    if not isinstance(msg.params, SamplingParams):
        raise ConfigError("EngineSample.params must be sampling parameters")
    return msg.params


class EngineWorker:
    """Handlers for the scheduler: ``sched.w.sample``, ``sched.w.logprobs``, ``sched.w.stats``."""

    def __init__(self, model: str, cfg: EngineWorkerConfig, root: str | os.PathLike[str], backend: Any = None) -> None:
        self.cfg = cfg
        self.root = Path(root)  # the weights this worker loads are under it (the learners write there)
        engine_cfg = EngineConfig(
            batch_window_s=cfg.batch_window_s,
            max_batch_size=cfg.max_batch_size,
            max_resident_adapters=cfg.adapter_slots,
        )
        self.engine = InferenceEngine(backend if backend is not None else make_backend(model, cfg), engine_cfg)
        self.full = FullWeightEngines(model, cfg.full_weight_slots, engine_cfg)
        # The weights each version was registered from: a version reloaded from another checkpoint
        # (load_state) keeps its number but not its weights, so other weights re-register it.
        self._dirs: dict[Any, WeightsRef] = {}
        self._lock = threading.Lock()
        self._pushed = 0  # versions received as tensors (put_adapter)
        self.resends = Resends()  # sample calls by request key, for their resends

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return handler_table(
            {
                EngineSample: self.sample,
                EngineLogprobs: self.logprobs,
                EngineHasWeights: self.has_weights,
                EnginePutAdapter: self.put_adapter,
                WorkerStats: self.get_stats,
            }
        )

    def close(self) -> None:
        self.full.close()
        self.engine.close()

    @contextlib.contextmanager
    def _target(self, adapter: str, version: int, weights: WeightsRef | None, full: bool) -> Iterator[tuple[Any, Any]]:
        """(engine, adapter ref) that serve a request: the shared engine with the LoRA version (None:
        the base model), or the engine of a full-parameter version with no adapter."""
        if not full:
            yield self.engine, self._ref(adapter, version, weights)
            return
        with self.full.use(adapter, version, str(self._path(adapter, weights))) as engine:
            yield engine, None

    def _path(self, adapter: str, weights: WeightsRef | None, full: bool = True) -> Path:
        if weights is None or weights.adapter.split("/")[0] != adapter.split("/")[0]:
            # The scheduler resolves a version to its own tenant's weights: another tenant's is a bug.
            raise ConfigError(f"adapter {adapter}: no stored weights named for it")
        path = under(self.root, weights.relative_path)
        if not path.is_dir() and not full:  # not on this machine: the scheduler sends the tensors, then resends
            raise NotResident(f"adapter {adapter} v{weights.version}: not here; send its tensors (sched.w.put_adapter)")
        if not path.is_dir():
            raise ConfigError(f"adapter {adapter} v{weights.version}: no stored weights {weights.relative_path!r}")
        return path

    def _ref(self, adapter: str, version: int, weights: WeightsRef | None) -> Any:
        """The engine's ref for the version, registered (loaded lazily by the engine) if it is new."""
        if not adapter:
            return None
        ref = AdapterRef(adapter, version)
        with self._lock:
            if weights is not None and self._dirs.get(ref) == weights and ref in self.engine.slots.known():
                return ref
            path = self._path(adapter, weights, full=False)
            assert weights is not None  # _path refuses None
            self.engine.load_adapter_dir(ref, path)
            self._dirs[ref] = weights
        return ref

    def has_weights(self, msg: EngineHasWeights) -> bool:
        """Whether a request naming this export can be served without its tensors being sent."""
        w = msg.weights
        with self._lock:
            if self._dirs.get(AdapterRef(w.adapter, w.version)) == w:
                return True
        return under(self.root, w.relative_path).is_dir()

    def put_adapter(self, msg: EnginePutAdapter) -> bool:
        """A version's tensors, sent over the transport: registered in the engine's host cache
        (loaded into a slot when a request needs it), as if read from the export they name."""
        w = msg.weights
        # Kept as received (the message's frame, one flat buffer) in the host cache: nothing
        # writes it, the frame lives as long as the tensor does, and a slot copies it.
        self.register_weights(w, msg.adapter.weights(AdapterRef(w.adapter, w.version)))
        with self._lock:
            self._pushed += 1
        return True

    def register_weights(self, w: WeightsRef, weights: Any) -> None:
        """Register a version's tensors (``AdapterWeights`` of ``w``'s version) as the weights
        ``w`` names: a request naming ``w`` is served from them, with nothing read or sent. A
        colocated learner hands each new version over this way."""
        with self._lock:
            self.engine.load_adapter(weights)
            self._dirs[weights.ref] = w

    def sample(self, msg: EngineSample) -> SampleReply:
        params = _params(msg)
        with self._target(msg.adapter, msg.version, msg.weights, msg.full) as (engine, ref):
            request = SampleRequest(
                prompt_token_ids=tuple(msg.prompt_token_ids), adapter=ref, params=params, num_samples=msg.num_samples
            )
            # The tenant (the message's tag) takes turns with the others in the engine's batches; a
            # resend of a call this engine still runs (its scheduler restarted) joins that run.
            key = (msg.tag, msg.request_key) if msg.request_key else None
            result = self.resends.run(key, request, lambda: engine.submit(request, tenant=msg.tag)).result()
        return SampleReply(
            [SequenceReply(list(s.token_ids), list(s.logprobs), str(s.finish_reason), s.text) for s in result.sequences]
        )

    def logprobs(self, msg: EngineLogprobs) -> LogprobsReply:
        with self._target(msg.adapter, msg.version, msg.weights, msg.full) as (engine, ref):
            out, top = engine.compute_logprobs_topk([list(s) for s in msg.sequences], msg.top_k, ref, tenant=msg.tag)
        return LogprobsReply(out, top if msg.top_k else None)

    def get_stats(self, _msg: WorkerStats) -> dict[str, Any]:
        st = self.engine.stats
        return {
            "batches": len(st.batch_sizes),  # batches started and groups that joined one in progress
            "adapters_received": self._pushed,
            "requests": st.requests,
            "sequences": st.sequences,  # sequences answered, every tenant's (each chunk as it ends)
            "decode_steps": st.steps,
            "failed_batches": st.failed_batches,
            "max_batch_sequences": st.peak_rows,
            "mixed_adapter_batches": sum(1 for n in st.batch_adapters if n > 1),
            "adapter_loads": self.engine.slots.loads,
            "resends_joined": self.resends.joined,  # resent samples answered by the first send's run
            "resident": [str(r) for r in self.engine.slots.resident()],
            "full_weight_loads": self.full.loads,
            "full_weight_resident": self.full.resident(),
        }


__all__ = ["EngineWorker", "make_backend"]
