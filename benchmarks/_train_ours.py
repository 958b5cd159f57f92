"""polytinker's half of ``benchmarks/train.py``: GRPO on the reference task through the client API.

    python benchmarks/_train_ours.py --steps 30 [--agents 4] [--threads 2]

One ``ServiceClient()`` starts a local runtime (scheduler, one engine, one learner as child
processes, ``--threads`` torch threads each). Each agent is one LoRA training job on the shared
base; its step is: ``SamplingClient.sample`` (8 completions of the prompt in one group), the
advantages and datums of ``polytinker.agents``' GRPO (group-normalised; completions with advantage 0
left out, so a group whose rewards are all equal trains nothing), ``TrainingClient.forward_backward``
with its loss (``importance_sampling``), ``optim_step`` (AdamW with TRL's defaults: betas
0.9/0.999, eps 1e-8, the learning rate decayed linearly to 0), then
``save_weights_and_get_sampling_client`` (the new version to the engine).
With several agents, each runs its loop in its own thread: their sample requests meet in the
engine's mixed batches, their training calls take turns on the one learner.

Prints one JSON line per agent step (reward, tokens, seconds per phase) and a final ``done`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train_task import (
    GROUP_SIZE,
    LEARNING_RATE,
    LORA_ALPHA,
    LORA_RANK,
    MAX_NEW_TOKENS,
    PROMPT,
    SEED,
    TARGET_MODULES,
    linear_lr,
    reward,
)

_print_lock = threading.Lock()


def emit(record: dict[str, Any]) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


def prompt_ids(tokenizer: Any) -> list[int]:
    """The prompt rendered with the chat template and a generation prompt, as TRL renders it."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    if hasattr(ids, "input_ids") or isinstance(ids, dict):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def turn_samples(name: str, step: int, prompt: list[int], sequences: list[Any], rewards_G: list[float]) -> list[Any]:
    """The group's completions as ``polytinker.agents`` turn samples (one single-turn episode each)."""
    from polytinker.agents.types import TurnSample

    return [
        TurnSample(
            agent=name,
            role=name,
            version=step,
            group=f"step{step}",
            episode_id=f"step{step}-{k}",
            turn_index=0,
            prompt_tokens=tuple(prompt),
            completion_tokens=tuple(seq.tokens),
            logprobs_T=tuple(float(x) for x in seq.logprobs),
            reward=r,
            episode_reward=r,
        )
        for k, (seq, r) in enumerate(zip(sequences, rewards_G, strict=True))
    ]


def run_agent(service: Any, name: str, index: int, args: argparse.Namespace, prompt: list[int]) -> None:
    from polytinker.agents.algorithms import make_algorithm
    from polytinker.agents.spec import AlgorithmConfig
    from polytinker.agents.types import AlgorithmName
    from polytinker.engine.learner.config import AdamParams
    from polytinker.engine.types import SamplingParams

    algorithm = make_algorithm(AlgorithmConfig(name=AlgorithmName.GRPO, learning_rate=LEARNING_RATE))

    trainer = service.create_lora_training_client(
        args.model,
        rank=LORA_RANK,
        agent=name,
        alpha=LORA_ALPHA,
        seed=SEED + index,
        target_modules=TARGET_MODULES,
        steps=args.steps,
    )
    t_clock = time.perf_counter() - time.time()  # perf_counter - t_clock: wall-clock time, comparable across processes
    t0 = time.perf_counter()
    sampler = trainer.save_weights_and_get_sampling_client()
    emit({"agent": name, "event": "ready", "setup_s": time.perf_counter() - t0})
    for step in range(args.steps):
        t_step = time.perf_counter()
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED + 1000 * index + step)
        sequences = sampler.sample(prompt, num_samples=GROUP_SIZE, sampling_params=params).result().sequences
        t_sampled = time.perf_counter()
        rewards_G = [reward(s.text) for s in sequences]
        samples = turn_samples(name, step, prompt, sequences, rewards_G)
        # GRPO's batches leave out completions whose advantage is 0 (a uniform group: none at all).
        batches = algorithm.minibatches(samples, algorithm.advantages(samples), seed=SEED + step)
        lr = linear_lr(LEARNING_RATE, step, args.steps)
        t_fb = t_opt = t_sampled
        for batch in batches:
            trainer.forward_backward(batch, algorithm.loss_fn, algorithm.loss_fn_config()).result()
            t_fb = time.perf_counter()
            trainer.optim_step(AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8)).result()
            t_opt = time.perf_counter()
        if batches:
            sampler = trainer.save_weights_and_get_sampling_client()
        t_end = time.perf_counter()
        emit(
            {
                "agent": name,
                "step": step + 1,
                "reward_mean": sum(rewards_G) / len(rewards_G),
                "completion_tokens": sum(len(s.tokens) for s in sequences),
                "trained_completions": sum(len(b) for b in batches),
                "step_s": t_end - t_step,
                "sample_s": t_sampled - t_step,
                "forward_backward_s": t_fb - t_sampled,
                "optim_step_s": t_opt - t_fb,
                "weight_sync_s": t_end - t_opt,
                "t_start": t_step - t_clock,
                "t_end": t_end - t_clock,
            }
        )
    trainer.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--adapter-slots", type=int, default=8, help="the engine's adapter slots (>= agents)")
    parser.add_argument("--learner-batch-max", type=int, default=8, help="forward_backward calls per learner pass")
    args = parser.parse_args()

    # The runtime's workers read it at start. This client process only renders the prompt and sends
    # requests: it imports no torch, as a user's training script needs none.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from polytinker import ServiceClient
    from polytinker.engine.models import load_tokenizer
    from polytinker.scheduler.service.config import EngineWorkerConfig, RuntimeConfig

    prompt = prompt_ids(load_tokenizer(args.model))
    t0 = time.perf_counter()
    runtime = RuntimeConfig(
        model=args.model,
        # The scheduler pins one engine slot per running job: fewer slots than agents refuse the rest.
        engines=(EngineWorkerConfig(adapter_slots=args.adapter_slots),),
        learner_batch_max=args.learner_batch_max,
    )
    with ServiceClient(runtime_config=runtime) as service:
        service.runtime_status()  # starts the local runtime before the agents race to it
        emit({"event": "runtime_up", "startup_s": time.perf_counter() - t0})
        names = [f"agent{i}" for i in range(args.agents)]
        errors: list[BaseException] = []

        def guarded(name: str, index: int) -> None:
            try:
                run_agent(service, name, index, args, prompt)
            except BaseException as exc:
                errors.append(exc)
                raise

        # Daemon threads: an interrupt ends the script (and its runtime) without waiting for their steps.
        threads = [threading.Thread(target=guarded, args=(n, i), name=n, daemon=True) for i, n in enumerate(names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"an agent failed: {errors[0]!r}")
        status = service.runtime_status()
    emit({"event": "done", "runtime_status": status})


if __name__ == "__main__":
    main()
