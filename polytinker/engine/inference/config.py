"""Settings of the inference engine and of the ``hf`` backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from polytinker.engine.device import check_device
from polytinker.engine.models import DEFAULT_MODEL, ModelConfig
from polytinker.errors import ConfigError


@dataclass(frozen=True)
class HFBackendConfig:
    """The transformers + peft backend."""

    model: str = DEFAULT_MODEL
    # A preset, local directory or hub id, as accepted by polytinker.engine.models.resolve_model.
    model_config: ModelConfig = field(default_factory=ModelConfig)
    # Cache location and dtype (float32 is the default: fastest and exact on a CPU).
    num_threads: int | None = None
    # torch intra-op threads; None leaves torch's setting alone (set it where cores are shared).
    logprobs_chunk_tokens: int = 2048
    # compute_logprobs materialises vocab-sized logits for this many tokens at a time
    # (2048 x 49152 floats = 400 MB); lower it to save memory.
    device: str = "cpu"
    # Where the model runs: cpu, cuda, cuda:N or auto (polytinker.engine.device). Sampling's
    # per-row generators stay on the CPU: each step brings one row of logits per sequence back.

    def __post_init__(self) -> None:
        check_device("HFBackendConfig.device", self.device)
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError(f"HFBackendConfig.num_threads must be positive or None, got {self.num_threads}")
        if self.logprobs_chunk_tokens <= 0:
            raise ConfigError(
                f"HFBackendConfig.logprobs_chunk_tokens must be positive (try 2048), got {self.logprobs_chunk_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Dynamic batching and adapter residency of an :class:`InferenceEngine`."""

    batch_window_s: float = 0.01
    # After the first request of a batch arrives, wait this long for others to join it.
    max_batch_size: int = 64
    # Most sequences (requests x n) in one batch; more wait for the next batch. A request of more
    # samples runs as chunks of at most this many, taking turns with other tenants' work.
    max_resident_adapters: int = 8
    # Adapter versions resident in the backend at once; the least recently used unpinned one
    # with no request in flight is evicted to make room (its tensors stay in host memory).
    max_queue: int = 4096
    # Requests (each chunk of a split one counting) and jobs waiting at most; submit() beyond this
    # fails fast instead of growing without bound.

    def __post_init__(self) -> None:
        if self.batch_window_s < 0:
            raise ConfigError(f"EngineConfig.batch_window_s must be >= 0 seconds, got {self.batch_window_s}")
        if self.max_batch_size <= 0:
            raise ConfigError(f"EngineConfig.max_batch_size must be positive, got {self.max_batch_size}")
        if self.max_resident_adapters <= 0:
            raise ConfigError(f"EngineConfig.max_resident_adapters must be positive, got {self.max_resident_adapters}")
        if self.max_queue <= 0:
            raise ConfigError(f"EngineConfig.max_queue must be positive, got {self.max_queue}")


__all__ = ["EngineConfig", "HFBackendConfig"]
