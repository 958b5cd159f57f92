"""Benchmark of multi-turn training: an episode's turns as one datum against one datum per turn.

    python benchmarks/multiturn.py --quick     # a few minutes
    python benchmarks/multiturn.py
    python benchmarks/multiturn.py --openai --quick   # the same through the OpenAI-compatible door

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

``--openai``: episodes of a tool-using agent written with the ``openai`` package instead, against
a local runtime's ``/v1/chat/completions`` (the default model sampling, temperature 1): each
answer goes back as the message it came as, tool calls get tool results and other answers a user
turn. The gateway continues each episode's calls token for token (``prompt_continues``), so
``polytinker.client.merge_calls`` makes one datum of an episode; the other way is one datum per
call (``call_datum``). Same learner, same alternation. Prints ``openai_multiturn_learner_time_ratio``
(merged over per call, target <= 0.5), ``openai_learner_tokens_merged``,
``openai_learner_tokens_per_call``, ``openai_datums_merged``, ``openai_datums_per_call``,
``openai_calls_per_episode``, ``openai_calls_continued`` (the share of calls after an episode's
first that carry ``prompt_continues``), ``openai_tool_calls`` (calls answered with tool calls) and
``openai_merged_loss_rel_diff``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def time_learner(batches: dict[bool, list[Any]], steps: int) -> tuple[dict[bool, list[float]], dict[bool, float]]:
    """Learner seconds of ``forward_backward`` + ``optim_step`` on each batch (merged: True, not:
    False), alternately, ``steps`` times; and each batch's first loss (same starting weights)."""
    import torch

    from polytinker.engine.learner import AdamParams, MultiAdapterLearner
    from polytinker.engine.models import load_model
    from polytinker.engine.types import LoraConfig

    torch.manual_seed(0)
    model, _ = load_model(MODEL)
    learner = MultiAdapterLearner(model)
    for merge in batches:
        learner.add_adapter(f"merge_{merge}", LoraConfig(rank=16, alpha=32), seed=0)
    first_loss: dict[bool, float] = {}
    times: dict[bool, list[float]] = {merge: [] for merge in batches}
    for _ in range(steps):
        for merge, batch in batches.items():
            t0 = time.perf_counter()
            result = learner.forward_backward(batch, "importance_sampling", f"merge_{merge}")
            learner.optim_step(AdamParams(learning_rate=1e-4), f"merge_{merge}")
            times[merge].append(time.perf_counter() - t0)
            first_loss.setdefault(merge, result.loss)  # both adapters start from the same weights
    return times, first_loss


ADD_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def tool_result(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(int(args.get("a", 0)) + int(args.get("b", 0)))
    except (ValueError, TypeError, AttributeError):
        return "error: add takes two integers a and b"


def openai_episode(client: Any, seed: int, turns: int) -> list[Any]:
    """One episode of a plain ``openai``-client agent: its responses, one a turn."""
    rng = random.Random(seed)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    messages: list[Any] = [
        {"role": "system", "content": "You can call the add tool for arithmetic."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    responses = []
    for turn in range(turns):
        out = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD_TOOL], max_tokens=24, temperature=1.0, seed=seed * 100 + turn
        )
        responses.append(out)
        message = out.choices[0].message
        messages.append(message)  # the answer goes back as it came
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call.function.arguments)})
        if not message.tool_calls:
            messages.append({"role": "user", "content": f"Now add {rng.randint(1, 9)} to that."})
    return responses


def play_openai(episodes: int, turns: int) -> list[list[Any]]:
    """``episodes`` episodes at once against a local runtime's ``/v1`` (one engine, no learner)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from polytinker.gateway import HttpRuntime
    from polytinker.scheduler.service import RuntimeConfig
    from polytinker.scheduler.service.config import HttpConfig

    config = RuntimeConfig(model=MODEL, http=HttpConfig(address="127.0.0.1:0"), learners=(), start_timeout_s=300.0)
    with HttpRuntime(config) as runtime:
        client = openai.OpenAI(base_url=runtime.http_url + "/v1", api_key=runtime.api_key, timeout=600)
        with ThreadPoolExecutor(episodes) as pool:
            return list(pool.map(lambda seed: openai_episode(client, seed, turns), range(episodes)))


def main_openai(quick: bool) -> None:
    from polytinker.client import call_datum, merge_calls
    from polytinker.client._convert import to_datum

    episodes, turns, steps = (3, 3, 2) if quick else (6, 4, 3)
    played = play_openai(episodes, turns)
    rng = np.random.default_rng(0)
    advantages = [
        rng.choice([-1.0, 1.0], size=len(ep)).tolist() for ep in played
    ]  # the learner's cost, whatever the rewards
    merged = [d for ep, adv in zip(played, advantages, strict=True) for d in merge_calls(ep, adv)]
    per_call = [
        call_datum(r, a) for ep, adv in zip(played, advantages, strict=True) for r, a in zip(ep, adv, strict=True)
    ]
    batches = {True: [to_datum(d) for d in merged], False: [to_datum(d) for d in per_call]}
    times, first_loss = time_learner(batches, steps)
    later = [r for ep in played for r in ep[1:]]
    figures = {
        "openai_multiturn_learner_time_ratio": statistics.median(times[True]) / statistics.median(times[False]),
        "openai_learner_s_per_step_merged": statistics.median(times[True]),
        "openai_learner_s_per_step_per_call": statistics.median(times[False]),
        "openai_learner_tokens_merged": sum(d.model_input.length for d in batches[True]),
        "openai_learner_tokens_per_call": sum(d.model_input.length for d in batches[False]),
        "openai_datums_merged": len(batches[True]),
        "openai_datums_per_call": len(batches[False]),
        "openai_calls_per_episode": turns,
        "openai_calls_continued": sum(bool((r.model_extra or {}).get("prompt_continues")) for r in later) / len(later),
        "openai_tool_calls": sum(bool(r.choices[0].message.tool_calls) for ep in played for r in ep),
        "openai_merged_loss_rel_diff": abs(first_loss[True] - first_loss[False]) / abs(first_loss[False]),
    }
    for name, value in figures.items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes and steps")
    parser.add_argument("--openai", action="store_true", help="a tool-using openai-client agent through /v1")
    args = parser.parse_args()
    if args.openai:
        main_openai(args.quick)
        return
    groups, group_size, steps = (2, 2, 2) if args.quick else (4, 4, 3)

    from polytinker.engine.models import load_tokenizer

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

    times, first_loss = time_learner(batches, steps)

    def tokens(merge: bool) -> int:
        return sum(d.model_input.length for d in batches[merge])

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
