"""The learner as an actor in a real child process (tiny-random model): same results as in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from polytinker.actors import ActorConfig, spawn
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner import AdamParams, LearnerConfig, MultiAdapterLearner
from polytinker.engine.learner.actor import LearnerActor, LearnerClient
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum, LoraConfig
from polytinker.errors import RemoteError

LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2)


def data() -> list[Datum]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (7, 9):
        tokens = torch.randint(1, 4000, (n + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 3 + [1.0] * (n - 3)))
    return out


@pytest.fixture
def client(tmp_path) -> Iterator[LearnerClient]:
    ref = spawn(
        LearnerActor,
        TINY_RANDOM,
        {"micro_batch_size": 4},
        1,
        1,
        name="learner",
        run_dir=tmp_path,
        config=ActorConfig(start_timeout_s=120, ask_timeout_s=120),
    )
    try:
        yield LearnerClient(ref)
    finally:
        ref.stop()


@pytest.mark.timeout(180)
def test_actor_matches_in_process_learner(client: LearnerClient, tmp_path) -> None:
    torch.set_num_threads(1)
    local = MultiAdapterLearner(load_model(TINY_RANDOM)[0], LearnerConfig(micro_batch_size=4))
    for learner in (client, local):
        learner.add_adapter("alice", LORA, seed=7)
    remote_fb = client.forward_backward(data(), "cross_entropy", "alice")
    local_fb = local.forward_backward(data(), "cross_entropy", "alice")
    assert remote_fb.loss == pytest.approx(local_fb.loss, rel=1e-5)
    assert remote_fb.metrics["loss/tokens"] == local_fb.metrics["loss/tokens"] == 10.0
    ref = client.optim_step(ADAM, "alice")
    assert ref == local.optim_step(ADAM, "alice")
    assert [str(r) for r in client.adapters()] == ["alice@1"]

    exported, expected = client.export_adapter("alice"), local.export_adapter("alice")
    assert exported.ref == ref and exported.config == LORA
    assert set(exported.tensors) == set(expected.tensors)
    for k, v in expected.tensors.items():
        torch.testing.assert_close(exported.tensors[k], v, rtol=1e-5, atol=1e-6)

    # Weight sync across the process boundary: an engine loads what the actor exported and scores
    # the probe exactly as the learner does.
    model, tokenizer = load_model(TINY_RANDOM)
    engine = HFBackend(model=model, tokenizer=tokenizer)
    engine.load_adapter(exported)
    probe = data()[1]
    sequence = [*probe.input_tokens, probe.target_tokens_T[-1]]
    torch.testing.assert_close(
        torch.tensor(engine.compute_logprobs([sequence], ref)[0]),
        torch.tensor(client.forward([probe], "alice")[0]),
        rtol=1e-4,
        atol=1e-4,
    )

    path = client.save_state(tmp_path / "ckpt", "alice")
    client.forward_backward(data(), "cross_entropy", "alice")
    client.optim_step(ADAM, "alice")
    assert client.load_state(path, "alice").version == 1
    torch.testing.assert_close(
        torch.tensor(client.forward(data()[:1], "alice")[0]), torch.tensor(local.forward(data()[:1], "alice")[0])
    )
    with pytest.raises(RemoteError, match="unknown adapter"):
        client.optim_step(ADAM, "bob")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_actor_leading_a_group_of_two(tmp_path) -> None:
    torch.set_num_threads(1)
    ref = spawn(
        LearnerActor,
        TINY_RANDOM,
        {"micro_batch_size": 4},
        2,
        1,
        name="learner-dp",
        run_dir=tmp_path,
        config=ActorConfig(start_timeout_s=240, ask_timeout_s=240),
    )
    try:
        client = LearnerClient(ref)
        client.add_adapter("alice", LORA, seed=7)
        remote = client.forward_backward(data(), "cross_entropy", "alice")
        client.optim_step(ADAM, "alice")
        exported = client.export_adapter("alice")
    finally:
        ref.stop(timeout_s=60)
    local = MultiAdapterLearner(load_model(TINY_RANDOM)[0], LearnerConfig(micro_batch_size=4))
    local.add_adapter("alice", LORA, seed=7)
    assert remote.loss == pytest.approx(local.forward_backward(data(), "cross_entropy", "alice").loss, rel=1e-5)
    local.optim_step(ADAM, "alice")
    for k, v in local.export_adapter("alice").tensors.items():
        torch.testing.assert_close(exported.tensors[k], v, rtol=1e-4, atol=1e-6)
