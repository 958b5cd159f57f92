"""The official ``tinker`` SDK, unmodified, against a real ``polytinker serve --http`` with the
default model: training loops, sampling, checkpoints, futures, errors, and paths that outlive a
restart of the service. The SDK is configured only by its base URL and API key."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
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
    s = Serve(tmp_path_factory.mktemp("tinker-serve"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def service(serve: Serve) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    yield sc


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
        out = tc.forward_backward([datum], loss_fn).result()
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


def test_checkpoints_resume_in_a_new_training_client(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
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
    with pytest.raises(Exception, match="unknown model"):  # bob cannot name alice's model
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


def test_paths_outlive_a_restart_of_serve(serve: Serve, service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    tokenizer = tc.get_tokenizer()
    data = [_sft_datum(tokenizer, "The code is", " 42")]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler_path = tc.save_weights_for_sampler("kept").result().path
    state_path = tc.save_state("kept").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode("The code is 42"))
    before = tc.create_sampling_client(sampler_path).result().compute_logprobs(prompt).result()

    serve.stop()
    serve.start()
    fresh = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    after = fresh.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    assert after[1:] == pytest.approx(before[1:], abs=1e-3)
    resumed = fresh.create_training_client_from_state(state_path).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
