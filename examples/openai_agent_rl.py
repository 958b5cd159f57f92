"""An agent written with the ``openai`` package, trained with the official ``tinker`` SDK: both
against one ``polytinker serve --http``.

The agent is plain OpenAI client code: it asks ``/v1/chat/completions`` to "pick a number from
1 to 10" (``n`` answers per step) from the current version of its adapter (``model`` is the
version's ``tinker://.../sampler_weights/...`` path). Each answer carries the token ids and the
sampler's logprobs (polytinker's extension fields), so the training half needs no tokenizing:
GRPO advantages over the group (reward 1 for 7, less the further off), one ``importance_sampling``
step through the tinker SDK, and the next step samples the new version.

    polytinker serve --http 127.0.0.1:8000                 # in another shell
    export TINKER_API_KEY=$(cat polytinker-runtime/local.api_key)
    python examples/openai_agent_rl.py --base-url http://127.0.0.1:8000 --steps 10
"""

from __future__ import annotations

import argparse
import math
import os
import re

import openai
import tinker
from tinker import types

PROMPT = "Pick a number from 1 to 10. Answer with just the number."


def reward(text: str) -> float:
    match = re.search(r"-?\d+", text)
    if match is None:
        return 0.0
    n = int(match.group())
    return 1.0 if n == 7 else max(0.0, 0.5 - 0.1 * abs(n - 7))


def advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def datum(choice: object, advantage: float) -> types.Datum:
    """An importance-sampling datum from one answer's extension fields (prompt positions masked
    by a zero advantage)."""
    extra = choice.model_extra or {}  # type: ignore[attr-defined]
    prompt, sampled, logprobs = extra["prompt_token_ids"], extra["token_ids"], extra["token_logprobs"]
    tokens = prompt + sampled
    masked = [0.0] * (len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": masked + list(logprobs),
            "advantages": masked + [advantage] * len(sampled),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--group", type=int, default=8, help="answers per step")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    args = parser.parse_args()
    api_key = os.environ["TINKER_API_KEY"]

    service = tinker.ServiceClient(base_url=args.base_url, api_key=api_key)
    trainer = service.create_lora_training_client(base_model=args.model, rank=16).result()
    agent = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=api_key)
    path = trainer.save_weights_for_sampler("step-0").result().path
    for step in range(args.steps):
        answer = agent.chat.completions.create(
            model=path,
            messages=[{"role": "user", "content": PROMPT}],
            n=args.group,
            max_tokens=8,
            temperature=1.0,
            seed=step,
        )
        rewards = [reward(c.message.content or "") for c in answer.choices]
        adv = advantages(rewards)
        data = [datum(c, a) for c, a in zip(answer.choices, adv, strict=True) if a != 0.0]
        if data:
            fwd = trainer.forward_backward(data, "importance_sampling")
            opt = trainer.optim_step(types.AdamParams(learning_rate=args.learning_rate))
            fwd.result()
            opt.result()
            path = trainer.save_weights_for_sampler(f"step-{step + 1}").result().path
        print(f"step {step + 1}: mean reward {sum(rewards) / len(rewards):.3f}  ({path})", flush=True)


if __name__ == "__main__":
    main()
