"""Weight sync: after optim_step the new adapter version reaches an engine, which then scores with it.

The learner and the engine hold separate copies of the base model (as in separate processes); the
adapter crosses as exported CPU tensors through the transport codec (what a socket would carry).
"""

from __future__ import annotations

import torch

from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner import AdamParams, MultiAdapterLearner
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, AdapterWeights, Datum, LoraConfig
from polytinker.transport.codec import decode, encode

SEQUENCE = [1, 17, 230, 4051, 88, 912, 7, 3300, 41, 5]


def over_the_wire(w: AdapterWeights) -> AdapterWeights:
    body = decode(encode({"tensors": w.tensors}))
    return AdapterWeights(w.ref, w.config, {k: v.clone() for k, v in body["tensors"].items()})


def test_engine_scores_with_the_version_the_learner_just_made() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model(TINY_RANDOM)
    learner = MultiAdapterLearner(model)
    learner.add_adapter("alice", LoraConfig(rank=8, alpha=16), seed=0)
    engine = HFBackend(model=load_model(TINY_RANDOM)[0], tokenizer=tokenizer)
    probe = [Datum(SEQUENCE[:-1], SEQUENCE[1:], [1.0] * (len(SEQUENCE) - 1))]

    engine.load_adapter(over_the_wire(learner.export_adapter("alice")))
    v0 = torch.tensor(engine.compute_logprobs([SEQUENCE], AdapterRef("alice", 0))[0])
    torch.testing.assert_close(v0, torch.tensor(learner.forward(probe, "alice")[0]), rtol=1e-4, atol=1e-4)

    train = [Datum(SEQUENCE[:-1], SEQUENCE[1:], [0.0] * 3 + [1.0] * (len(SEQUENCE) - 4))]
    for _ in range(2):
        learner.forward_backward(train, "cross_entropy", "alice")
        ref = learner.optim_step(AdamParams(learning_rate=1e-2), "alice")
    assert ref == AdapterRef("alice", 2)
    engine.load_adapter(over_the_wire(learner.export_adapter("alice")))

    v2 = torch.tensor(engine.compute_logprobs([SEQUENCE], ref)[0])
    torch.testing.assert_close(v2, torch.tensor(learner.forward(probe, "alice")[0]), rtol=1e-4, atol=1e-4)
    assert (v2 - v0).abs().max() > 1e-2, "the new version scores like the old one: the update did not arrive"
    assert v2[3:].sum() > v0[3:].sum()  # it learned the trained continuation
    # The old version is still resident and unchanged (requests in flight keep their version).
    torch.testing.assert_close(torch.tensor(engine.compute_logprobs([SEQUENCE], AdapterRef("alice", 0))[0]), v0)
