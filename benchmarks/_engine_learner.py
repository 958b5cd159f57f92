"""Learner figures of the engine benchmark (``benchmarks/engine.py`` imports :func:`run`).

Real model (SmolLM2-135M-Instruct), fp32, LoRA rank 16, alpha 32, on every linear projection.

- ``learner_memory_ratio``: peak RSS of one learner process stepping 4 adapters over one base
  model, divided by the summed peak RSS of 4 processes each stepping one adapter on its own model
  copy (target <= 0.4).
- ``learner_throughput_ratio``: trained tokens/s of that shared learner, divided by the tokens/s
  of the 4 separate processes run concurrently on the same total work (target >= 0.9). The shared
  learner trains the 4 adapters in shared micro-batches (``forward_backward_many``), so the base
  model's matmuls see 4x the rows; ``learner_throughput_ratio_per_adapter_calls`` is the same
  learner with one ``forward_backward`` per adapter. Each
  worker loads and warms up first; all start their timed loop together, which runs 4 rounds
  (each worker reports every round's seconds as ``step_s``; over one round, the processes'
  start skew weighed as much as the work). The shared learner gets
  ``min(4, cores)`` threads, each separate process ``max(1, cores // 4)``: the same machine either way.
  On a machine shared with other work the two phases see different load, and 4 single-thread
  processes win more time slices than one 2-thread process; ``learner_cpu_throughput_ratio``
  (tokens per CPU-second, shared over separate) is the load-independent form of the same comparison.
- ``adapter_sync_ms``: a new adapter version from the learner to an engine: ``export_adapter``
  (one copy of the adapter's flat buffer into a snapshot, as the learner worker's reply makes),
  the transport codec's encode and decode of the ``AdapterTensors`` message a learner answers
  with (the buffer out of band, what crosses a process boundary), the HF engine's
  ``load_adapter`` of that new version (served from the buffer it came in: views, no copy), and
  the unloading of the version before. Median of 30 versions after 10 warm ones: the first
  versions settle gradually (a run here: 4.9, 2.9, 2.6, 2.3, 2.2, 2.0 ms, then 1.7-1.9 from the
  twelfth on, the export's copy going from 3.4 to 0.9 ms), and a training loop syncs every step.
- ``adapter_sync_vs_memcpy_ratio``: that time over one ``copy_`` of the same number of bytes
  between two buffers copied again and again (``memcpy_ms``; target <= 3: the copy and the
  bookkeeping). Copied back to back, those two buffers stay in the cache; the syncs' buffers, two
  of them in turn and 2 ms apart, partly do not: a copy right after 1 ms of pure Python took 1.0 ms
  against 0.77 back to back here (2.3 against 1.8 on one thread). ``adapter_export_ms`` and
  ``adapter_engine_load_ms`` split the sync: the learner's part and the engine's.
- ``adapter_sync_vs_memcpy_ratio_cold``: both measured from the same cache state, each sync and
  each memcpy timed once right after a sweep over 256 MiB of other memory, taking turns
  (``adapter_sync_cold_ms``, ``memcpy_cold_ms``): the state a version leaves the learner in after a
  training step.
- ``colocated_sync_ms``: the colocated alternative (engine and learner sharing one model in one
  process): copying the trained adapter into a serving slot of the same peft model, which is all
  a colocated engine needs so in-flight requests keep their version. No export, no second model.

Peaks are ``ru_maxrss`` of worker subprocesses. Run alone: ``python benchmarks/_engine_learner.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

N_ADAPTERS = 4
MODEL = "smollm2-135m-instruct"


def _data(batch: int, seq_len: int, seed: int) -> list[Any]:
    import torch

    from polytinker.engine.types import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        tokens = torch.randint(10, 40000, (seq_len + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 8 + [1.0] * (seq_len - 8)))
    return out


def _worker(spec: dict[str, Any]) -> None:
    """One training process: load, warm up, say ready, wait for go, train, report."""
    import torch

    torch.set_num_threads(spec["threads"])
    from polytinker.engine.learner import AdamParams, LearnerConfig, MultiAdapterLearner
    from polytinker.engine.models import load_model
    from polytinker.engine.types import LoraConfig

    model, _ = load_model(MODEL)
    # The default LearnerConfig in every worker, as the runtime runs it: its micro-batch (8 rows)
    # holds one separate process's whole batch and the shared learner's 4 adapters' rows at the
    # quick sizes (2 micro-batches at the full sizes). A micro-batch of one adapter's batch made
    # the shared pass 4 small passes, with nothing batched.
    learner = MultiAdapterLearner(model, LearnerConfig())
    names = [f"agent{i}" for i in range(spec["adapters"])]
    for i, name in enumerate(names):
        learner.add_adapter(name, LoraConfig(rank=16, alpha=32), seed=i)
    # Each agent its own rows (as agents' episodes are): the same seeds in the shared learner and
    # in the separate processes, so both train on the same work.
    data = {name: _data(spec["batch"], spec["seq_len"], seed=spec["seed"] + i) for i, name in enumerate(names)}
    adam = AdamParams(learning_rate=1e-4)

    def train_round(mixed: bool) -> None:
        if mixed:  # all adapters' rows in shared micro-batches
            learner.forward_backward_many(data, "cross_entropy")
        else:
            for name in names:
                learner.forward_backward(data[name], "cross_entropy", name)
        for name in names:
            learner.optim_step(adam, name)

    loops = {"per_adapter": False, "mixed": True} if len(names) > 1 else {"per_adapter": False}
    for mixed in loops.values():  # warm-up: allocator, optimizer state, peak activations
        train_round(mixed)
    print("ready", flush=True)
    sys.stdin.readline()
    report: dict[str, Any] = {}
    for loop, mixed in loops.items():
        t0, c0 = time.time(), time.process_time()
        ends = []
        for _ in range(spec["steps"]):
            train_round(mixed)
            ends.append(time.time())
        t1, c1 = time.time(), time.process_time()
        tokens = spec["steps"] * len(names) * spec["batch"] * spec["seq_len"]
        step_s = [b - a for a, b in zip([t0, *ends], ends, strict=False)]
        report[loop] = {"t0": t0, "t1": t1, "cpu_s": c1 - c0, "tokens": tokens, "step_s": step_s}
    report["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(report), flush=True)


def _run_workers(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Several processes: PASSIVE (OpenMP threads sleep instead of spinning while they wait), or
    # their spinning threads starve each other (10x slower, measured here). One process keeps the
    # default: PASSIVE's wake-ups cost a lone 2-thread learner 2.5x at the quick sizes.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if len(specs) > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "OMP_NUM_THREADS": str(s["threads"])},
        )
        for s in specs
    ]
    try:
        for p in procs:  # everyone loaded and warm before anyone is timed
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"learner benchmark worker failed to start (said {line!r})")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            assert p.stdout is not None
            reports.append(json.loads(p.stdout.readline()))
            p.wait(timeout=60)
        return reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _tok_per_s(reports: list[dict[str, Any]], loop: str) -> float:
    wall = max(r[loop]["t1"] for r in reports) - min(r[loop]["t0"] for r in reports)
    return sum(r[loop]["tokens"] for r in reports) / wall


def _tok_per_cpu_s(reports: list[dict[str, Any]], loop: str) -> float:
    return sum(r[loop]["tokens"] for r in reports) / sum(r[loop]["cpu_s"] for r in reports)


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


# Other memory traffic before each cold measurement: a training step moves far more than this, and
# 64 MiB already left neither the sync's buffers nor the memcpy's in this machine's cache.
_SWEEP_BYTES = 256 << 20


def _cold_medians_ms(ops: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median ms of each op, each timed once right after a sweep over ``_SWEEP_BYTES`` of other
    memory, the ops taking turns: every op starts from the same cache state, the one a version
    sync starts from after a training step."""
    import torch

    sweep = torch.zeros(_SWEEP_BYTES, dtype=torch.uint8)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            sweep.add_(1)
            times[name].append(_median_ms(fn, 1))
    return {name: statistics.median(t) for name, t in times.items()}


def measure_sync(repeats: int) -> dict[str, float]:
    """Learner -> engine adapter sync (separate models) vs memcpy, and the colocated copy."""
    import torch

    from polytinker.engine.inference.hf import HFBackend
    from polytinker.engine.learner import AdamParams, MultiAdapterLearner
    from polytinker.engine.models import load_model
    from polytinker.engine.types import AdapterRef, LoraConfig
    from polytinker.scheduler.service.replies import AdapterTensors
    from polytinker.transport.codec import decode, encode

    model, tokenizer = load_model(MODEL)
    learner = MultiAdapterLearner(model)
    lora = LoraConfig(rank=16, alpha=32)
    learner.add_adapter("alice", lora, seed=0)
    learner.forward_backward(_data(1, 32, seed=1), "cross_entropy", "alice")
    learner.optim_step(AdamParams(), "alice")
    engine = HFBackend(model=load_model(MODEL)[0], tokenizer=tokenizer)
    version = iter(range(1, 1 << 30))
    parts: dict[str, list[float]] = {"export": [], "load": []}

    def sync() -> None:
        t0 = time.perf_counter()
        w = learner.export_adapter("alice")
        t1 = time.perf_counter()
        received: AdapterTensors = decode(encode(AdapterTensors.of(w)))
        ref = AdapterRef("alice", next(version))
        t2 = time.perf_counter()
        engine.load_adapter(received.weights(ref))
        parts["export"].append((t1 - t0) * 1e3)
        parts["load"].append((time.perf_counter() - t2) * 1e3)
        if ref.version > 1:  # the previous version leaves, so residency stays constant across repeats
            engine.unload_adapter(AdapterRef("alice", ref.version - 1))

    for _ in range(10):  # warm: the first adapter wraps the engine model; the snapshot pool fills; copies settle
        sync()
    parts = {"export": [], "load": []}
    sync_ms = _median_ms(sync, repeats)
    export_ms, load_ms = statistics.median(parts["export"]), statistics.median(parts["load"])
    nbytes = learner.export_adapter("alice").nbytes()
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    memcpy_ms = _median_ms(lambda: dst.copy_(src), repeats * 4)
    cold = _cold_medians_ms({"sync": sync, "memcpy": lambda: dst.copy_(src)}, repeats)
    colocated_ms = _colocated_copy_ms(learner, lora, repeats)
    return {
        "adapter_sync_ms": sync_ms,
        "adapter_sync_vs_memcpy_ratio": sync_ms / memcpy_ms,
        "memcpy_ms": memcpy_ms,
        "adapter_sync_cold_ms": cold["sync"],
        "memcpy_cold_ms": cold["memcpy"],
        "adapter_sync_vs_memcpy_ratio_cold": cold["sync"] / cold["memcpy"],
        "adapter_sync_mb": nbytes / 1e6,
        "adapter_export_ms": export_ms,
        "adapter_engine_load_ms": load_ms,
        "colocated_sync_ms": colocated_ms,
    }


def _colocated_copy_ms(learner: Any, lora: Any, repeats: int) -> float:
    import torch

    learner.add_adapter("alice_serve", lora)
    src = learner._slot("alice").params
    dst = learner._slot("alice_serve").params
    pairs = [(dst[k.replace(".alice.", ".alice_serve.")], v) for k, v in src.items()]

    def copy() -> None:
        with torch.no_grad():
            for d, s in pairs:
                d.copy_(s)

    copy()
    return _median_ms(copy, repeats)


def run(quick: bool = False) -> dict[str, float]:
    cores = os.cpu_count() or 2
    batch, seq_len, steps = (2, 32, 4) if quick else (4, 128, 4)
    base = {"batch": batch, "seq_len": seq_len, "steps": steps}
    shared = _run_workers([{**base, "adapters": N_ADAPTERS, "threads": min(4, cores), "seed": 0}])
    separate = _run_workers(
        [{**base, "adapters": 1, "threads": max(1, cores // N_ADAPTERS), "seed": i} for i in range(N_ADAPTERS)]
    )
    separate_tps, separate_cpu = _tok_per_s(separate, "per_adapter"), _tok_per_cpu_s(separate, "per_adapter")
    shared_peak, separate_peak = shared[0]["maxrss_bytes"], sum(r["maxrss_bytes"] for r in separate)
    results = {
        "learner_memory_ratio": shared_peak / separate_peak,
        "learner_throughput_ratio": _tok_per_s(shared, "mixed") / separate_tps,
        "learner_cpu_throughput_ratio": _tok_per_cpu_s(shared, "mixed") / separate_cpu,
        "learner_throughput_ratio_per_adapter_calls": _tok_per_s(shared, "per_adapter") / separate_tps,
        "learner_shared_tok_per_s": _tok_per_s(shared, "mixed"),
        "learner_separate_tok_per_s": separate_tps,
        "learner_shared_peak_mb": shared_peak / 1e6,
        "learner_separate_peak_mb_sum": separate_peak / 1e6,
    }
    results.update(measure_sync(repeats=30))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: under a minute on 2 cores")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    for name, value in run(quick=args.quick).items():
        print(f"{name}: {value:.4g}")


if __name__ == "__main__":
    main()
