"""Colocated worker against a separate engine and learner: memory, step time, version sync.

    python benchmarks/colocate.py --quick          # one RL step each way (about two minutes on 2 cores)
    python benchmarks/colocate.py --steps 3 --model tiny-random

The same two-agent task runs twice in one run, on a local runtime each time: with a separate
engine process and learner process (``colocate = false``), and with one colocated process that
serves both from one copy of the base model (``colocate = true``). Each agent is a LoRA job on
the reference task of ``benchmarks/train.py`` (GRPO: a group of 8 completions of the prompt,
``importance_sampling``, AdamW); the two agents run their steps in threads at once, so their
samples meet in the engine's batches and their training calls take turns on the learner. After a
warm-up step (adapters created, first batches run), ``--steps`` steps are timed.

Printed (``name: value``):

- ``colocated_memory_ratio``: the sum of the worker processes' peak RSS (``VmHWM``; the
  scheduler is left out), colocated over separate (target <= 0.6);
- ``colocated_step_time_ratio``: wall time of the timed steps, colocated over separate
  (target <= 1.0);
- ``colocated_sync_ms`` and ``separate_sync_ms``: from an agent's ``optim_step`` answer to the
  first answered sample of the new version (``save_weights_and_get_sampling_client`` and a
  one-token sample), the mean over agents and steps; ``colocated_hand_over_ms``: the part of a
  colocated step spent handing the version to the engine in memory (snapshot and register);
- the figures behind them (``*_peak_rss_mb``, ``*_step_s``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train_task import GROUP_SIZE, LEARNING_RATE, LORA_ALPHA, LORA_RANK, MAX_NEW_TOKENS, PROMPT, SEED, reward


def _memory_mb(pid: int) -> dict[str, float]:
    """A process's peak RSS (``VmHWM``), its RSS now split into anonymous memory and file pages
    (the model's weights are pages of its safetensors file, mapped), and its proportional set size
    (``Pss``: a page shared by N processes counts 1/N in each)."""
    fields = {"VmHWM": "peak_rss", "RssAnon": "anon", "RssFile": "file", "Pss": "pss"}
    out: dict[str, float] = {}
    for name in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
        for line in Path(name).read_text().splitlines():
            key = line.split(":")[0]
            if key in fields:
                out[fields[key]] = int(line.split()[1]) / 1024
    return out


class Agent:
    """One LoRA job stepping on the reference task (GRPO), timing each step and version sync."""

    def __init__(self, service: Any, model: str, name: str, index: int, prompt: list[int]) -> None:
        from polytinker.agents.algorithms import make_algorithm
        from polytinker.agents.spec import AlgorithmConfig
        from polytinker.agents.types import AlgorithmName

        self.name, self.index, self.prompt = name, index, prompt
        self.algorithm = make_algorithm(AlgorithmConfig(name=AlgorithmName.GRPO, learning_rate=LEARNING_RATE))
        self.trainer = service.create_lora_training_client(
            model, rank=LORA_RANK, agent=name, alpha=LORA_ALPHA, seed=SEED + index
        )
        self.sampler = self.trainer.save_weights_and_get_sampling_client()
        self.sync_s: list[float] = []

    def step(self, step: int) -> None:
        from polytinker.agents.types import TurnSample
        from polytinker.engine.learner.config import AdamParams
        from polytinker.engine.types import SamplingParams

        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED + 1000 * self.index + step)
        seqs = self.sampler.sample(self.prompt, num_samples=GROUP_SIZE, sampling_params=params).result().sequences
        rewards_G = [reward(s.text) for s in seqs]
        # Rewards all equal leave GRPO nothing to train on: a spread keeps every step's work the same.
        rewards_G = [r + 0.01 * k for k, r in enumerate(rewards_G)]
        samples = [
            TurnSample(
                *(self.name, self.name, step, f"step{step}", f"step{step}-{k}", 0),
                prompt_tokens=tuple(self.prompt),
                completion_tokens=tuple(s.tokens),
                logprobs_T=tuple(float(x) for x in s.logprobs),
                reward=r,
                episode_reward=r,
            )
            for k, (s, r) in enumerate(zip(seqs, rewards_G, strict=True))
        ]
        for batch in self.algorithm.minibatches(samples, self.algorithm.advantages(samples), seed=SEED + step):
            self.trainer.forward_backward(batch, self.algorithm.loss_fn, self.algorithm.loss_fn_config()).result()
            self.trainer.optim_step(AdamParams(learning_rate=LEARNING_RATE)).result()
            t0 = time.perf_counter()
            self.sampler = self.trainer.save_weights_and_get_sampling_client()
            one = SamplingParams(max_tokens=1, temperature=1.0, seed=step)
            self.sampler.sample(self.prompt, num_samples=1, sampling_params=one).result()
            self.sync_s.append(time.perf_counter() - t0)


def _steps(agents: list[Agent], steps: range) -> float:
    """The agents' steps in threads at once; wall seconds."""
    errors: list[BaseException] = []

    def run(agent: Agent) -> None:
        try:
            for step in steps:
                agent.step(step)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"an agent failed: {errors[0]!r}")
    return time.perf_counter() - t0


def run_mode(model: str, colocate: bool, steps: int, prompt: list[int]) -> dict[str, float]:
    from polytinker.client import ServiceClient
    from polytinker.scheduler.service import LocalRuntime, RuntimeConfig

    config = RuntimeConfig(model=model, colocate=colocate, start_timeout_s=600.0)
    with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=runtime.api_key) as service:
        agents = [Agent(service, model, f"agent{i}", i, prompt) for i in range(2)]
        _steps(agents, range(1))  # warm-up: first batches, first versions
        for a in agents:
            a.sync_s.clear()
        step_s = _steps(agents, range(1, 1 + steps))
        pids = {a.pid for a in runtime.actors() if a.name != "scheduler" and a.pid}
        memory = [_memory_mb(pid) for pid in pids]
        stats = service.runtime_status()["stats"]
    learner = stats["learner-0"]
    hand_over_ms = 1e3 * learner.get("hand_over_s", 0.0) / max(1, learner.get("handed_over", 0))
    sync = [s for a in agents for s in a.sync_s]
    return {
        "processes": float(len(pids)),
        **{f"{k}_mb": sum(m[k] for m in memory) for k in ("peak_rss", "anon", "file", "pss")},
        "step_s": step_s / steps,
        "sync_ms": 1e3 * statistics.mean(sync),
        "hand_over_ms": hand_over_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed step each way")
    parser.add_argument("--steps", type=int, default=3, help="timed steps each way (--quick: 1)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    steps = 1 if args.quick else args.steps
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from polytinker.engine.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    ids: Any = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    prompt = [int(t) for t in ids]

    separate = run_mode(args.model, False, steps, prompt)
    colocated = run_mode(args.model, True, steps, prompt)
    print(f"model: {args.model}")
    print(f"timed_steps: {steps}")
    for name, result in (("separate", separate), ("colocated", colocated)):
        print(f"{name}_worker_processes: {result['processes']:.0f}")
        for key in ("peak_rss", "anon", "file", "pss"):
            print(f"{name}_{key}_mb: {result[key + '_mb']:.0f}")
        print(f"{name}_step_s: {result['step_s']:.2f}")
        print(f"{name}_sync_ms: {result['sync_ms']:.1f}")
    print(f"colocated_hand_over_ms: {colocated['hand_over_ms']:.1f}")
    print(f"colocated_memory_ratio: {colocated['peak_rss_mb'] / separate['peak_rss_mb']:.3f}")
    print(f"colocated_pss_ratio: {colocated['pss_mb'] / separate['pss_mb']:.3f}")
    print(f"colocated_step_time_ratio: {colocated['step_s'] / separate['step_s']:.3f}")


if __name__ == "__main__":
    main()
