"""The inference backend contract (``base.py``), checked for each backend: ``hf`` and ``vllm``.

Both run the tiny-random model with random adapters whose updates are large enough that every
adapter (and the base model) decodes differently. vLLM runs in bfloat16 here and hf in float32,
so logprob comparisons use a per-backend tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference.adapter_io import random_adapter
from polytinker.engine.inference.base import InferenceBackend
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, FinishReason, SampleRequest, SamplingParams
from polytinker.errors import ConfigError

# Largest gap allowed between a sampled token's logprob and compute_logprobs for the same token.
LOGPROB_TOL = {"hf": 1e-3, "vllm": 0.1}
ADAPTER_SCALE = 0.2  # random LoRA A and B entries: big enough to change greedy decoding
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model() -> Any:
    model, _ = load_model(TINY_RANDOM)
    return model


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend_module(request: pytest.FixtureRequest) -> Any:
    if request.param == "vllm":
        yield request.getfixturevalue("vllm_tiny")  # shared with test_inference_vllm.py
        return
    from polytinker.engine.inference.config import HFBackendConfig
    from polytinker.engine.inference.hf import HFBackend

    backend = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    yield backend
    backend.close()


@pytest.fixture
def backend(backend_module: Any) -> Any:
    """The module's backend, with every adapter a test loaded unloaded afterwards."""
    yield backend_module
    for ref in backend_module.loaded_adapters():
        backend_module.unload_adapter(ref)


def adapter(model: Any, name: str, seed: int, version: int = 0) -> AdapterWeights:
    return random_adapter(model, AdapterRef(name, version), seed=seed, scale=ADAPTER_SCALE)


def prompt(backend: Any, text: str = "The capital of France is") -> tuple[int, ...]:
    return tuple(backend.tokenizer.encode(text))


def greedy_tokens(backend: Any, ref: AdapterRef | None, ids: tuple[int, ...]) -> tuple[int, ...]:
    [result] = backend.sample([SampleRequest(prompt_token_ids=ids, adapter=ref, params=GREEDY)])
    return result.sequences[0].token_ids


def test_implements_the_interface(backend: Any) -> None:
    assert isinstance(backend, InferenceBackend)
    assert backend.name in LOGPROB_TOL


def test_mixed_batch_equals_unmixed(backend: Any, tiny_model: Any) -> None:
    refs: list[AdapterRef | None] = [None]
    for seed in range(3):
        weights = adapter(tiny_model, f"mix{seed}", seed)
        backend.load_adapter(weights)
        refs.append(weights.ref)
    ids = prompt(backend)
    alone = [greedy_tokens(backend, ref, ids) for ref in refs]
    # Interleaved, twice over: rows of one adapter are not neighbours in the batch.
    order = refs + refs[::-1]
    mixed = backend.sample([SampleRequest(prompt_token_ids=ids, adapter=ref, params=GREEDY) for ref in order])
    assert [r.adapter for r in mixed] == order
    for ref, result in zip(order, mixed, strict=True):
        assert result.prompt_token_ids == ids
        assert result.sequences[0].token_ids == alone[refs.index(ref)], f"adapter {ref} differs in a mixed batch"
    assert len(set(alone)) == len(refs), "every adapter (and the base) should decode differently"


def test_sampled_logprobs_match_compute_logprobs(backend: Any, tiny_model: Any) -> None:
    weights = adapter(tiny_model, "lp", 7)
    backend.load_adapter(weights)
    ids = prompt(backend)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    for ref in (None, weights.ref):
        [result] = backend.sample([SampleRequest(prompt_token_ids=ids, adapter=ref, params=params)])
        seq = result.sequences[0]
        assert len(seq.logprobs) == len(seq.token_ids) == 10
        [scored] = backend.compute_logprobs([ids + seq.token_ids], ref)
        assert len(scored) == len(ids) + len(seq.token_ids) - 1
        generated = scored[len(ids) - 1 :]
        gaps = [abs(a - b) for a, b in zip(seq.logprobs, generated, strict=True)]
        assert max(gaps) < LOGPROB_TOL[backend.name], (seq.logprobs, generated)
        assert all(lp < 0 for lp in seq.logprobs)


def test_compute_logprobs_shapes_and_adapter(backend: Any, tiny_model: Any) -> None:
    weights = adapter(tiny_model, "shape", 11)
    backend.load_adapter(weights)
    seqs = [[1, 504, 3458, 282], [1], [1, 504]]
    base = backend.compute_logprobs(seqs)
    assert [len(s) for s in base] == [3, 0, 1]
    tuned = backend.compute_logprobs(seqs, weights.ref)
    assert abs(tuned[0][2] - base[0][2]) > LOGPROB_TOL[backend.name], "the adapter should change logprobs"
    with pytest.raises(ConfigError):
        backend.compute_logprobs([[]])


def test_top_k_prompt_logprobs_rank_the_vocabulary(backend: Any, tiny_model: Any) -> None:
    weights = adapter(tiny_model, "topk", 12)
    backend.load_adapter(weights)
    seqs = [[1, 504, 3458, 282, 17], [1, 504]]
    logprobs, top = backend.compute_logprobs_topk(seqs, 4, weights.ref)
    for values, alone in zip(logprobs, backend.compute_logprobs(seqs, weights.ref), strict=True):
        assert values == pytest.approx(alone, abs=LOGPROB_TOL[backend.name])
    assert [len(rows) for rows in top] == [4, 1] and all(len(row) == 4 for rows in top for row in rows)
    for seq, values, rows in zip(seqs, logprobs, top, strict=True):
        for j, row in enumerate(rows):
            scores = [lp for _, lp in row]
            assert scores == sorted(scores, reverse=True) and len({t for t, _ in row}) == 4
            assert scores[0] >= values[j] - LOGPROB_TOL[backend.name]  # nothing beats the best
            if seq[j + 1] in dict(row):  # the actual token, when among them, scores as compute_logprobs says
                assert dict(row)[seq[j + 1]] == pytest.approx(values[j], abs=LOGPROB_TOL[backend.name])
    assert backend.compute_logprobs_topk(seqs, 0)[1] == [[], []]


def test_replace_version_in_place_changes_outputs(backend: Any, tiny_model: Any) -> None:
    first = adapter(tiny_model, "swap", 21)
    backend.load_adapter(first)
    ids = prompt(backend)
    before = backend.compute_logprobs([ids], first.ref)[0]
    tokens_before = greedy_tokens(backend, first.ref, ids)
    # Same ref, new tensors: the loaded version is replaced, not duplicated.
    second = adapter(tiny_model, "swap", 22)
    backend.load_adapter(second)
    assert backend.loaded_adapters() == [first.ref]
    after = backend.compute_logprobs([ids], first.ref)[0]
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > LOGPROB_TOL[backend.name]
    assert greedy_tokens(backend, first.ref, ids) != tokens_before
    # The replacement serves exactly what a fresh load of those tensors serves.
    fresh = adapter(tiny_model, "fresh", 22)
    backend.load_adapter(fresh)
    assert backend.compute_logprobs([ids], fresh.ref)[0] == pytest.approx(after, abs=LOGPROB_TOL[backend.name])


def test_replaced_version_is_not_served_from_caches(backend: Any, tiny_model: Any) -> None:
    # 300 tokens span whole KV-cache blocks, which a prefix cache could hand back after a reload.
    ids = tuple(range(1000, 1300))
    old = adapter(tiny_model, "cached", 51)
    backend.load_adapter(old)
    greedy_tokens(backend, old.ref, ids)
    backend.load_adapter(adapter(tiny_model, "cached", 52))
    fresh = adapter(tiny_model, "uncached", 52)
    backend.load_adapter(fresh)
    replaced, loaded = backend.sample(
        [SampleRequest(prompt_token_ids=ids, adapter=ref, params=GREEDY) for ref in (old.ref, fresh.ref)]
    )
    assert replaced.sequences[0].token_ids == loaded.sequences[0].token_ids
    assert replaced.sequences[0].logprobs == pytest.approx(loaded.sequences[0].logprobs, abs=LOGPROB_TOL[backend.name])


def test_versions_side_by_side_and_unload(backend: Any, tiny_model: Any) -> None:
    v0, v1 = adapter(tiny_model, "agent", 31, version=0), adapter(tiny_model, "agent", 32, version=1)
    backend.load_adapter(v0)
    backend.load_adapter(v1)
    assert set(backend.loaded_adapters()) == {v0.ref, v1.ref}
    ids = prompt(backend)
    assert greedy_tokens(backend, v0.ref, ids) != greedy_tokens(backend, v1.ref, ids)
    backend.unload_adapter(v0.ref)
    assert backend.loaded_adapters() == [v1.ref]
    with pytest.raises(ConfigError, match="not loaded"):
        backend.sample([SampleRequest(prompt_token_ids=ids, adapter=v0.ref, params=GREEDY)])
    with pytest.raises(ConfigError, match="not loaded"):
        backend.unload_adapter(v0.ref)
    assert greedy_tokens(backend, v1.ref, ids)  # the other version still serves


def test_stop_strings(backend: Any) -> None:
    ids = prompt(backend)
    full = backend.sample([SampleRequest(prompt_token_ids=ids, params=SamplingParams(max_tokens=12, temperature=0))])
    full_seq = full[0].sequences[0]
    middle = len(full_seq.text) // 2
    stop = full_seq.text[middle : middle + 3]
    params = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    [result] = backend.sample([SampleRequest(prompt_token_ids=ids, params=params)])
    seq = result.sequences[0]
    assert seq.finish_reason == FinishReason.STOP
    assert seq.text == full_seq.text[: full_seq.text.index(stop)]
    # The tokens that completed the stop string stay in token_ids (a learner sees them).
    assert stop in backend.tokenizer.decode(list(seq.token_ids))
    assert seq.token_ids == full_seq.token_ids[: len(seq.token_ids)]
    assert len(seq.token_ids) < len(full_seq.token_ids)


def test_stop_token_ids_and_length(backend: Any) -> None:
    ids = prompt(backend)
    full = greedy_tokens(backend, None, ids)
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(full[2],))
    [result] = backend.sample([SampleRequest(prompt_token_ids=ids, params=params)])
    assert result.sequences[0].token_ids == full[:3]  # the stop token is included
    assert result.sequences[0].finish_reason == FinishReason.STOP
    [result] = backend.sample([SampleRequest(prompt_token_ids=ids, params=SamplingParams(max_tokens=5))])
    assert len(result.sequences[0].token_ids) == 5
    assert result.sequences[0].finish_reason == FinishReason.LENGTH


def test_n_samples(backend: Any, tiny_model: Any) -> None:
    weights = adapter(tiny_model, "many", 41)
    backend.load_adapter(weights)
    ids = prompt(backend)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    batch = [
        SampleRequest(prompt_token_ids=ids, adapter=ref, params=params, num_samples=3) for ref in (None, weights.ref)
    ]
    first, again = backend.sample(batch), backend.sample(batch)
    for result, repeat in zip(first, again, strict=True):
        assert len(result.sequences) == 3
        assert [s.token_ids for s in result.sequences] == [s.token_ids for s in repeat.sequences]  # seeded
        assert len({s.token_ids for s in result.sequences}) == 3  # each sample draws its own tokens
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    [result] = backend.sample([SampleRequest(prompt_token_ids=ids, params=greedy, num_samples=2)])
    assert len(result.sequences) == 2
    assert result.sequences[0].token_ids == result.sequences[1].token_ids


def test_chat_messages_use_the_chat_template(backend: Any) -> None:
    messages = ({"role": "user", "content": "Hello there"},)
    [result] = backend.sample([SampleRequest(messages=messages, params=SamplingParams(max_tokens=3))])
    expected = backend.tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(result.prompt_token_ids) == list(expected)
    assert len(result.sequences[0].token_ids) == 3
