"""Code written for the ``tinker`` SDK, with only the import changed, on polytinker's own client:
the vocabulary (``polytinker.types``) without a runtime, then a supervised loop and an RL step
written as Tinker code is, against the shared tiny-random runtime."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from fixtures.client import KEY_ALICE, MODEL, shared_runtime

import polytinker as tinker
from polytinker import types
from polytinker.client._convert import to_datum, to_sampling_params
from polytinker.client._future import APIFuture, submit
from polytinker.client._lora import lora_modules
from polytinker.errors import ConfigError

# --- the vocabulary, no runtime -----------------------------------------------------------------


def test_model_input_builds_and_reads_token_ids() -> None:
    mi = types.ModelInput.from_ints([1, 2, 3]).append_int(4)
    assert mi.to_ints() == [1, 2, 3, 4] and mi.length == 4 and len(mi.chunks) == 2
    assert types.ModelInput.empty().length == 0
    assert types.ModelInput([types.EncodedTextChunk([5, 6])]).chunks[0].length == 2
    with pytest.raises(ConfigError, match="token ids"):
        types.ModelInput.from_ints([1.5])  # type: ignore[list-item]


def test_tensor_data_converts_to_and_from_numpy_and_torch() -> None:
    td = types.TensorData.from_numpy(np.arange(6, dtype=np.float64).reshape(2, 3))
    assert (td.dtype, td.shape, td.data) == ("float32", [2, 3], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert td.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert td.to_numpy().dtype == np.float32 and td.to_numpy().shape == (2, 3)
    ints = types.TensorData.from_torch(torch.tensor([3, 4], dtype=torch.int32))
    assert ints.dtype == "int64" and ints.to_torch().dtype == torch.int64 and ints.tolist() == [3, 4]
    assert torch.equal(types.TensorData.from_torch(torch.ones(2, 2)).to_torch(), torch.ones(2, 2))
    with pytest.raises(ConfigError, match="shape"):
        types.TensorData([1.0, 2.0], "float32", [3])


def test_datum_stores_every_loss_input_as_tensor_data() -> None:
    d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": np.array([0.0, 1.0, 1.0]), "advantages": torch.ones(3)},
    )
    inputs = d.loss_fn_inputs
    assert all(isinstance(v, types.TensorData) for v in inputs.values())
    assert inputs["target_tokens"].dtype == "int64" and inputs["weights"].dtype == "float32"
    assert inputs["advantages"].tolist() == [1.0, 1.0, 1.0]
    assert types.Datum(model_input=[7, 8], loss_fn_inputs={}).model_input.to_ints() == [7, 8]  # type: ignore[arg-type]


def test_sampling_and_adam_params_have_tinkers_defaults() -> None:
    sdk = pytest.importorskip("tinker")
    ours, theirs = types.SamplingParams(), sdk.types.SamplingParams()
    for name in ("max_tokens", "seed", "stop", "temperature", "top_k", "top_p"):
        assert getattr(ours, name) == getattr(theirs, name), name
    adam, sdk_adam = types.AdamParams(), sdk.types.AdamParams()
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        assert getattr(adam, name) == getattr(sdk_adam, name), name


def test_tinkers_sampling_params_mean_what_they_mean_in_tinker() -> None:
    default = to_sampling_params(types.SamplingParams())
    assert (default.max_tokens, default.top_k, default.stop, default.ignore_eos) == (256, 0, (), False)
    assert to_sampling_params(types.SamplingParams(stop="\n")).stop == ("\n",)
    assert to_sampling_params(types.SamplingParams(stop=["a", "b"])).stop == ("a", "b")
    assert to_sampling_params(types.SamplingParams(stop=[7, 9])).stop_token_ids == (7, 9)
    assert to_sampling_params(types.SamplingParams(stop=[])).ignore_eos  # not even EOS stops
    assert to_sampling_params(types.SamplingParams(top_k=5, seed=3)).top_k == 5
    # polytinker's own params keep their meaning: stop=() is "no stop strings", not "ignore EOS"
    assert not to_sampling_params({"max_tokens": 8, "stop": ()}).ignore_eos
    sdk = pytest.importorskip("tinker")
    assert to_sampling_params(sdk.types.SamplingParams(max_tokens=3, stop=[])).ignore_eos  # the SDK's own object
    with pytest.raises(ConfigError, match="seed"):
        types.SamplingParams(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="seed"):
        to_sampling_params({"max_tokens": 4, "seed": "7"})
    with pytest.raises(ConfigError, match="stop"):
        types.SamplingParams(stop=["a", 1])  # type: ignore[list-item]


def test_constrained_sampling_travels_in_the_public_sampling_params() -> None:
    """``choices`` (polytinker's, beyond Tinker's fields) reaches the engine's params whole; the
    SDK's objects, which have none, sample unconstrained; the engine's rules refuse bad choices."""
    params = to_sampling_params(types.SamplingParams(max_tokens=4, choices=[[5, 6], [7]]))
    assert params.choices == ((5, 6), (7,)) and params.max_tokens == 4
    assert to_sampling_params({"max_tokens": 4, "choices": [[5, 6], [7]]}).choices == ((5, 6), (7,))
    assert to_sampling_params(types.SamplingParams(max_tokens=4)).choices == ()
    with pytest.raises(ConfigError, match=r"SamplingParams\.choices"):
        to_sampling_params(types.SamplingParams(max_tokens=4, choices=[[5], [5, 6]]))  # a prefix of another
    with pytest.raises(ConfigError, match=r"SamplingParams\.choices"):
        types.SamplingParams(choices=[[1.5]])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"SamplingParams\.choices must be a list of token-id lists"):
        types.SamplingParams(choices=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"SamplingParams\.choices must be a list of token-id lists"):
        to_sampling_params({"max_tokens": 4, "choices": [5, 6]})  # ids, not lists of them
    sdk = pytest.importorskip("tinker")
    assert to_sampling_params(sdk.types.SamplingParams(max_tokens=4)).choices == ()


def test_rl_datums_without_weights_count_the_positions_with_an_advantage() -> None:
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "logprobs": [0, 0, -1, -2], "advantages": [0, 0, 0.5, 0.5]},
    )
    assert to_datum(rl).weights_T == [0.0, 0.0, 1.0, 1.0]
    weighted = types.Datum(
        model_input=[1, 2],  # type: ignore[arg-type]
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [0.5, 1], "advantages": [0, 1], "logprobs": [0, 0]},
    )
    assert to_datum(weighted).weights_T == [0.5, 1.0]  # given weights win
    sdk = pytest.importorskip("tinker")  # the SDK's own datum converts the same
    theirs = sdk.types.Datum(
        model_input=sdk.types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "logprobs": [0, 0, -1, -2], "advantages": [0, 0, 0.5, 0.5]},
    )
    assert to_datum(theirs) == to_datum(rl)


def test_api_futures_are_concurrent_futures_that_can_be_awaited() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        fut = submit(pool, lambda: 41 + 1)
        assert isinstance(fut, tinker.APIFuture) and fut.result(timeout=5) == 42
        wait([fut], timeout=5)
        failing = submit(pool, lambda: 1 // 0)

        async def main() -> tuple[int, int]:
            slow: APIFuture[int] = APIFuture()  # never resolved: result_async times out, the call stays
            with pytest.raises(TimeoutError):
                await slow.result_async(timeout=0.05)
            assert not slow.cancelled()
            with pytest.raises(ZeroDivisionError):
                await failing
            return await fut, await asyncio.wrap_future(fut)

        assert asyncio.run(main()) == (42, 42)


def test_metrics_use_tinkers_names_and_answer_the_old_ones() -> None:
    from polytinker.client._convert import fb_output

    out = fb_output(3.0, [[-1.0, -2.0]], {"loss/sum": 3.0, "loss/tokens": 2.0, "kl/base": 0.1})
    assert set(out.metrics) == {"loss:sum", "loss:tokens", "kl:base", "tokens:sum"}
    assert out.metrics["loss/tokens"] == 2.0 and out.metrics.get("kl/base") == 0.1 and "kl/base" in out.metrics
    assert out.loss == 3.0 and out.logprobs == [[-1.0, -2.0]] and out.loss_fn_output_type == "ArrayRecord"
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]


def test_base_url_takes_scheduler_addresses_and_explains_http() -> None:
    with pytest.raises(ConfigError, match=r"polytinker serve --http.*docs/tinker.md"):
        tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key=KEY_ALICE)
    with pytest.raises(ConfigError, match="tcp://"):
        tinker.ServiceClient(base_url="127.0.0.1:7000", api_key=KEY_ALICE)
    tinker.ServiceClient(base_url="tcp://127.0.0.1:9", api_key=KEY_ALICE).close()
    attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    assert lora_modules(True, True, True) == (*attn, *mlp, "lm_head")  # Tinker's defaults
    assert lora_modules(True, True, False) == ()  # all linear projections: the learner's default
    assert lora_modules(False, True, False) == attn
    assert lora_modules(True, False, True) == (*mlp, "lm_head")
    assert lora_modules(False, False, True) == ("lm_head",)
    assert lora_modules(True, True, True, ("q_proj",)) == ("q_proj",)  # named modules win
    with pytest.raises(ConfigError, match="train nothing"):
        lora_modules(False, False, False)


# --- Tinker code on the shared runtime ------------------------------------------------------------


def _sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_a_tinker_supervised_loop_runs_and_resumes_from_its_state() -> None:
    service = tinker.ServiceClient(base_url=shared_runtime().address, api_key=KEY_ALICE)
    try:
        training_client = service.create_lora_training_client(base_model=MODEL, rank=4)
        assert training_client.result() is training_client  # Tinker 0.38's future-of-client style too
        info = training_client.get_info()
        assert (info.model_data.model_name, info.is_lora, info.lora_rank) == (MODEL, True, 4)
        tokenizer = training_client.get_tokenizer()
        data = [_sft_datum(tokenizer, "Q: the secret word?\nA:", " zebra zebra"), _sft_datum(tokenizer, "Hi", " there")]
        losses = []
        for _ in range(3):
            fwd_bwd_future = training_client.forward_backward(data, loss_fn="cross_entropy")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=2e-2))
            fwd_bwd_result = fwd_bwd_future.result()
            optim_result = optim_future.result()
            logprobs = [x["logprobs"] for x in fwd_bwd_result.loss_fn_outputs]
            weights = [d.loss_fn_inputs["weights"] for d in data]
            nll = -sum(float(torch.dot(lp.to_torch(), w.to_torch())) for lp, w in zip(logprobs, weights, strict=True))
            assert math.isclose(fwd_bwd_result.metrics["loss:sum"], nll, rel_tol=1e-4)
            assert isinstance(optim_result.metrics, dict) and optim_result.version >= 1
            losses.append(fwd_bwd_result.metrics["loss:sum"])
        assert losses[-1] < losses[0]

        saved = training_client.save_state("tinker-sl-3").result()
        assert saved.path.startswith("polytinker-ckpt://") and saved.path.endswith("/tinker-sl-3")
        now = training_client.forward(data, "cross_entropy").result()
        resumed = service.create_training_client_from_state(saved.path)
        assert resumed.job_id != training_client.job_id and resumed.get_info().lora_rank == 4
        again = resumed.forward(data, "cross_entropy").result()
        assert math.isclose(again.metrics["loss:sum"], now.metrics["loss:sum"], rel_tol=1e-4)
        assert resumed.load_state_with_optimizer(saved.path).result().version >= 1
    finally:
        service.close()


def test_a_tinker_rl_step_samples_scores_and_trains_with_async_futures() -> None:
    async def main() -> None:
        service = tinker.ServiceClient(base_url=shared_runtime().address, api_key=KEY_ALICE)
        try:
            tc = await service.create_lora_training_client_async(MODEL, rank=4)
            sampler = tc.save_weights_and_get_sampling_client()
            assert sampler.result() is sampler
            tokenizer = sampler.get_tokenizer()
            prompt = types.ModelInput.from_ints(tokenizer.encode("Once upon a time"))

            res = await sampler.sample(prompt, num_samples=4, sampling_params=types.SamplingParams(max_tokens=4))
            assert len(res.sequences) == 4 and all(1 <= len(s.tokens) <= 4 for s in res.sequences)
            assert all(len(s.logprobs) == len(s.tokens) and s.stop_reason in ("stop", "length") for s in res.sequences)
            # stop=[]: not even EOS stops; stop=[id]: that token ends the sequence
            greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
            full = (await sampler.sample(prompt, 1, greedy)).sequences[0]
            assert len(full.tokens) == 4 and full.stop_reason == "length"
            stopped = await sampler.sample(
                prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[full.tokens[1]])
            )
            first = stopped.sequences[0]
            assert len(first.tokens) <= 2 and first.stop_reason == "stop"
            with pytest.raises(ConfigError, match="seed"):
                sampler.sample(prompt, 1, {"max_tokens": 4, "seed": -1})  # refused at the call
            # polytinker's constrained sampling in the public params: each answer is one of the choices
            choices = [
                tokenizer.encode(" yes", add_special_tokens=False),
                tokenizer.encode(" no", add_special_tokens=False),
            ]
            constrained = await sampler.sample(prompt, 4, types.SamplingParams(max_tokens=4, choices=choices, seed=1))
            assert all(s.tokens in choices for s in constrained.sequences)

            # compute_logprobs on a ModelInput, and the same scores as prompt logprobs
            seq = res.sequences[0]
            whole = prompt
            for t in seq.tokens:
                whole = whole.append_int(t)
            scored = await sampler.compute_logprobs(whole)
            assert scored[0] is None and len(scored) == whole.length
            assert all(
                math.isclose(a, b, abs_tol=1e-3) for a, b in zip(scored[prompt.length :], seq.logprobs, strict=True)
            )
            with_prompt = await sampler.sample(
                whole, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True
            )
            assert with_prompt.prompt_logprobs is not None and with_prompt.prompt_logprobs[0] is None
            pairs = zip(with_prompt.prompt_logprobs[1:], scored[1:], strict=True)
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in pairs)  # type: ignore[arg-type]

            # Tinker's RL datums: target tokens, sampling logprobs and advantages; no weights
            rewards = [float(len(s.tokens) % 2) for s in res.sequences]
            mean = sum(rewards) / len(rewards)
            datums = []
            for s, r in zip(res.sequences, rewards, strict=True):
                tokens = prompt.to_ints() + s.tokens
                n_prompt = prompt.length - 1
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * n_prompt + s.logprobs,
                            "advantages": [0.0] * n_prompt + [0.5 if r >= mean else -0.5] * len(s.tokens),
                        },
                    )
                )
            fwd_bwd_future = await tc.forward_backward_async(datums, "importance_sampling")
            optim_future = await tc.optim_step_async(types.AdamParams(learning_rate=1e-3))
            assert isinstance(fwd_bwd_future, tinker.APIFuture) and isinstance(optim_future, tinker.APIFuture)
            fwd_bwd, step = await fwd_bwd_future, await optim_future
            assert fwd_bwd.metrics["loss:tokens"] == sum(
                len(s.tokens) for s in res.sequences
            )  # the prompts don't count
            assert 0.9 < fwd_bwd.metrics["importance_sampling:ratio_mean"] < 1.1  # sampled by the same version
            assert step.version == 1

            saved = await (await tc.save_weights_for_sampler_async("rl-1"))
            assert saved.path.endswith("@1")
            new_sampler = await tc.save_weights_and_get_sampling_client_async()
            assert new_sampler.model_path.endswith("@1")
            assert (await new_sampler.sample_async(prompt, 1, types.SamplingParams(max_tokens=2))).sequences
        finally:
            await asyncio.to_thread(service.close)

    asyncio.run(main())
