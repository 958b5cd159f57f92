"""The hf engine on a CUDA GPU (tiny-random model): several adapters in one mixed batch, scored
and sampled on the GPU as on the CPU in float32. Run by scripts/gpu_check.sh; skipped (and so
failed by that script) where CUDA is absent."""

from __future__ import annotations

import pytest

from polytinker.engine.inference import HFBackend, HFBackendConfig, random_adapter
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import AdapterRef, SampleRequest, SamplingParams

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"


def backends() -> tuple[HFBackend, HFBackend]:
    cpu = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    gpu = HFBackend(HFBackendConfig(model=TINY_RANDOM, device=DEVICE))
    for seed in range(4):
        weights = random_adapter(cpu.model, AdapterRef(f"agent{seed}"), seed=seed, scale=0.2)
        cpu.load_adapter(weights)
        gpu.load_adapter(weights)
    return cpu, gpu


def test_the_hf_engine_on_the_gpu_scores_and_samples_as_on_the_cpu() -> None:
    cpu, gpu = backends()
    assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
    seqs = [[5, 17, 230, 31, 8, 99], [7, 7, 40, 2]]
    for ref in [None, *(AdapterRef(f"agent{i}") for i in range(4))]:
        for a, b in zip(gpu.compute_logprobs(seqs, ref), cpu.compute_logprobs(seqs, ref), strict=True):
            assert a == pytest.approx(b, abs=1e-3)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    requests = [
        SampleRequest(prompt_token_ids=(5, 6, 7), adapter=AdapterRef(f"agent{i % 4}"), params=params) for i in range(8)
    ]
    on_gpu, on_cpu = gpu.sample(requests), cpu.sample(requests)
    for g, c in zip(on_gpu, on_cpu, strict=True):
        assert len(g.sequences[0].token_ids) == 6
        # Seeded draws from logits equal to 1e-3: the same tokens but where two are that close.
        same = sum(x == y for x, y in zip(g.sequences[0].token_ids, c.sequences[0].token_ids, strict=True))
        assert same >= 5
