"""Weight sync: after optim_step the new adapter version reaches an engine, which then scores with it.

The learner and the engine hold separate copies of the base model (as in separate processes); the
adapter crosses as exported CPU tensors through the transport codec (what a socket would carry).
"""

from __future__ import annotations

import gc

import pytest
import torch

from polytinker.engine.adapter_weights import MAX_LAYOUT_TENSORS, AdapterWeights, TensorLayout
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner import AdamParams, MultiAdapterLearner
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, Datum, LoraConfig
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


def train_and_sync(learner: MultiAdapterLearner, engine: HFBackend, versions: int) -> tuple[AdapterRef, torch.Tensor]:
    """``versions`` updates, each sent to the engine, which unloads the version before; each engine
    version scores as the learner's own did. Returns the last version and its scores."""
    probe = train = [Datum(SEQUENCE[:-1], SEQUENCE[1:], [1.0] * (len(SEQUENCE) - 1))]
    previous: AdapterRef | None = None
    for _ in range(versions):
        learner.forward_backward(train, "cross_entropy", "alice")
        ref = learner.optim_step(AdamParams(learning_rate=1e-2), "alice")
        engine.load_adapter(over_the_wire(learner.export_adapter("alice")))
        if previous is not None:
            engine.unload_adapter(previous)
        previous = ref
        expected = torch.tensor(learner.forward(probe, "alice")[0])
        got = torch.tensor(engine.compute_logprobs([SEQUENCE], ref)[0])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    return ref, expected


def test_a_version_moves_as_one_buffer_and_is_served_from_it_while_the_learner_trains_on() -> None:
    """One frame over the codec whatever the number of tensors; an engine of the learner's dtype
    serves each version from the buffer it came in (the learner's snapshot: no copy), which the
    learner's next snapshots leave alone until the engine lets go of it, then reuse."""
    learner, engine = learner_and_engine()
    assert len(encode(AdapterTensors.of(learner.export_adapter("alice")))) == 2  # the body and one buffer
    gc.collect()
    ref, expected = train_and_sync(learner, engine, versions=3)
    gc.collect()
    assert learner._snapshots.in_use() == 1  # the engine serves the last version from its snapshot
    train_and_sync(learner, engine, versions=1)  # the learner trains on: the engine's version holds
    after = torch.tensor(engine.compute_logprobs([SEQUENCE], ref)[0])
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
    for loaded in engine.loaded_adapters():
        engine.unload_adapter(loaded)
    gc.collect()
    assert learner._snapshots.in_use() == 0
    assert len(learner._snapshots._arrays) <= 3  # released snapshots' memory was reused


def test_an_engine_of_another_dtype_copies_each_version_into_a_freed_buffer() -> None:
    """A float64 engine converts each float32 version in one copy, into the buffer the version
    before left (a spare): the learner's snapshot is released as soon as it is loaded."""
    learner, engine = learner_and_engine()
    engine = HFBackend(model=engine.model.double(), tokenizer=engine.tokenizer)
    assert engine.model.dtype == torch.float64
    with torch.no_grad():
        train_and_sync(learner, engine, versions=3)
    gc.collect()
    assert learner._snapshots.in_use() == 0


def test_split_makes_one_view_per_tensor_in_runs_of_equal_shapes() -> None:
    names = ["a", "b", "c", "d", "e", "f", "g"]
    shapes = [(2, 3), (2, 3), (4,), (0, 5), (3, 2), (3, 2), (3, 2)]
    layout = TensorLayout.of_shapes(names, shapes)
    assert layout.runs == (((2, 3), 2), ((4,), 1), ((0, 5), 1), ((3, 2), 3))
    flat = torch.arange(layout.numel, dtype=torch.float32)
    views = layout.split(flat)
    assert list(views) == names
    for name, shape, offset, size in zip(names, shapes, layout.offsets, layout.sizes, strict=True):
        assert views[name].shape == shape and views[name].is_contiguous()
        assert torch.equal(views[name].reshape(-1), flat[offset : offset + size])
        if size:
            assert views[name].data_ptr() == flat.data_ptr() + 4 * offset  # a view, not a copy


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
