"""The served base model by every name users have: its preset name and the hub id it stands for
(the name exported adapters write), at the gateway's door and the scheduler's; and its tokenizer
placed in the Hugging Face hub cache under that hub id, so ``from_pretrained(hub_id)`` loads
offline on the serving machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polytinker.engine.models import DEFAULT_MODEL, TINY_RANDOM, hub_id, model_names, resolve_model, served_name
from polytinker.errors import ConfigError
from polytinker.gateway.checks import served_base_model
from polytinker.gateway.hub_tokenizer import place_tokenizer, tokenizer_id

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent


def test_a_preset_answers_to_its_hub_id_and_nothing_else(tmp_path: Path) -> None:
    assert model_names(DEFAULT_MODEL) == (DEFAULT_MODEL, HUB)
    assert model_names(TINY_RANDOM) == (TINY_RANDOM,)  # random weights: no hub model is it
    assert model_names(HUB) == (HUB,) and hub_id(HUB) == HUB
    assert hub_id(str(tmp_path)) == "" and hub_id(TINY_RANDOM) == ""
    assert (
        served_name(DEFAULT_MODEL, HUB) == DEFAULT_MODEL and served_name(DEFAULT_MODEL, DEFAULT_MODEL) == DEFAULT_MODEL
    )
    assert served_name(DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-360M-Instruct") is None
    assert served_name(TINY_RANDOM, HUB) is None


def test_the_gateway_takes_either_name_and_goes_on_with_the_runtimes() -> None:
    assert served_base_model((DEFAULT_MODEL,), HUB) == DEFAULT_MODEL
    assert served_base_model((DEFAULT_MODEL,), DEFAULT_MODEL) == DEFAULT_MODEL
    with pytest.raises(ConfigError, match="'Qwen/Qwen3-8B' is not served here"):
        served_base_model((DEFAULT_MODEL,), "Qwen/Qwen3-8B")
    with pytest.raises(ConfigError, match="'HuggingFaceTB/SmolLM2-135M-Instruct' is not served here"):
        served_base_model((TINY_RANDOM,), HUB)
    with pytest.raises(ConfigError, match="base_model must be named"):
        served_base_model((DEFAULT_MODEL,), 7)


def _snapshot_files(cache: Path) -> dict[str, bytes]:
    repo = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    rev = (repo / "refs" / "main").read_text()
    return {p.name: p.read_bytes() for p in (repo / "snapshots" / rev).iterdir()}


def test_the_tokenizer_is_placed_in_the_hub_cache_layout_once(tmp_path: Path) -> None:
    from huggingface_hub import try_to_load_from_cache

    model_dir = resolve_model(TINY_RANDOM)  # the real SmolLM2 tokenizer files, and a config.json
    cache = tmp_path / "hub"
    assert place_tokenizer(HUB, model_dir, cache)
    files = _snapshot_files(cache)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= files.keys()
    assert "model.safetensors" not in files  # no weights: only what AutoTokenizer reads
    assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    found = try_to_load_from_cache(HUB, "tokenizer.json", cache_dir=str(cache))
    assert isinstance(found, str) and Path(found).read_bytes() == files["tokenizer.json"]
    ref = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" / "main"
    before = ref.stat().st_mtime_ns
    assert place_tokenizer(HUB, model_dir, cache) and ref.stat().st_mtime_ns == before  # there already: untouched


def test_a_cache_holding_another_snapshot_is_left_alone(tmp_path: Path) -> None:
    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)  # a partial download of the hub's own, say
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    assert not place_tokenizer(HUB, resolve_model(TINY_RANDOM), tmp_path)
    assert (repo / "refs" / "main").read_text() == "a" * 40 and not any((repo / "snapshots" / ("a" * 40)).iterdir())


def test_get_info_names_a_model_without_a_hub_id_by_its_directory() -> None:
    assert tokenizer_id(TINY_RANDOM) == str(resolve_model(TINY_RANDOM))


@pytest.mark.slow
def test_the_placed_tokenizer_loads_offline_under_its_hub_id_in_the_cookbooks_environment(tmp_path: Path) -> None:
    """The default model's tokenizer, placed as ``serve`` places it (conftest points the hub cache at
    a directory of the run's own), loads with ``HF_HUB_OFFLINE=1`` by the hub id alone, in the
    cookbook's environment and its transformers, and tokenizes as the model's directory does."""
    cookbook_python = ROOT / ".venv-cookbook" / "bin" / "python"
    if not cookbook_python.exists():
        pytest.skip("no .venv-cookbook: `make cookbook-venv` builds it")
    cache = tmp_path / "hub"
    model_dir = resolve_model(DEFAULT_MODEL)
    assert place_tokenizer(HUB, model_dir, cache)
    code = (
        "import sys; from transformers import AutoTokenizer; "
        "a = AutoTokenizer.from_pretrained(sys.argv[1]); b = AutoTokenizer.from_pretrained(sys.argv[2]); "
        "text = 'Hello, world: the secret word is zebra.'; "
        "m = [{'role': 'user', 'content': 'hi'}]; "
        "assert a.encode(text) == b.encode(text) and a.eos_token == b.eos_token; "
        "assert a.apply_chat_template(m, tokenize=False) == b.apply_chat_template(m, tokenize=False); "
        "print('OK', a.encode(text))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(cookbook_python), "-c", code, HUB, str(model_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stderr[-3000:]
    shutil.rmtree(cache)  # and with the cache gone, the hub id does not load offline: the placement did it
    proc = subprocess.run(
        [str(cookbook_python), "-c", code, HUB, str(model_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
