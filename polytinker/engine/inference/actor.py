"""The inference engine as a process actor, and a typed client for it.

``EngineActor`` runs an :class:`InferenceEngine` over the ``hf`` or ``vllm`` backend in its own
process.
Its ``sample`` and ``compute_logprobs`` handlers are concurrent, so asks from many callers reach
the engine together and its dynamic batching merges them into mixed batches. Adapter tensors
travel as out-of-band frames of the transport codec (never pickled).

On the wire, requests and results are plain dicts (msgpack has no dataclasses of ours); the
functions here turn them into the engine's types at the edge and reject malformed ones with
``ProtocolError``. ``EngineClient`` wraps an ``ActorRef`` with typed methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polytinker.actors import Actor, ActorRef, handler
from polytinker.engine.models import DEFAULT_MODEL, ModelConfig
from polytinker.engine.types import (
    AdapterRef,
    AdapterWeights,
    FinishReason,
    LoraConfig,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
)
from polytinker.errors import ConfigError, PolytinkerError, ProtocolError

# ----- wire forms -----


def ref_to_wire(ref: AdapterRef | None) -> dict[str, Any] | None:
    return None if ref is None else {"name": ref.name, "version": ref.version}


def ref_from_wire(raw: Any) -> AdapterRef | None:
    if raw is None:
        return None
    return AdapterRef(str(raw["name"]), int(raw["version"]))


def request_to_wire(request: SampleRequest) -> dict[str, Any]:
    p = request.params
    return {
        "prompt_token_ids": None if request.prompt_token_ids is None else list(request.prompt_token_ids),
        "messages": None if request.messages is None else [dict(m) for m in request.messages],
        "adapter": ref_to_wire(request.adapter),
        "params": {
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "stop": list(p.stop),
            "stop_token_ids": list(p.stop_token_ids),
            "seed": p.seed,
            "n": p.n,
            "ignore_eos": p.ignore_eos,
        },
    }


def request_from_wire(raw: Any) -> SampleRequest:
    params = dict(raw["params"])
    params["stop"] = tuple(params.get("stop", ()))
    params["stop_token_ids"] = tuple(params.get("stop_token_ids", ()))
    ids, messages = raw.get("prompt_token_ids"), raw.get("messages")
    return SampleRequest(
        prompt_token_ids=None if ids is None else tuple(int(t) for t in ids),
        messages=None if messages is None else tuple({str(k): str(v) for k, v in m.items()} for m in messages),
        adapter=ref_from_wire(raw.get("adapter")),
        params=SamplingParams(**params),
    )


def result_to_wire(result: SampleResult) -> dict[str, Any]:
    return {
        "prompt_token_ids": list(result.prompt_token_ids),
        "adapter": ref_to_wire(result.adapter),
        "sequences": [
            {
                "token_ids": list(s.token_ids),
                "text": s.text,
                "logprobs": list(s.logprobs),
                "finish_reason": s.finish_reason.value,
            }
            for s in result.sequences
        ],
    }


def result_from_wire(raw: Any) -> SampleResult:
    return SampleResult(
        prompt_token_ids=tuple(raw["prompt_token_ids"]),
        adapter=ref_from_wire(raw["adapter"]),
        sequences=tuple(
            SampledSequence(
                token_ids=tuple(s["token_ids"]),
                text=s["text"],
                logprobs=tuple(s["logprobs"]),
                finish_reason=FinishReason(s["finish_reason"]),
            )
            for s in raw["sequences"]
        ),
    )


def _decode(kind: str, fn: Any, raw: Any) -> Any:
    try:
        return fn(raw)
    except PolytinkerError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"malformed {kind} payload: {type(exc).__name__}: {exc}") from exc


# ----- the actor -----


class EngineActor(Actor):
    """One base model and its adapters behind a mailbox. Constructor arguments are plain data."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        backend: str = "hf",
        cache_dir: str | None = None,
        num_threads: int | None = None,
        batch_window_s: float = 0.01,
        max_batch_size: int = 64,
        max_resident_adapters: int = 8,
    ) -> None:
        if backend not in ("hf", "vllm"):
            raise ConfigError(f"EngineActor backend must be 'hf' or 'vllm', got {backend!r}")
        self._backend_kind = backend
        self._settings = (model, cache_dir, num_threads, batch_window_s, max_batch_size, max_resident_adapters)
        self.engine: Any = None

    def on_start(self) -> None:
        from polytinker.engine.inference.config import EngineConfig, HFBackendConfig
        from polytinker.engine.inference.engine import InferenceEngine
        from polytinker.engine.inference.hf import HFBackend

        model, cache_dir, threads, window_s, batch, slots = self._settings
        model_config = ModelConfig(cache_dir=Path(cache_dir)) if cache_dir else ModelConfig()
        backend: Any
        if self._backend_kind == "vllm":
            from polytinker.engine.inference._vllm_config import VllmBackendConfig
            from polytinker.engine.inference.vllm_backend import VllmBackend

            # vLLM batches at most max_loras adapters at once: the engine's slots match it.
            backend = VllmBackend(VllmBackendConfig(model=model, model_config=model_config, max_loras=slots))
        else:
            backend = HFBackend(HFBackendConfig(model=model, model_config=model_config, num_threads=threads))
        config = EngineConfig(batch_window_s=window_s, max_batch_size=batch, max_resident_adapters=slots)
        self.engine = InferenceEngine(backend, config)
        self.log.info("engine ready", extra={"model": model, "backend": self._backend_kind})

    def on_stop(self) -> None:
        if self.engine is not None:
            self.engine.close()

    @handler("sample", concurrent=True)
    def sample(self, payload: Any) -> list[dict[str, Any]]:
        requests = [_decode("sample", request_from_wire, r) for r in payload["requests"]]
        futures = [self.engine.submit(r) for r in requests]  # submitted together: batched together
        return [result_to_wire(f.result()) for f in futures]

    @handler("compute_logprobs", concurrent=True)
    def compute_logprobs(self, payload: Any) -> list[list[float]]:
        adapter = _decode("compute_logprobs", ref_from_wire, payload.get("adapter"))
        sequences = [[int(t) for t in s] for s in payload["sequences"]]
        result: list[list[float]] = self.engine.compute_logprobs(sequences, adapter)
        return result

    @handler("load_adapter")
    def load_adapter(self, payload: Any) -> None:
        ref = _decode("load_adapter", ref_from_wire, payload["ref"])
        assert ref is not None
        raw = payload["config"]
        config = LoraConfig(
            rank=int(raw["rank"]),
            alpha=int(raw["alpha"]),
            target_modules=tuple(raw["target_modules"]),
            dropout=float(raw.get("dropout", 0.0)),
        )
        # Received tensors share the message's buffer: the backend copies them into its slot.
        self.engine.load_adapter(AdapterWeights(ref, config, dict(payload["tensors"])), pin=bool(payload.get("pin")))

    @handler("load_adapter_dir")
    def load_adapter_dir(self, payload: Any) -> None:
        ref = _decode("load_adapter_dir", ref_from_wire, payload["ref"])
        assert ref is not None
        self.engine.load_adapter_dir(ref, Path(payload["path"]), pin=bool(payload.get("pin")))

    @handler("unload_adapter")
    def unload_adapter(self, payload: Any) -> None:
        ref = _decode("unload_adapter", ref_from_wire, payload["ref"])
        assert ref is not None
        self.engine.unload_adapter(ref)

    @handler("stats", concurrent=True)
    def stats(self, payload: Any = None) -> dict[str, Any]:
        s = self.engine.stats
        return {
            "requests": s.requests,
            "batch_sizes": list(s.batch_sizes),
            "resident": len(self.engine.slots.resident()),
        }


class EngineClient:
    """Typed calls to an :class:`EngineActor` through its ``ActorRef``."""

    def __init__(self, ref: ActorRef) -> None:
        self.ref = ref

    def sample(self, requests: list[SampleRequest], timeout_s: float | None = None) -> list[SampleResult]:
        raw = self.ref.ask("sample", {"requests": [request_to_wire(r) for r in requests]}, timeout_s=timeout_s)
        return [result_from_wire(r) for r in raw]

    def compute_logprobs(
        self, sequences: list[list[int]], adapter: AdapterRef | None = None, timeout_s: float | None = None
    ) -> list[list[float]]:
        payload = {"sequences": [list(s) for s in sequences], "adapter": ref_to_wire(adapter)}
        result: list[list[float]] = self.ref.ask("compute_logprobs", payload, timeout_s=timeout_s)
        return result

    def load_adapter(self, weights: AdapterWeights, *, pin: bool = False) -> None:
        c = weights.config
        config = {"rank": c.rank, "alpha": c.alpha, "target_modules": list(c.target_modules), "dropout": c.dropout}
        payload = {"ref": ref_to_wire(weights.ref), "config": config, "tensors": weights.tensors, "pin": pin}
        self.ref.ask("load_adapter", payload)

    def load_adapter_dir(self, ref: AdapterRef, path: Path, *, pin: bool = False) -> None:
        self.ref.ask("load_adapter_dir", {"ref": ref_to_wire(ref), "path": str(path), "pin": pin})

    def unload_adapter(self, ref: AdapterRef) -> None:
        self.ref.ask("unload_adapter", {"ref": ref_to_wire(ref)})

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.ref.ask("stats")
        return result


__all__ = ["EngineActor", "EngineClient", "request_from_wire", "request_to_wire", "result_from_wire", "result_to_wire"]
