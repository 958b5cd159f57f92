"""A trained adapter out of polytinker: a peft directory plain peft loads, a merged model stock
transformers (and vLLM) load, with the numbers the runtime computed; only the owner exports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.cli import main as cli_main
from polytinker.errors import AuthError

SEQUENCE = [5, 17, 230, 1400, 9, 77, 3020, 12]


def _logprobs(model: torch.nn.Module) -> list[float]:
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def trained() -> tuple[str, list[float]]:
    """A version one step away from the fresh adapter (so the export is not the identity), and
    what the runtime's engine computes with it."""
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="exporter", seed=1)
        trainer.forward_backward(data(1), "cross_entropy").result()
        trainer.optim_step({"learning_rate": 0.05}).result()
        sampler = trainer.save_weights_and_get_sampling_client("exported")
        scored = sampler.compute_logprobs(SEQUENCE).result()[1:]
    # Leaving the block finishes the job (its versions stay exportable): a live job would hold
    # the shared runtime's learner from the full-parameter job of another module.
    return sampler.model_path, [float(x) for x in scored]


def test_peft_directory_loads_with_plain_peft(trained: tuple[str, list[float]], tmp_path: Path) -> None:
    from peft import PeftModel

    from polytinker.engine.models import load_model

    path, expected = trained
    with client(KEY_ALICE) as service:
        out = service.export_weights(path, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and "/" not in config["base_model_name_or_path"]  # no path of the serving machine
    assert "lm_head" in config["target_modules"]  # Tinker's default: train_unembed=True
    manifest = json.loads((out / "polytinker.json").read_text())
    assert manifest["base_model"] == MODEL and manifest["model_path"] == path and manifest["merged"] is False
    base, _ = load_model(MODEL)
    fresh = _logprobs(base)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    got = _logprobs(model)
    assert got == pytest.approx(expected, abs=2e-4)
    assert max(abs(a - b) for a, b in zip(got, fresh, strict=True)) > 1e-3  # the adapter changed something


def test_merged_model_loads_with_stock_transformers(trained: tuple[str, list[float]], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path, expected = trained
    with client(KEY_ALICE) as service:
        out = service.export_weights(path, tmp_path / "merged", merged=True)
    assert not (out / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert _logprobs(model) == pytest.approx(expected, abs=2e-4)
    # The adapter on the (tied) unembedding was merged into an untied copy: the input embeddings
    # are the base model's still.
    from polytinker.engine.models import load_model

    base, _ = load_model(MODEL)
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert not torch.equal(model.get_output_embeddings().weight, base.get_output_embeddings().weight)


def test_only_the_owner_exports(trained: tuple[str, list[float]], tmp_path: Path) -> None:
    with client(KEY_BOB) as service, pytest.raises(AuthError):
        service.export_weights(trained[0], tmp_path / "stolen")
    assert not (tmp_path / "stolen").exists()


def test_cli_lists_and_exports(
    trained: tuple[str, list[float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--scheduler", shared_runtime().address, "--api-key", KEY_ALICE]
    assert cli_main(["checkpoints", *base, "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    mine = [r for r in rows if r["agent"] == "exporter"]
    assert mine and "sampler-exported" in mine[0]["checkpoints"]
    tinker_path = trained[0].replace("polytinker://", "tinker://").replace("/exporter@", "/sampler_weights/exporter@")
    assert cli_main(["checkpoints", *base, "export", tinker_path, "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "adapter_model.safetensors").is_file()
    assert cli_main(["checkpoints", *base, "export", trained[0], "--out", str(tmp_path / "cli")]) == 1  # exists


def test_a_save_state_checkpoint_downloads_as_a_peft_directory(tmp_path: Path) -> None:
    """``checkpoints download`` of a ``save_state`` checkpoint (its Tinker path here): the
    checkpoint's weights as a peft adapter plain peft loads, scoring as the version saved then;
    another tenant downloads it once it is published, not before."""
    from peft import PeftModel

    from polytinker.engine.models import load_model

    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="state-exporter", seed=2)
        trainer.forward_backward(data(2), "cross_entropy").result()
        trainer.optim_step({"learning_rate": 0.05}).result()
        state = trainer.save_state("exported-state").result().path
        expected = trainer.save_weights_and_get_sampling_client().compute_logprobs(SEQUENCE).result()[1:]
        trainer.forward_backward(data(3), "cross_entropy").result()  # the job moves on; the checkpoint stays
        trainer.optim_step({"learning_rate": 0.05}).result()
        with client(KEY_BOB) as bob, pytest.raises(AuthError):
            bob.export_weights(state, tmp_path / "not-yet")
        service.publish_checkpoint(trainer.job_id, "exported-state")
        with client(KEY_BOB) as bob:
            bob_out = bob.export_weights(state, tmp_path / "bob")
        job_id = trainer.job_id
    tinker_path = f"tinker://{job_id}/weights/exported-state"
    base = ["--scheduler", shared_runtime().address, "--api-key", KEY_ALICE]
    assert cli_main(["checkpoints", *base, "download", tinker_path, "--out", str(tmp_path / "state")]) == 0
    out = tmp_path / "state"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA" and "/" not in config["base_model_name_or_path"]
    assert (out / "adapter_model.safetensors").read_bytes() == (bob_out / "adapter_model.safetensors").read_bytes()
    base_model, _ = load_model(MODEL)
    model = PeftModel.from_pretrained(base_model, str(out)).eval()
    assert _logprobs(model) == pytest.approx(expected, abs=2e-4)


@pytest.mark.vllm
def test_merged_model_loads_with_stock_vllm(trained: tuple[str, list[float]], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with client(KEY_ALICE) as service:
        out = service.export_weights(trained[0], tmp_path / "merged", merged=True)
    script = textwrap.dedent(
        f"""
        import json
        from vllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={str(out)!r}, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 28)
            out = llm.generate([{{"prompt_token_ids": {SEQUENCE!r}}}], SamplingParams(max_tokens=6, temperature=0))
            print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("TOKENS"))[7:])
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        greedy = model.generate(torch.tensor([SEQUENCE]), max_new_tokens=6, do_sample=False)[0, len(SEQUENCE) :]
    assert tokens == greedy.tolist()
