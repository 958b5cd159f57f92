"""The learner on the real default model (SmolLM2-135M-Instruct, fp32, LoRA r16 on every projection)."""

from __future__ import annotations

import pytest
import torch

from polytinker.engine.learner import AdamParams, MultiAdapterLearner
from polytinker.engine.models import DEFAULT_MODEL, load_model
from polytinker.engine.types import Datum, LoraConfig


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sft_steps_on_the_real_model_touch_only_their_adapter() -> None:
    torch.set_num_threads(1)  # more threads spin against each other on a loaded 2-core machine
    model, tokenizer = load_model(DEFAULT_MODEL)
    learner = MultiAdapterLearner(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say the magic word."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    answer = tokenizer("Xylophone-banana!", add_special_tokens=False)["input_ids"]
    tokens = [int(t) for t in [*prompt, *answer]]
    datum = Datum(tokens[:-1], tokens[1:], [0.0] * (len(prompt) - 1) + [1.0] * len(answer))
    for name in ("alice", "bob"):
        learner.add_adapter(name, LoraConfig(rank=16, alpha=32))
    assert sum(p.numel() for p in learner._slot("alice").params.values()) > 4_000_000  # all 7 projections x 30 layers
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    bob_before = learner.export_adapter("bob").tensors
    losses = []
    for _ in range(3):
        losses.append(learner.forward_backward([datum], "cross_entropy", "alice").loss)
        learner.optim_step(AdamParams(learning_rate=1e-3), "alice")
    assert losses[-1] < losses[0] * 0.8, losses
    assert all(torch.equal(v, bob_before[k]) for k, v in learner.export_adapter("bob").tensors.items())
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
