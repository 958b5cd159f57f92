"""Benchmark of multi-turn training: an episode's turns as one datum against one datum per turn.

    python benchmarks/multiturn.py --quick     # a few minutes
    python benchmarks/multiturn.py

Episodes of ``guess_number-v0`` (1..100, 8 guesses: 5 to 8 turns each) are played through the
coordinator by a policy that renders its prompts with the real renderer and tokenizer (history
``"full"``, so each prompt continues the last) and answers a seeded random guess as its
"completion". The same ``TurnSample``s, with the same advantages (random signs), become one batch two ways:
``merge_turns = true`` (one datum per episode) and ``false`` (one per turn, each with the whole
history again). The real learner (SmolLM2-135M-Instruct, LoRA rank 16, fp32) runs
``forward_backward`` + ``optim_step`` on each, alternately, in the same run.

Prints one ``name: value`` line per figure:

- ``multiturn_learner_time_ratio``: learner seconds per step, merged / per-turn (target <= 0.5);
- ``learner_tokens_merged`` and ``learner_tokens_per_turn``: input tokens the learner reads per
  step each way; ``datums_merged``, ``datums_per_turn``; ``turns_per_episode``;
- ``merged_loss_rel_diff``: |loss merged - loss per turn| / |loss per turn| on the first step
  (both adapters start from the same weights): the two batches are the same loss, so this is rounding (~1e-6).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import numpy as np

from polytinker.agents.algorithms import GRPO
from polytinker.agents.render import Renderer
from polytinker.agents.rollout import collect_samples
from polytinker.agents.spec import AlgorithmConfig, RendererConfig
from polytinker.agents.types import Slot, SlotKind
from polytinker.envs import Coordinator, make
from polytinker.envs.types import AgentAction, ModelSample, PolicyInput

MODEL = "smollm2-135m-instruct"


def play(renderer: Renderer, groups: int, group_size: int) -> tuple[list[Any], dict[int, Any]]:
    """Episodes played by a random guesser whose prompts and answers are real tokens."""
    tokenizer = renderer.tokenizer

    def policy(agent: str, inp: PolicyInput) -> AgentAction:
        rng = random.Random(f"{inp.episode_id}/{len(inp.history)}")
        text = f" {rng.randint(1, 100)}"
        prompt = renderer.prompt_tokens(inp)
        completion = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        logprobs = tuple(-1.0 for _ in completion)
        return AgentAction(text, sample=ModelSample(agent, 0, tuple(prompt), tuple(completion), logprobs))

    seeds = [g for g in range(groups) for _ in range(group_size)]
    results = asyncio.run(
        Coordinator().run(lambda: make("guess_number-v0", high=100, max_guesses=8), policy, seeds=seeds)
    )
    slots = {seed: {"player_0": Slot(SlotKind.LEARNER, "player_0")} for seed in set(seeds)}
    return results, slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes and steps")
    args = parser.parse_args()
    groups, group_size, steps = (2, 2, 2) if args.quick else (4, 4, 3)

    import torch

    from polytinker.engine.learner import AdamParams, MultiAdapterLearner
    from polytinker.engine.models import load_model, load_tokenizer
    from polytinker.engine.types import LoraConfig

    torch.manual_seed(0)
    renderer = Renderer(load_tokenizer(MODEL), RendererConfig(history="full", answer_prefix="My guess:"))
    results, slots = play(renderer, groups, group_size)
    samples = collect_samples(results, slots)["player_0"]
    # Every turn gets a nonzero advantage (a random guesser rarely wins, so GRPO's would mostly
    # be 0): the figure is the learner's cost of a batch, whatever the rewards.
    advantages_N = np.random.default_rng(0).choice([-1.0, 1.0], size=len(samples))
    batches = {}
    for merge in (True, False):
        algorithm = GRPO(AlgorithmConfig(merge_turns=merge))
        (batches[merge],) = algorithm.minibatches(samples, advantages_N, seed=0)

    model, _ = load_model(MODEL)
    learner = MultiAdapterLearner(model)
    for merge in (True, False):
        learner.add_adapter(f"merge_{merge}", LoraConfig(rank=16, alpha=32), seed=0)
    first_loss: dict[bool, float] = {}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for merge, batch in batches.items():
            t0 = time.perf_counter()
            result = learner.forward_backward(batch, "importance_sampling", f"merge_{merge}")
            learner.optim_step(AdamParams(learning_rate=1e-4), f"merge_{merge}")
            times[merge].append(time.perf_counter() - t0)
            first_loss.setdefault(merge, result.loss)  # both adapters start from the same weights

    def tokens(merge: bool) -> int:
        return sum(len(d.input_tokens) for d in batches[merge])

    figures = {
        "multiturn_learner_time_ratio": statistics.median(times[True]) / statistics.median(times[False]),
        "learner_s_per_step_merged": statistics.median(times[True]),
        "learner_s_per_step_per_turn": statistics.median(times[False]),
        "learner_tokens_merged": tokens(True),
        "learner_tokens_per_turn": tokens(False),
        "datums_merged": len(batches[True]),
        "datums_per_turn": len(batches[False]),
        "turns_per_episode": len(samples) / len(results),
        "merged_loss_rel_diff": abs(first_loss[True] - first_loss[False]) / abs(first_loss[False]),
    }
    for name, value in figures.items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")


if __name__ == "__main__":
    main()
