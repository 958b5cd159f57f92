"""Weight sync: after optim_step the new adapter version reaches an engine, which then scores with it.

The learner and the engine hold separate copies of the base model (as in separate processes); the
adapter crosses as exported CPU tensors through the transport codec (what a socket would carry).
"""

from __future__ import annotations

import pytest
import torch

from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner import AdamParams, MultiAdapterLearner
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import MAX_LAYOUT_TENSORS, AdapterRef, AdapterWeights, Datum, LoraConfig, TensorLayout
from polytinker.errors import ProtocolError
from polytinker.scheduler.service.replies import AdapterTensors
from polytinker.transport.codec import decode, encode
from polytinker.transport.messages import from_fields

SEQUENCE = [1, 17, 230, 4051, 88, 912, 7, 3300, 41, 5]


def over_the_wire(w: AdapterWeights) -> AdapterWeights:
    received: AdapterTensors = decode(encode(AdapterTensors.of(w)))
    return received.weights(w.ref)


def learner_and_engine() -> tuple[MultiAdapterLearner, HFBackend]:
    """A learner with adapter alice and an engine on a separate copy of the same model."""
    torch.set_num_threads(1)
    model, tokenizer = load_model(TINY_RANDOM)
    learner = MultiAdapterLearner(model)
    learner.add_adapter("alice", LoraConfig(rank=8, alpha=16), seed=0)
    return learner, HFBackend(model=load_model(TINY_RANDOM)[0], tokenizer=tokenizer)


def test_engine_scores_with_the_version_the_learner_just_made() -> None:
    learner, engine = learner_and_engine()
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


def test_a_version_moves_as_one_buffer_and_a_freed_slot_is_reused_for_the_next() -> None:
    """One frame over the codec whatever the number of tensors, into an engine whose unloaded
    version's buffer the next version is copied into: each engine version scores as the learner's
    own version did, and keeps doing so while the learner trains on (a snapshot, not a view)."""
    learner, engine = learner_and_engine()
    probe = train = [Datum(SEQUENCE[:-1], SEQUENCE[1:], [1.0] * (len(SEQUENCE) - 1))]
    assert len(encode(AdapterTensors.of(learner.export_adapter("alice")))) == 2  # the body and one buffer
    previous: AdapterRef | None = None
    for _ in range(3):
        learner.forward_backward(train, "cross_entropy", "alice")
        ref = learner.optim_step(AdamParams(learning_rate=1e-2), "alice")
        engine.load_adapter(over_the_wire(learner.export_adapter("alice")))
        if previous is not None:
            engine.unload_adapter(previous)  # its buffer is the spare the next version fills
        previous = ref
        expected = torch.tensor(learner.forward(probe, "alice")[0])
        got = torch.tensor(engine.compute_logprobs([SEQUENCE], ref)[0])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    learner.forward_backward(train, "cross_entropy", "alice")
    learner.optim_step(AdamParams(learning_rate=1e-2), "alice")
    after = torch.tensor(engine.compute_logprobs([SEQUENCE], ref)[0])
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_export_follows_a_parameter_that_was_given_new_storage() -> None:
    model, _ = load_model(TINY_RANDOM)
    learner = MultiAdapterLearner(model)
    learner.add_adapter("alice", LoraConfig(rank=4, alpha=8), seed=0)
    name, param = next((n, p) for n, p in learner.peft_model.named_parameters() if "lora_B.alice" in n)
    param.data = torch.full_like(param, 0.5)  # no longer a view of the adapter's flat buffer
    exported = learner.export_adapter("alice").tensors
    assert torch.equal(exported[name.replace(".alice", "")], torch.full_like(param, 0.5))
    with torch.no_grad():
        param.add_(1.0)  # written in place again: the next export sees it too
    assert torch.equal(learner.export_adapter("alice").tensors[name.replace(".alice", "")], param.detach())


@pytest.mark.parametrize(
    ("joined_names", "dims", "ndims"),
    [
        ("a\nb", [2, 2], [2]),  # two names, one shape
        ("a", [2, -1], [2]),  # a negative dim
        ("a", [1] * 9, [9]),  # too many dims
        ("a", [], [0]),  # too few
        ("a", [2, 2], [1]),  # dims left over
        (7, [2], [1]),  # names that are no string
        ("a", [2.5], [1]),  # a dim that is no int
        ("a", ["2"], [1]),
    ],
)
def test_a_hostile_layout_is_a_protocol_error(joined_names: object, dims: list, ndims: list) -> None:
    with pytest.raises(ProtocolError, match="TensorLayout"):
        from_fields("sched.tensor_layout", {"joined_names": joined_names, "dims": dims, "ndims": ndims})


def test_a_buffer_that_does_not_match_its_layout_is_a_protocol_error() -> None:
    layout = TensorLayout.of_shapes(["a", "b"], [(2, 3), (4,)])
    assert (layout.names, layout.shapes, layout.sizes, layout.offsets) == (("a", "b"), ((2, 3), (4,)), (6, 4), (0, 6))
    fields = {"rank": 1, "alpha": 1, "target_modules": ["q_proj"], "layout": layout}
    AdapterTensors(**fields, flat=torch.zeros(10))
    for flat in (torch.zeros(11), torch.zeros(2, 5), "ten floats"):
        with pytest.raises(ProtocolError, match="flat"):
            from_fields("sched.r.adapter_tensors", {**fields, "flat": flat})
    too_many = MAX_LAYOUT_TENSORS + 1
    with pytest.raises(ProtocolError, match="TensorLayout"):
        from_fields(
            "sched.tensor_layout",
            {"joined_names": "\n".join(["a"] * too_many), "dims": [1] * too_many, "ndims": [1] * too_many},
        )
    assert TensorLayout.of_shapes(["a", "b"], [(2, 3), (4,)]).interned() is layout.interned()
