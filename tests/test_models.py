"""Model provisioning: presets built once under a lock and renamed into place, hub ids offline,
local directories, the tiny-random preset, and (slow) the real GGUF conversion."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytinker.cli import main
from polytinker.engine import _model_build
from polytinker.engine.models import (
    DEFAULT_MODEL,
    TINY_RANDOM,
    ModelConfig,
    _ensure_built,
    load_model,
    load_tokenizer,
    resolve_model,
)
from polytinker.errors import ConfigError, ModelError


def _slow_build(out: Path, counter: str) -> None:
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough that the other processes queue on the lock
    (out / "config.json").write_text("{}")


def _worker(cache: str, counter: str) -> str:
    config = ModelConfig(cache_dir=Path(cache))
    return str(_ensure_built("thing", config, lambda out: _slow_build(out, counter)))


def test_concurrent_resolves_build_once(tmp_path: Path) -> None:
    counter = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.starmap(_worker, [(str(tmp_path / "cache"), str(counter))] * 2)
    assert len(set(paths)) == 1 and (Path(paths[0]) / "config.json").is_file()
    assert len(counter.read_text().split()) == 1, "the build ran more than once"
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_failed_build_leaves_no_directory(tmp_path: Path) -> None:
    config = ModelConfig(cache_dir=tmp_path)

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")  # written, then the build fails: must not appear
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _ensure_built("thing", config, broken)
    assert sorted(p.name for p in config.models_dir.iterdir()) == [".thing.lock"]


def test_offline_hub_id_names_cache_and_fetch_command(tmp_path: Path) -> None:
    config = ModelConfig(cache_dir=tmp_path, offline=True)
    with pytest.raises(ModelError) as info:
        resolve_model("someorg/some-model", config)
    message = str(info.value)
    assert str(tmp_path / "hub") in message
    assert "polytinker models fetch someorg/some-model" in message


def test_local_directories_and_unknown_specs(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(ModelError, match=r"no config\.json"):
        resolve_model(str(model_dir))
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("no-such-preset")


def test_model_config_validates() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig(dtype="float16")  # type: ignore[arg-type]
    assert ModelConfig(cache_dir="~/x").cache_dir == Path.home() / "x"  # type: ignore[arg-type]


def test_tiny_random_preset_is_a_real_small_llama() -> None:
    model, tokenizer = load_model(TINY_RANDOM)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer) == 49152
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert head_dim >= 32, "vLLM's CPU attention needs head_dim >= 32"
    rendered = str(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokenizer.encode("hello world")])).logits
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()


def test_tiny_random_weights_are_seeded(tmp_path: Path) -> None:
    tokenizer_dir = resolve_model(TINY_RANDOM)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _model_build.build_tiny_random(tmp_path / name, tokenizer_dir)
    first, second = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_tiny_random_takes_peft_lora_on_every_projection() -> None:
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(TINY_RANDOM)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    # names end in <module>.lora_A.default.weight
    trainable = {n.split(".")[-4] for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable == set(targets)


def test_cli_list_and_path(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["models", "--cache-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert DEFAULT_MODEL in out and TINY_RANDOM in out and "not built" in out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["models", "--cache-dir", str(tmp_path), "path", "someorg/x"]) == 1
    assert "polytinker models fetch someorg/x" in capsys.readouterr().err


@pytest.mark.slow
def test_gguf_conversion_runs_once(tmp_path: Path) -> None:
    config = ModelConfig(cache_dir=tmp_path)
    path = resolve_model(DEFAULT_MODEL, config)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert "quantization_config" not in (path / "config.json").read_text()
    start = time.monotonic()
    assert resolve_model(DEFAULT_MODEL, config) == path
    assert time.monotonic() - start < 1.0, "a second resolve must not convert again"
    tokenizer = load_tokenizer(DEFAULT_MODEL, config)
    assert tokenizer.chat_template, "the chat template must survive the conversion"
    assert sum(p.name.startswith(".") and ".tmp-" in p.name for p in config.models_dir.iterdir()) == 0


def test_plain_tokenizer_loads_without_torch_and_matches_auto_tokenizer() -> None:
    """Client processes render prompts with this tokenizer: it must not pull in torch, and it must
    tokenize and render chats exactly as AutoTokenizer does."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    code = (
        "import sys; from polytinker.engine.models import load_tokenizer; load_tokenizer('tiny-random');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    light, auto = load_tokenizer(TINY_RANDOM), AutoTokenizer.from_pretrained(str(resolve_model(TINY_RANDOM)))
    chat = [
        {"role": "system", "content": "You play a game."},
        {"role": "user", "content": "Pick a number from 1 to 10, é 東京."},
        {"role": "assistant", "content": " 7"},
        {"role": "user", "content": "Again."},
    ]
    for generation_prompt in (True, False):
        assert light.apply_chat_template(chat, add_generation_prompt=generation_prompt) == auto.apply_chat_template(
            chat, add_generation_prompt=generation_prompt
        )
    for text in ("hello world", " 7", "<|im_end|>x", ""):
        assert light.encode(text) == auto.encode(text)
    assert (light.eos_token_id, light.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
