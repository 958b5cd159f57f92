"""Checkpoints a Tinker user keeps and throws away, through the official ``tinker`` SDK against a
real ``polytinker serve --http``: ``save_weights_external`` and its signed download URLs (a peft
adapter directory that plain ``peft`` loads and that scores as the sampler does), and
``RestClient.delete_checkpoint*`` for each kind of checkpoint, files included, and checkpoint
TTLs (shown in the listing, changed, run out)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _serve import KEY, KEY_BOB, MODEL, Serve

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("tinker-checkpoints"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trained(serve: Serve) -> tuple[tinker.ServiceClient, tinker.TrainingClient, list[int]]:
    """A LoRA run one step away from the base model, and a prompt to score with it."""
    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    tokenizer = tc.get_tokenizer()
    tokens = tokenizer.encode("The password is swordfish")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return service, tc, tokens


def _state_files(serve: Serve) -> list[Path]:
    return sorted(p for p in (serve.root / "state").rglob("*") if p.is_file())


def test_external_weights_download_as_a_peft_adapter_that_scores_as_the_sampler(serve: Serve, trained) -> None:
    _, tc, tokens = trained
    saved = tc.save_weights_external("final").result()
    assert saved.path.endswith("/external_weights/final")
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    kinds = {c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert "external" in kinds

    signed = rest.get_external_weights_urls(saved.path).result()
    assert set(signed.urls) == {"adapter_config.json", "adapter_model.safetensors", "polytinker.json"}
    out = serve.root / "download"
    out.mkdir()
    for name, url in signed.urls.items():  # no key: a signed URL is its own permission
        with urllib.request.urlopen(url, timeout=60) as r:
            (out / name).write_bytes(r.read())
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["r"] == 4

    import torch
    from peft import PeftModel

    from polytinker.engine.models import load_model

    base, _ = load_model(MODEL)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    sampler = tc.save_weights_and_get_sampling_client().result()
    theirs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    assert ours == pytest.approx(theirs, abs=2e-3)

    token_url = next(iter(signed.urls.values()))
    forged = token_url.replace("/downloads/", "/downloads/x")
    assert httpx.get(forged, timeout=30).status_code == 404
    bob = tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(saved.path).result()
    with pytest.raises(tinker.BadRequestError, match="age recipient"):
        tc.save_weights_external("secret", age_encryption_recipients=["age1xyz"]).result()


def test_external_weights_encrypted_to_an_age_key(serve: Serve, trained) -> None:
    import pyrage

    _, tc, _ = trained
    identity = pyrage.x25519.Identity.generate()
    saved = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result()
    signed = tinker.RestClient(base_url=serve.url, api_key=KEY).get_external_weights_urls(saved.path).result()
    assert set(signed.urls) == {"adapter_config.json.age", "adapter_model.safetensors.age", "polytinker.json.age"}
    sealed = httpx.get(signed.urls["adapter_config.json.age"], timeout=30).content
    assert b"lora" not in sealed
    config = json.loads(pyrage.decrypt(sealed, [identity]))
    assert config["r"] == 4 and config["peft_type"] == "LORA"


def test_deleting_each_kind_of_checkpoint_forgets_it_and_its_files(serve: Serve, trained) -> None:
    service, tc, tokens = trained
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    state = tc.save_state("to-delete").result().path
    sampler = tc.save_weights_for_sampler("to-delete").result().path
    external = tc.save_weights_external("to-delete").result().path
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, sampler, external} <= listed
    state_dir = next(p for p in _state_files(serve) if "named/to-delete" in str(p)).parent

    bob = tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
    with pytest.raises(tinker.NotFoundError):  # another tenant's checkpoint: as if it did not exist
        bob.delete_checkpoint_from_tinker_path(state).result()
    assert state_dir.exists()

    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not state_dir.exists()
    with pytest.raises(Exception, match="no checkpoint"):
        service.create_training_client_from_state(state).result()
    rest.delete_checkpoint_from_tinker_path(external).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(external).result()
    rest.delete_checkpoint(tc.model_id, sampler.split("/", 3)[3]).result()
    left = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert not {state, sampler, external} & left
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(state).result()
    # The version stays sampleable while it is among the run's last kept versions.
    scored = tc.create_sampling_client(sampler).result().compute_logprobs(types.ModelInput.from_ints(tokens))
    assert len(scored.result()) == len(tokens)


def test_checkpoint_ttls_show_in_the_listing_and_run_out(serve: Serve, trained) -> None:
    _, tc, _ = trained
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    week = tc.save_state("for-a-week", ttl_seconds=7 * 86400).result().path
    brief = tc.save_weights_for_sampler("brief").result().path

    def listed() -> dict[str, object]:
        return {c.tinker_path: c.expires_at for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    expires = listed()[week]
    assert expires is not None and 6.9 * 86400 < expires.timestamp() - time.time() < 7 * 86400
    rest.set_checkpoint_ttl_from_tinker_path(week, None).result()
    assert listed()[week] is None
    rest.set_checkpoint_ttl_from_tinker_path(brief, 1).result()  # polytinker takes TTLs under Tinker's hour
    deadline = time.monotonic() + 30
    while brief in listed():
        assert time.monotonic() < deadline
        time.sleep(0.5)
    with pytest.raises(tinker.NotFoundError):
        rest.set_checkpoint_ttl_from_tinker_path(brief, 3600).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(week, -1).result()
