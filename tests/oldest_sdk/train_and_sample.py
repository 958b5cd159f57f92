"""One short training and sampling round through the oldest tinker SDK polytinker serves (0.22),
run in its own environment (``make oldest-sdk-venv``) against ``polytinker serve --http``, which
``TINKER_BASE_URL`` and ``TINKER_API_KEY`` name; ``TINKER_MODEL`` is the base model to ask for.

It prints what each call answered, a line ``label: value`` each, and ``OK`` at the end; any failure raises."""

from __future__ import annotations

import os
import sys

import tinker
from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def main() -> None:
    print("sdk:", tinker.__version__)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=os.environ["TINKER_MODEL"], rank=4)
    data = [datum([5, 17, 230, 9, 41]), datum([7, 8, 9, 10])]
    losses = []
    for _ in range(3):
        fwd = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fwd.metrics["loss:sum"])
    print("losses:", " ".join(f"{x:.4f}" for x in losses))
    print("logprobs per datum:", [len(out["logprobs"].tolist()) for out in fwd.loss_fn_outputs])
    scored = training.forward(data, "cross_entropy").result()  # JSON /forward in 0.22.0
    print("forward loss:", f"{scored.metrics['loss:sum']:.4f}")
    sampler = training.save_weights_and_get_sampling_client()
    out = sampler.sample(
        types.ModelInput.from_ints([5, 17, 230]), 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    ).result()
    print("sampled:", [list(s.tokens) for s in out.sequences])
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
