"""The official ``tinker`` SDK, unmodified, against a real ``polytinker serve --http`` with the
default model: training loops, sampling, checkpoints (saved, downloaded through signed URLs as a
peft adapter that plain ``peft`` loads, age-encrypted, deleted, expiring), futures, errors, and
paths that outlive a restart of the service. The SDK is configured only by its base URL and API
key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
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
    with Serve(tmp_path_factory.mktemp("tinker-serve")) as s:
        yield s


@pytest.fixture(scope="module")
def service(serve: Serve) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    yield sc
    sc.close("success").result()  # ends the session (and its heartbeats) while the server is up


def _sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_capabilities_list_the_served_model(serve: Serve) -> None:
    caps = tinker.RestClient(base_url=serve.url, api_key=KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [MODEL]


def test_supervised_loop_loss_falls_and_sampling_follows(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    tokenizer = tc.get_tokenizer()
    data = [_sft_datum(tokenizer, "Q: What is the secret word?\nA:", " zebra")]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy")  # both in flight: the SDK orders them
        step = tc.optim_step(types.AdamParams(learning_rate=5e-3, grad_clip_norm=10.0))
        out = fb.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(data[0].model_input.to_ints())
        assert step.result().metrics is not None
    assert losses[-1] < 0.5 * losses[0], losses

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("Q: What is the secret word?\nA:"))
    newline = tokenizer.encode("\n")[-1]
    # Tinker's defaults (top_k=-1, max_tokens=None) and a stop token id.
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[newline])
    result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2
    assert "zebra" in tokenizer.decode(result.sequences[0].tokens)
    assert len(result.sequences[0].logprobs) == len(result.sequences[0].tokens)
    assert result.sequences[0].stop_reason in ("stop", "length")
    scored = sampler.compute_logprobs(prompt).result()
    assert scored[0] is None and len(scored) == len(prompt.to_ints())
    defaults = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result()
    assert 0 < len(defaults.sequences[0].tokens) <= 4


@pytest.mark.filterwarnings("ignore::FutureWarning")  # Tinker deprecates these _async forms; code still uses them
def test_async_calls_return_futures_to_await_again(service: tinker.ServiceClient) -> None:
    async def run() -> tuple[float, object]:
        tc = await service.create_lora_training_client_async(base_model=MODEL, rank=4)
        tokenizer = tc.get_tokenizer()
        data = [_sft_datum(tokenizer, "Hello", " world")]
        fb_future = await tc.forward_backward_async(data, "cross_entropy")  # the submission
        step_future = await tc.optim_step_async(types.AdamParams(learning_rate=1e-3))
        fb = await fb_future  # the result
        step = await step_future
        return fb.metrics["loss:sum"], step

    loss, step = asyncio.run(run())
    assert loss > 0 and isinstance(step, types.OptimStepResponse)


def test_rl_losses_without_weights_train_only_where_advantages_are(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    tokenizer = tc.get_tokenizer()
    prompt, completion = tokenizer.encode("Say yes:"), tokenizer.encode(" yes")
    tokens = prompt + completion
    n = len(tokens) - 1
    sampler = tc.save_weights_and_get_sampling_client().result()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    advantages = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": advantages},
    )
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        scored = tc.forward([datum], loss_fn).result()  # the same loss and metrics, no gradient
        out = tc.forward_backward([datum], loss_fn).result()
        assert scored.metrics == pytest.approx(out.metrics, rel=1e-4, abs=1e-5)
        lp = out.loss_fn_outputs[0]["logprobs"].tolist()
        assert len(lp) == n
        # On-policy, the ratio is 1: the IS loss is minus the summed advantage (= completion tokens).
        if loss_fn == "importance_sampling":
            assert out.metrics["loss:sum"] == pytest.approx(-len(completion), rel=0.05)
        assert out.metrics["tokens:sum"] == len(completion)
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def test_custom_loss_runs_through_the_sdk(service: tinker.ServiceClient) -> None:
    import torch

    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    data = [_sft_datum(tc.get_tokenizer(), "Two plus two is", " four")]

    def squared_logprob(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared:sum": float(loss)}

    out = tc.forward_backward_custom(data, squared_logprob).result()
    assert out.metrics["squared:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_checkpoints_resume_in_a_new_training_client(serve: Serve, service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3, train_unembed=False).result()
    tokenizer = tc.get_tokenizer()
    data = [_sft_datum(tokenizer, "Colour of the sky:", " blue")]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = tc.save_state("after-one").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/weights/after-one")
    before = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    resumed = service.create_training_client_from_state(saved.path).result()
    after = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == pytest.approx(before, abs=1e-4)
    info = resumed.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 4
    shape = tinker.RestClient(base_url=serve.url, api_key=KEY).get_weights_info_by_tinker_path(saved.path).result()
    assert not shape.train_unembed and shape.train_mlp  # as asked

    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.load_state(saved.path).result()  # back to the checkpoint
    again = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert again == pytest.approx(before, abs=1e-4)


def test_errors_are_4xx_with_a_message_never_a_traceback(serve: Serve, service: tinker.ServiceClient) -> None:
    stranger = tinker.ServiceClient(base_url=serve.url, api_key="tml-not-a-key-of-this-runtime")
    with pytest.raises(tinker.AuthenticationError, match="unknown API key"):
        stranger.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(Exception, match="not served here"):
        service.create_lora_training_client(base_model="no-such-model", rank=4).result()
    headers = {"X-API-Key": KEY}
    bad = [
        ("/api/v1/forward_backward", b"\xff\xfe garbage", {"Content-Type": "application/x-protobuf"}),
        ("/api/v1/optim_step", b"{not json", {"Content-Type": "application/json"}),
        ("/api/v1/get_info", b'{"model_id": "nope"}', {"Content-Type": "application/json"}),
        ("/api/v1/asample", b'{"prompt": {"chunks": "x"}, "sampling_params": {}}', {}),
        ("/api/v1/create_session", b"[" * 100_000, {}),
    ]
    for path, body, extra in bad:
        r = httpx.post(serve.url + path, content=body, headers={**headers, **extra}, timeout=30)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        assert "Traceback" not in r.text and "/polytinker/" not in r.text
        assert r.json()["error"]["message"]
    other = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(tinker.NotFoundError, match="for this tenant"):  # bob cannot name alice's weights
        other.create_sampling_client(model_path=tc.save_weights_for_sampler("mine").result().path).result()
    with pytest.raises(ValueError, match="No data"):  # the SDK's own check, as against Tinker
        tc.forward_backward([], "cross_entropy")
    with pytest.raises(tinker.BadRequestError, match="loss_fn must be one of"):
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
        tc.forward_backward([datum], "no-such-loss").result()


def test_the_openai_agent_example_trains_through_both_front_doors(serve: Serve) -> None:
    """examples/openai_agent_rl.py as a user runs it: the openai client acts, the tinker SDK trains."""
    example = Path(__file__).resolve().parents[1] / "examples" / "openai_agent_rl.py"
    env = {**os.environ, "TINKER_API_KEY": KEY}
    run = subprocess.run(
        [sys.executable, str(example), "--base-url", serve.url, "--steps", "2", "--group", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "mean reward" in steps[0]


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient) -> tuple[tinker.ServiceClient, tinker.TrainingClient, list[int]]:
    """A LoRA run one step away from the base model, and a prompt to score with it."""
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
    assert config["r"] == 4 and "lm_head" in config["target_modules"]  # train_unembed=True, the SDK's default

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


def _saved_both_ways(tc: tinker.TrainingClient, name: str, tokens: list[int]):
    """The run's current weights saved as ``name`` both ways (sampler and training checkpoint),
    the prompt of ``tokens`` and the sampler's logprobs of it."""
    sampler_path = tc.save_weights_for_sampler(name).result().path
    state_path = tc.save_state(name).result().path
    prompt = types.ModelInput.from_ints(tokens)
    own = tc.create_sampling_client(sampler_path).result().compute_logprobs(prompt).result()
    return sampler_path, state_path, prompt, own


def test_a_published_checkpoint_samples_and_resumes_for_another_tenant(serve: Serve, trained) -> None:
    _, tc, tokens = trained
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    sampler_path, state_path, prompt, own = _saved_both_ways(tc, "shared", tokens)
    bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
    bob_rest = tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
    with pytest.raises(tinker.NotFoundError, match="for this tenant"):
        bob.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    with pytest.raises(tinker.NotFoundError):  # only the owner publishes
        bob_rest.publish_checkpoint_from_tinker_path(sampler_path).result()

    for path in (sampler_path, state_path, state_path):  # publishing again changes nothing
        rest.publish_checkpoint_from_tinker_path(path).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[sampler_path].public and listed[state_path].public
    # Sizes on the scheduler's disk: the training checkpoint holds the optimizer state too.
    assert listed[state_path].size_bytes > listed[sampler_path].size_bytes > 0

    theirs = bob.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    assert theirs[1:] == pytest.approx(own[1:], abs=1e-4)
    info = bob_rest.get_weights_info_by_tinker_path(state_path).result()
    assert info.lora_rank == 4 and info.train_unembed and info.train_attn  # the SDK's defaults
    resumed = bob.create_training_client_from_state(state_path).result()
    resumed_scores = resumed.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert resumed_scores[1:] == pytest.approx(own[1:], abs=1e-4)

    rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    fresh = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)  # a client not made while it was public
    with pytest.raises(tinker.NotFoundError, match="for this tenant"):
        fresh.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    for c in (bob, fresh):
        c.close("success").result()


def test_copy_weights_makes_a_run_that_outlives_its_source(serve: Serve, trained) -> None:
    _, tc, tokens = trained
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    sampler_path, state_path, prompt, own = _saved_both_ways(tc, "to-copy", tokens)
    bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB, project_id="archive")
    with pytest.raises(tinker.NotFoundError):  # not published: not bob's to copy
        bob.copy_weights(state_path).result()
    rest.publish_checkpoint_from_tinker_path(state_path).result()
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    state_copy = bob.copy_weights(state_path).result()
    sampler_copy = bob.copy_weights(sampler_path, ttl_seconds=3600).result()
    assert state_copy.endswith("/weights/to-copy") and "/sampler_weights/" in sampler_copy
    copy_run = state_copy.removeprefix("tinker://").split("/")[0]
    bob_rest = tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
    run = bob_rest.get_training_run(copy_run).result()
    assert run.user_metadata == {"copied_from": state_path, "project_id": "archive"}
    listed = {c.tinker_path for c in bob_rest.list_checkpoints(copy_run).result().checkpoints}
    assert listed == {state_copy}

    rest.delete_checkpoint_from_tinker_path(state_path).result()  # the source goes; the copies stay
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    copied = bob.create_sampling_client(model_path=sampler_copy).result().compute_logprobs(prompt).result()
    assert copied[1:] == pytest.approx(own[1:], abs=1e-4)
    resumed = bob.create_training_client_from_state(state_copy).result()
    assert resumed.forward([_sft_datum(resumed.get_tokenizer(), "a", " b")], "cross_entropy").result()
    bob.close("success").result()


def test_top_k_prompt_logprobs_through_the_sdk(trained) -> None:
    _, tc, tokens = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=2)
    out = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    top, scored = out.topk_prompt_logprobs, out.prompt_logprobs
    assert top is not None and top[0] is None and len(top) == len(tokens)
    assert all(len(row) == 5 for row in top[1:])
    for i in range(1, len(tokens)):
        row = dict(top[i])
        assert max(row.values()) >= scored[i] - 1e-4  # nothing beats the best
        if tokens[i] in row:
            assert row[tokens[i]] == pytest.approx(scored[i], abs=1e-4)
    alone = sampler.sample(prompt, 1, params, topk_prompt_logprobs=2).result()
    assert alone.prompt_logprobs is None and alone.topk_prompt_logprobs is not None
    for row, row2 in zip(top[1:], alone.topk_prompt_logprobs[1:], strict=True):
        assert [t for t, _ in row[:2]] == [t for t, _ in row2]
        assert [lp for _, lp in row[:2]] == pytest.approx([lp for _, lp in row2], abs=1e-4)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        sampler.sample(prompt, 1, params, topk_prompt_logprobs=50).result()


def test_closing_a_service_client_finishes_its_session_and_runs(serve: Serve) -> None:
    from polytinker import ServiceClient

    sc = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    kept = tc.save_weights_for_sampler("after-close").result().path
    session_id = tc.model_id.partition(":")[0]
    sc.close("success", detail="done here").result()

    address = re.search(r'address = "([^"]+)"', (serve.root / "runtime.toml").read_text())
    assert address is not None
    with ServiceClient(address.group(1), api_key=KEY) as ours:
        run = tinker.RestClient(base_url=serve.url, api_key=KEY).get_training_run(tc.model_id).result()
        assert ours.get_job(run.training_run_id)["job"]["state"] == "done"  # its adapter slot is free
    again = httpx.post(
        serve.url + "/api/v1/create_model",
        json={"session_id": session_id, "model_seq_id": 9, "base_model": MODEL, "lora_config": {"rank": 4}},
        headers={"X-API-Key": KEY},
        timeout=30,
    )
    assert again.status_code == 400 and "is finished" in again.json()["error"]["message"]
    other = tinker.ServiceClient(base_url=serve.url, api_key=KEY)  # its saved weights stay sampleable
    sampler = other.create_sampling_client(model_path=kept).result()
    assert len(sampler.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()) == 3
    other.close("success").result()


def test_paths_outlive_a_restart_of_serve(serve: Serve, service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    tokenizer = tc.get_tokenizer()
    data = [_sft_datum(tokenizer, "The code is", " 42")]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler_path = tc.save_weights_for_sampler("kept").result().path
    state_path = tc.save_state("kept").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode("The code is 42"))
    sampler = tc.create_sampling_client(sampler_path).result()
    before = sampler.compute_logprobs(prompt).result()

    # Calls in flight when serve stops: a long sample, and a training call (a big batch).
    long_sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=400, temperature=1.0, seed=3))
    in_flight_fb = tc.forward_backward(data * 256, "cross_entropy")
    gateway_db = serve.root / "state" / "gateway.sqlite"
    deadline = time.monotonic() + 60
    while _pending_requests(gateway_db) < 2:  # both filed, neither read back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    serve.stop()
    serve.start()
    # The sample was lost with the process: the SDK is told so (410) and sends it again.
    assert len(long_sample.result(timeout=300).sequences[0].tokens) > 0
    assert "(sample) was lost when the gateway restarted" in (serve.root / "serve.log").read_text()
    # A training call may or may not have taken effect: it fails, saying so.
    with pytest.raises(tinker.RequestFailedError, match="restarted while this call ran"):
        in_flight_fb.result(timeout=300)

    fresh = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    after = fresh.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    assert after[1:] == pytest.approx(before[1:], abs=1e-3)
    resumed = fresh.create_training_client_from_state(state_path).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0


def _pending_requests(gateway_db: Path) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{gateway_db}?mode=ro", uri=True)) as db:
        return int(db.execute("SELECT count(*) FROM requests").fetchone()[0])
