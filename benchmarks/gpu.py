"""GPU figures: the engine, the learner and the runtime on one accelerator (``scripts/gpu_check.sh``).

No download: speed is measured on a random-weight model of realistic shape built on the device
(``--shape 1b``: Llama 3.2 1B's config, bfloat16), with the tiny-random preset's tokenizer; the
runtime's RL step uses the tiny-random preset, which its worker processes load by name. Every
figure is a ratio against a baseline measured in the same run, or a time:

- ``gpu_engine_mixed_vs_single_ratio``: hf engine tokens/s of 32 requests spread over 8 adapters in
  one mixed batch, over the same requests on one adapter (best of 2 interleaved rounds);
- ``gpu_engine_mixed_tok_per_s``: that mixed batch's generated tokens per second;
- ``gpu_learner_batched_vs_in_turn_ratio``: learner tokens/s of 4 adapters' updates in one
  ``forward_backward_many`` over one ``forward_backward`` per adapter (then a step each);
- ``gpu_learner_batched_tok_per_s``: the batched learner's trained tokens per second;
- ``gpu_adapter_sync_ms``: a new adapter version from the learner to the engine (export to host
  memory, load into the engine's slots on the device), median;
- ``gpu_runtime_rl_step_s``: one LoRA RL step through a local runtime whose engine and learner
  both run on the device: 8 samples, an importance-sampling ``forward_backward``, ``optim_step``
  and new weights to the sampler (median of the steps after the first).

    python benchmarks/gpu.py                      # on CUDA, 1B shape
    python benchmarks/gpu.py --device cpu --shape tiny --quick   # the same code on a CPU, for a dry run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

SHAPES = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
    },
}


def random_model(shape: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], tie_word_embeddings=True))
    return model.to(dtype).eval()


def engine_figures(shape: str, device: str, dtype: torch.dtype, quick: bool) -> tuple[dict[str, float], Any]:
    from polytinker.engine.inference import HFBackend, random_adapter
    from polytinker.engine.models import TINY_RANDOM, load_tokenizer
    from polytinker.engine.types import AdapterRef, SampleRequest, SamplingParams

    backend = HFBackend(model=random_model(shape, device, dtype), tokenizer=load_tokenizer(TINY_RANDOM))
    refs = [AdapterRef(f"agent{i}") for i in range(8)]
    for i, ref in enumerate(refs):
        backend.load_adapter(random_adapter(backend.model, ref, seed=i, scale=0.01))
    params = SamplingParams(max_tokens=16 if quick else 64, temperature=1.0, seed=0, ignore_eos=True)
    prompt = tuple(range(100, 132))
    mixed = [SampleRequest(prompt_token_ids=prompt, adapter=refs[i % 8], params=params) for i in range(32)]
    single = [replace(r, adapter=refs[0]) for r in mixed]
    backend.sample(mixed[:8])  # warm-up
    best = {"mixed": 0.0, "single": 0.0}
    for _ in range(2):
        for name, batch in (("mixed", mixed), ("single", single)):
            _sync(device)
            start = time.perf_counter()
            tokens = sum(len(s.token_ids) for r in backend.sample(batch) for s in r.sequences)
            _sync(device)
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return {
        "gpu_engine_mixed_vs_single_ratio": best["mixed"] / best["single"],
        "gpu_engine_mixed_tok_per_s": best["mixed"],
    }, backend


def learner_figures(shape: str, device: str, dtype: torch.dtype, quick: bool, engine: Any) -> dict[str, float]:
    from polytinker.engine.adapter_weights import AdapterWeights
    from polytinker.engine.learner import AdamParams, DistInfo, LearnerConfig, MultiAdapterLearner
    from polytinker.engine.types import AdapterRef, Datum, LoraConfig

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device(device))
    learner = MultiAdapterLearner(random_model(shape, device, dtype), LearnerConfig(micro_batch_size=32), info)
    names = [f"agent{i}" for i in range(4)]
    for i, name in enumerate(names):
        learner.add_adapter(name, LoraConfig(rank=16, alpha=32), seed=i)
    rows, length = (2, 64) if quick else (8, 256)
    g = torch.Generator().manual_seed(0)
    data = {}
    for name in names:
        tokens = torch.randint(10, 40000, (rows, length + 1), generator=g).tolist()
        data[name] = [Datum(t[:-1], t[1:], [0.0] * 8 + [1.0] * (length - 8)) for t in tokens]
    adam = AdamParams(learning_rate=1e-4)

    def batched() -> None:
        learner.forward_backward_many(data, "cross_entropy")

    def in_turn() -> None:
        for name in names:
            learner.forward_backward(data[name], "cross_entropy", name)

    times: dict[str, list[float]] = {"batched": [], "in_turn": []}
    for round_ in range(3):
        for key, fn in (("batched", batched), ("in_turn", in_turn)):
            _sync(device)
            start = time.perf_counter()
            fn()
            for name in names:
                learner.optim_step(adam, name)
            _sync(device)
            if round_:  # the first round warms up
                times[key].append(time.perf_counter() - start)
    tokens = len(names) * rows * length
    median = {k: statistics.median(v) for k, v in times.items()}
    version = iter(range(1, 1 << 30))
    sync_ms = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        w = learner.export_adapter("agent0")
        engine.load_adapter(AdapterWeights(AdapterRef("synced", next(version)), w.config, w.flat, w.layout))
        _sync(device)
        sync_ms.append((time.perf_counter() - start) * 1e3)
    return {
        "gpu_learner_batched_vs_in_turn_ratio": median["in_turn"] / median["batched"],
        "gpu_learner_batched_tok_per_s": tokens / median["batched"],
        "gpu_adapter_sync_ms": statistics.median(sync_ms[1:]),
    }


def runtime_figures(device: str, quick: bool) -> dict[str, float]:
    from polytinker.client import ServiceClient
    from polytinker.engine.learner.config import AdamParams
    from polytinker.engine.types import Datum, SamplingParams
    from polytinker.scheduler.service import (
        EngineWorkerConfig,
        LearnerWorkerConfig,
        LocalRuntime,
        RuntimeConfig,
        TenantConfig,
    )

    key = "gpu-benchmark-key-0123456789"
    with tempfile.TemporaryDirectory(prefix="polytinker-gpu-") as tmp:
        config = RuntimeConfig(
            model="tiny-random",
            state_dir=tmp,
            tenants=(TenantConfig("bench", api_key=key),),
            engines=(EngineWorkerConfig(device=device),),
            learners=(LearnerWorkerConfig(device=device),),
            start_timeout_s=300.0,
        )
        with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=key) as service:
            trainer = service.create_lora_training_client("tiny-random", rank=16)
            sampler = trainer.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=1)
            prompt = list(range(100, 120))
            times = []
            for step in range(3 if quick else 6):
                start = time.perf_counter()
                seqs = sampler.sample(prompt, num_samples=8, sampling_params=params).result().sequences
                data = []
                for i, s in enumerate(seqs):
                    tokens = prompt + list(s.tokens)
                    n = len(tokens) - 1
                    done = len(prompt) - 1
                    advantage = 1.0 if i % 2 else -1.0
                    data.append(
                        Datum(
                            tokens[:-1],
                            tokens[1:],
                            [0.0] * done + [1.0] * (n - done),
                            [0.0] * done + [advantage] * (n - done),
                            [0.0] * done + list(s.logprobs),
                        )
                    )
                trainer.forward_backward(data, "importance_sampling").result()
                trainer.optim_step(AdamParams(learning_rate=1e-4)).result()
                sampler = trainer.save_weights_and_get_sampling_client()
                if step:
                    times.append(time.perf_counter() - start)
            stats = service.runtime_status()["stats"]
    return {
        "gpu_runtime_rl_step_s": statistics.median(times),
        "gpu_runtime_engine_batches": stats["engine-0"].get("batches", 0.0),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and steps")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: torch sees no CUDA device (pass --device cpu for a dry run)")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    figures, engine = engine_figures(args.shape, args.device, dtype, args.quick)
    figures.update(learner_figures(args.shape, args.device, dtype, args.quick, engine))
    del engine
    figures.update(runtime_figures(args.device, args.quick))
    for name, value in figures.items():
        print(f"{name}: {value:.4g}", flush=True)
    print(f"# total_s: {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
