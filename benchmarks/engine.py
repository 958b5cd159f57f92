"""Engine benchmark: many LoRA adapters in one mixed batch on the real default model.

Every figure is measured in this run, on the same model and requests:

- ``mixed_vs_single_ratio``: tokens/s of N requests spread over 4 adapters in one mixed batch,
  over the same requests all on one adapter (target >= 0.9: mixing adapters is nearly free);
- ``mixed16_vs_single_ratio``: the same over 16 adapters (what many agents on one base need:
  the batched LoRA products keep an adapter's extra cost flat; target >= 0.9);
- ``mixed_vs_sequential_ratio``: the mixed batch over the same requests served adapter by
  adapter, one batch each (target >= 2: why an engine serves adapters together);
- ``hf_tok_per_s``: the mixed batch's generated tokens per second;
- ``hf_share_of_roofline``: that rate over this machine's limit for the batch
  (``roofline_tok_per_s``: each decode step reads every weight, at the memory bandwidth measured
  here, and does two FLOPs per weight and row, at the matmul speed measured here; the slower
  bound counts), with ``memory_bandwidth_gb_per_s``, ``matmul_gflop_per_s`` and
  ``decode_step_floor_ms``;
- each of the three is the best of ``ROUNDS`` interleaved rounds;
- ``engine_tok_per_s`` / ``engine_batches``: the same requests submitted one by one to an
  InferenceEngine, which merges them by dynamic batching.

Sections from ``_engine_clients.py`` (``concurrent_clients_sampling_ratio``: four clients
sampling at once through the runtime, over one), ``contention.py`` (``contended_cpu_s_per_step_ratio``
and ``contended_sampling_slowdown``: a runtime's training step and warm sample with busy processes on
every core, over quiet), ``_engine_learner.py``, ``_engine_runtime.py`` and
``_engine_vllm.py`` next to this file (each with ``run(quick: bool) -> dict[str, float]``) are run
and printed when present.

    python benchmarks/engine.py [--quick] [--only hf|clients|contention|learner|runtime|vllm] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

SECTIONS = ("hf", "clients", "contention", "learner", "runtime", "vllm")
# Sections whose module is not ``_engine_<name>.py`` with ``run``: (file, function).
OTHER_SECTIONS = {"contention": ("contention.py", "measure_contention")}
ADAPTERS = 4
MANY_ADAPTERS = 16
ROUNDS = 2


def _requests(tokenizer: Any, count: int, new_tokens: int, adapters: list[Any]) -> list[Any]:
    from polytinker.engine.types import SampleRequest, SamplingParams

    # ignore_eos: every request generates exactly new_tokens, so all runs do the same work.
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    return [
        SampleRequest(
            prompt_token_ids=tuple(tokenizer.encode(f"Once upon a time, in story number {i}, there was")),
            adapter=adapters[i % len(adapters)] if adapters else None,
            params=params,
        )
        for i in range(count)
    ]


def _timed(backend: Any, batches: list[list[Any]]) -> float:
    """Tokens per second over the batches, served one after another."""
    start = time.perf_counter()
    tokens = sum(len(s.token_ids) for batch in batches for r in backend.sample(batch) for s in r.sequences)
    return tokens / (time.perf_counter() - start)


def _machine_limits() -> tuple[float, float]:
    """This machine's memory bandwidth (bytes/s: a 256 MB copy, read and written) and matmul
    speed (FLOP/s: float32, at torch's thread count), each the best of three."""
    src, dst = torch.ones(1 << 26), torch.empty(1 << 26)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    copy_s = matmul_s = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        copy_s = min(copy_s, time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        matmul_s = min(matmul_s, (time.perf_counter() - start) / 4)
    return 2 * src.numel() * 4 / copy_s, 2 * 1024**3 / matmul_s


def roofline(model: Any, rows: int) -> dict[str, float]:
    """How fast a decode step of ``rows`` sequences could be here: it reads every weight once
    (bytes over the memory bandwidth) and does two FLOPs per weight and row (over the matmul
    speed); the slower of the two bounds the tokens per second."""
    bandwidth, flops = _machine_limits()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step_s = max(weight_bytes / bandwidth, 2 * params * rows / flops)
    return {
        "memory_bandwidth_gb_per_s": bandwidth / 1e9,
        "matmul_gflop_per_s": flops / 1e9,
        "decode_step_floor_ms": step_s * 1000,
        "roofline_tok_per_s": rows / step_s,
    }


def run_hf(quick: bool) -> dict[str, float]:
    from dataclasses import replace

    from polytinker.engine.inference import EngineConfig, HFBackend, InferenceEngine, random_adapter
    from polytinker.engine.types import AdapterRef

    count, new_tokens = (16, 16) if quick else (64, 64)
    backend = HFBackend()
    many = [AdapterRef(f"agent{i}") for i in range(MANY_ADAPTERS)]
    refs = many[:ADAPTERS]
    adapters = [random_adapter(backend.model, ref, seed=i, scale=0.01) for i, ref in enumerate(many)]
    for weights in adapters:
        backend.load_adapter(weights)
    mixed = _requests(backend.tokenizer, count, new_tokens, refs)
    single = [replace(r, adapter=refs[0]) for r in mixed]
    mixed_many = [replace(r, adapter=many[i % MANY_ADAPTERS]) for i, r in enumerate(mixed)]
    by_adapter = [[r for r in mixed if r.adapter == ref] for ref in refs]
    _timed(backend, [mixed[: ADAPTERS * 2]])  # warm-up: first-call allocations, lazy inits
    figures = {"hf_requests": float(count), "hf_new_tokens": float(new_tokens)}
    # The four ways are interleaved and each keeps its best round, so that load from other
    # processes that comes and goes does not favour whichever ran in a quiet moment.
    best = {"hf_tok_per_s": 0.0, "single_adapter_tok_per_s": 0.0, "sequential_tok_per_s": 0.0, "mixed16_tok_per_s": 0.0}
    for _ in range(ROUNDS):
        for key, batches in zip(best, ([mixed], [single], by_adapter, [mixed_many]), strict=True):
            best[key] = max(best[key], _timed(backend, batches))
    figures.update(best)
    figures["mixed_vs_single_ratio"] = figures["hf_tok_per_s"] / figures["single_adapter_tok_per_s"]
    figures["mixed16_vs_single_ratio"] = figures["mixed16_tok_per_s"] / figures["single_adapter_tok_per_s"]
    figures["mixed_vs_sequential_ratio"] = figures["hf_tok_per_s"] / figures["sequential_tok_per_s"]
    figures.update(roofline(backend.model, count))
    figures["hf_share_of_roofline"] = figures["hf_tok_per_s"] / figures["roofline_tok_per_s"]
    engine = InferenceEngine(backend, EngineConfig(batch_window_s=0.05, max_batch_size=count))
    for weights in adapters[:ADAPTERS]:
        engine.load_adapter(weights)
    start = time.perf_counter()
    futures = [engine.submit(r) for r in mixed]
    tokens = sum(len(s.token_ids) for f in futures for s in f.result().sequences)
    figures["engine_tok_per_s"] = tokens / (time.perf_counter() - start)
    figures["engine_batches"] = float(len(engine.stats.batch_sizes))
    engine.close()
    return figures


def _load_section(name: str) -> Any:
    """The section's ``run(quick) -> figures``, or None when its module is not present."""
    filename, function = OTHER_SECTIONS.get(name, (f"_engine_{name}.py", "run"))
    path = Path(__file__).with_name(filename)
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: under 60 s on 2 cores")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    parser.add_argument(
        "--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads (1 where cores are busy)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    start = time.perf_counter()
    for section in args.only or SECTIONS:
        if section == "hf":
            figures = run_hf(args.quick)
        else:
            run = _load_section(section)
            if run is None:
                print(f"# {section}: skipped (its module is not present in benchmarks/)")
                continue
            try:
                figures = run(args.quick)
            except Exception as exc:  # one section failing must not hide the others' figures
                print(f"# {section}: skipped ({type(exc).__name__}: {exc})")
                continue
        print(f"# {section}")
        for name, value in figures.items():
            print(f"{name}: {value:.4g}")
    print(f"# total_s: {time.perf_counter() - start:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
