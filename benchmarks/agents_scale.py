"""The cost curve of many agents on one base model: 1, 4 and 16 agents on SmolLM2-135M-Instruct,
1 and 64 on the tiny-random model.

    python benchmarks/agents_scale.py --quick      # 2 steps per agent (449 s on 2 shared cores)
    python benchmarks/agents_scale.py              # 4 steps per agent

Two sections, each against its own one-agent baseline measured in the same run:

- **runtime**: ``benchmarks/_train_ours.py --agents N`` (GRPO on the reference task through the
  client API; one local runtime: scheduler, one engine, one learner; each agent a LoRA training
  job of rank 16 on all linear projections, its loop in its own thread), with the engine's adapter
  slots and the learner's pass sized for N (what ``Experiment`` gives a local runtime). The
  process tree's RSS is sampled (psutil) and its per-process peaks summed.
- **engine**: one ``InferenceEngine`` on the hf backend in this process; each of N agents submits
  one group (8 completions of 16 tokens, ``ignore_eos``) at once, so their rows meet in mixed
  batches; also N = 16 with the engine's default 8 slots, which thrash.

Printed (``name: value``):

- ``cost_per_agent_step_N_vs_1``: wall seconds per agent-step (from the first step's start to the
  last step's end, divided by N x steps), N agents against one (target <= 0.5 at 16);
- ``memory_per_added_agent_mb``: (peak RSS with N agents - with one) / (N - 1), and
  ``adapter_and_optimizer_mb``: what one agent must add: its adapter's fp32 parameters, their
  gradient and AdamW's two moments in the learner, and the engine's copy (5 x parameters x 4 B);
  ``memory_per_added_agent_ratio_N``: the two divided (target <= 1.5);
- ``sampling_tok_s_N_vs_1``: generated tokens per second, N agents' groups in mixed batches
  against one agent's group (target >= 2.0 at 16); ``evictions_N`` and, with 8 slots,
  ``evictions_16_at_8_slots`` and ``sampling_tok_s_16_at_8_slots_vs_1``;
- the absolute figures behind each ratio, and each process's peak (``peak_rss_mib_<actor>_N``: the
  benchmark's client is ``main``, the runtime's actors by name).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _train_task import GROUP_SIZE, LORA_ALPHA, LORA_RANK, MAX_NEW_TOKENS, TARGET_MODULES  # noqa: E402
from train import Run, run_processes  # noqa: E402

SMOL = "smollm2-135m-instruct"
TINY = "tiny-random"
# (model, agent counts): each model's first count is its baseline.
CURVES = ((SMOL, (1, 4, 16)), (TINY, (1, 64)))
DEFAULT_SLOTS = 8  # the engine's default adapter slots (EngineWorkerConfig.adapter_slots)


def log(msg: str) -> None:
    print(f"[agents_scale.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


# --- runtime: agent steps and memory --------------------------------------------------------------
def run_agents(model: str, agents: int, steps: int, threads: int, timeout_s: float) -> Run:
    command = [sys.executable, str(HERE / "_train_ours.py"), "--model", model, "--agents", str(agents)]
    command += ["--steps", str(steps), "--threads", str(threads)]
    command += ["--adapter-slots", str(max(DEFAULT_SLOTS, 2 * agents)), "--learner-batch-max", str(max(8, agents))]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    run = run_processes([command], env, timeout_s)
    done = run.steps()
    if len(done) != agents * steps:
        raise SystemExit(f"{agents} agents on {model}: {len(done)} of {agents * steps} agent steps reported")
    return run


def s_per_agent_step(run: Run, agents: int, steps: int) -> float:
    records = run.steps()
    window = max(r["t_end"] for r in records) - min(r["t_start"] for r in records)
    return window / (agents * steps)


def adapter_and_optimizer_mb(model: Any) -> float:
    """5 fp32 copies of one adapter's parameters: weights, gradient, AdamW's two moments, engine."""
    from torch import nn

    params = sum(
        LORA_RANK * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES
    )
    return 5 * params * 4 / 2**20


# --- engine: mixed batches ------------------------------------------------------------------------
def sampling_tok_s(engine: Any, refs: list[Any], prompt: list[int], rounds: int) -> float:
    """Every agent's group at once; the best of ``rounds`` (load from other processes comes and goes)."""
    from polytinker.engine.types import SampleRequest, SamplingParams

    best = 0.0
    for k in range(rounds):
        requests = [
            SampleRequest(
                prompt_token_ids=tuple(prompt),
                adapter=ref,
                params=SamplingParams(max_tokens=MAX_NEW_TOKENS, seed=k * 1000 + i, ignore_eos=True),
                num_samples=GROUP_SIZE,
            )
            for i, ref in enumerate(refs)
        ]
        start = time.perf_counter()
        futures = [engine.submit(r) for r in requests]
        tokens = sum(len(s.token_ids) for f in futures for s in f.result().sequences)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def engine_section(model: str, counts: tuple[int, ...], rounds: int) -> tuple[dict[str, float], float]:
    """Sampling figures per agent count, and the model's adapter_and_optimizer_mb."""
    from polytinker.engine.inference import EngineConfig, HFBackend, InferenceEngine, random_adapter
    from polytinker.engine.inference.config import HFBackendConfig
    from polytinker.engine.types import AdapterRef, LoraConfig

    backend = HFBackend(HFBackendConfig(model=model))
    mb = adapter_and_optimizer_mb(backend.model)  # before the engine wraps the linear layers
    lora = LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=TARGET_MODULES)
    prompt = backend.tokenizer.encode("Pick a number from 1 to 10. Answer with just the number.")
    out: dict[str, float] = {}
    settings = [(n, max(DEFAULT_SLOTS, 2 * n)) for n in counts]
    if 16 in counts:
        settings.append((16, DEFAULT_SLOTS))
    for agents, slots in settings:
        engine = InferenceEngine(backend, EngineConfig(batch_window_s=0.05, max_resident_adapters=slots))
        refs = [AdapterRef(f"agent{i}", 1) for i in range(agents)]
        for i, ref in enumerate(refs):
            engine.load_adapter(random_adapter(backend.model, ref, lora, seed=i, scale=0.01))
        sampling_tok_s(engine, refs[:1], prompt, 1)  # warm-up: first-call allocations
        suffix = f"{agents}" if slots != DEFAULT_SLOTS or agents < DEFAULT_SLOTS else f"{agents}_at_{slots}_slots"
        before = engine.slots.evictions
        out[f"sampling_tok_s_{suffix}"] = sampling_tok_s(engine, refs, prompt, rounds)
        out[f"evictions_{suffix}"] = float(engine.slots.evictions - before)
        out[f"batches_{suffix}"] = float(len(engine.stats.batch_sizes))
        engine.close(close_backend=False)
        for ref in backend.loaded_adapters():
            backend.unload_adapter(ref)
    backend.close()
    return out, mb


# --- the benchmark --------------------------------------------------------------------------------
def measure(model: str, counts: tuple[int, ...], steps: int, args: argparse.Namespace) -> list[tuple[str, str]]:
    log(f"{model}: engine, {counts} agents")
    sampling, mb = engine_section(model, counts, rounds=1 if args.quick else 3)
    runs: dict[int, Run] = {}
    for n in counts:
        log(f"{model}: runtime, {n} agents x {steps} steps")
        runs[n] = run_agents(model, n, steps, args.threads, args.timeout_s)
    base = counts[0]
    base_s = s_per_agent_step(runs[base], base, steps)
    tag = "" if model == SMOL else "_tiny"
    out = [(f"adapter_and_optimizer_mb{tag}", fmt(mb, 2))]
    for n in counts[1:]:
        per_step = s_per_agent_step(runs[n], n, steps)
        added = (runs[n].peak_mib - runs[base].peak_mib) / (n - base)
        out += [
            (f"cost_per_agent_step_{n}_vs_1{tag}", fmt(per_step / base_s)),
            (f"memory_per_added_agent_mb_{n}{tag}", fmt(added, 2)),
            (f"memory_per_added_agent_ratio_{n}{tag}", fmt(added / mb, 2)),
            (f"sampling_tok_s_{n}_vs_1{tag}", fmt(sampling[f"sampling_tok_s_{n}"] / sampling["sampling_tok_s_1"])),
        ]
    if f"sampling_tok_s_16_at_{DEFAULT_SLOTS}_slots" in sampling:
        ratio = sampling[f"sampling_tok_s_16_at_{DEFAULT_SLOTS}_slots"] / sampling["sampling_tok_s_1"]
        out.append((f"sampling_tok_s_16_at_{DEFAULT_SLOTS}_slots_vs_1{tag}", fmt(ratio)))
    for n in counts:
        out += [
            (f"s_per_agent_step_{n}{tag}", fmt(s_per_agent_step(runs[n], n, steps), 2)),
            (f"peak_rss_mib_{n}{tag}", fmt(runs[n].peak_mib, 0)),
        ]
        # Where the peaks are: the client ("main"), the scheduler, the engine, the learner.
        by_label = sorted(runs[n].peak_mib_by_label().items())
        out += [(f"peak_rss_mib_{label}_{n}{tag}", fmt(mib, 0)) for label, mib in by_label]
    out += [(f"{k}{tag}", fmt(v, 1)) for k, v in sampling.items()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps per agent, one sampling round")
    parser.add_argument("--steps", type=int, default=None, help="steps per agent (default 4, --quick 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-tiny", action="store_true", help="leave out the 64 agents on tiny-random")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per runtime run")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # Threads that wait for work spin briefly, then sleep, as the runtime's workers do: on cores
    # other processes share, a spinning thread holds a core a busy peer needs. (This import loads no
    # torch: OpenMP reads these when torch loads.)
    from polytinker.engine.worker.server import omp_wait_env

    os.environ.update(omp_wait_env(os.environ))
    import torch

    torch.set_num_threads(args.threads)
    steps = args.steps or (2 if args.quick else 4)
    start = time.perf_counter()
    for model, counts in CURVES:
        if model == TINY and args.no_tiny:
            continue
        for name, value in measure(model, counts, steps, args):
            print(f"{name}: {value}", flush=True)
    print(f"wall_s: {time.perf_counter() - start:.0f}", flush=True)


if __name__ == "__main__":
    main()
