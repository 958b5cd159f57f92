"""Data parallel: a group of K=2 real processes (gloo) makes the same update as one process on the whole batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from polytinker.engine.learner import AdamParams, LearnerConfig, MultiAdapterLearner
from polytinker.engine.learner.group import LearnerGroup, shard_bounds
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum, LoraConfig
from polytinker.errors import ConfigError

LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)


def batch(n: int = 5) -> list[Datum]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        length = 6 + i  # unequal lengths, odd count: the shards differ in size and padding
        tokens = torch.randint(1, 4000, (length + 1,), generator=g).tolist()
        weights = [0.0] * 2 + [1.0] * (length - 2)
        adv = torch.randn(length, generator=g).tolist()
        samp = (-8.0 - torch.rand(length, generator=g)).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], weights, adv, samp))
    return out


def test_shard_bounds_cover_everything_once() -> None:
    for n in range(0, 9):
        for world in range(1, 4):
            spans = [shard_bounds(n, r, world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def flat(rows: object) -> torch.Tensor:
    assert isinstance(rows, list)
    return torch.tensor([x for row in rows for x in row])


def run_steps(learner: MultiAdapterLearner | LearnerGroup, data: list[Datum]) -> dict[str, object]:
    learner.add_adapter("sum", LORA, seed=3)
    learner.add_adapter("mean", LORA, seed=4)
    first = learner.forward_backward(data[:2], "cross_entropy", "sum")
    scored = learner.forward_loss(data, "importance_sampling", "sum")  # what the next call answers, no gradient
    second = learner.forward_backward(data, "importance_sampling", "sum")
    learner.optim_step(ADAM, "sum")
    learner.forward_backward(data, "ppo", "mean", {"clip_epsilon": 0.2})
    learner.optim_step(ADAM, "mean")
    return {
        "losses": [first.loss, scored.loss, second.loss],
        "scored_metrics": scored.metrics,
        "metrics": second.metrics,
        "logprobs": second.logprobs,
        "after": learner.forward(data, "sum"),
        "sum": learner.export_adapter("sum").tensors,
        "mean": learner.export_adapter("mean").tensors,
    }


@pytest.mark.timeout(180)
def test_two_ranks_match_one_process() -> None:
    torch.set_num_threads(1)
    data = batch()
    config = LearnerConfig(micro_batch_size=2)
    model, _ = load_model(TINY_RANDOM)
    single_learner = MultiAdapterLearner(model, config)
    single = run_steps(single_learner, data)
    group = LearnerGroup.start(TINY_RANDOM, world_size=2, config=config)
    try:
        grouped = run_steps(group, data)
        # The weighted-token count (what per_token normalisation divides by) is summed over ranks too.
        assert group.learner.last_step_metrics["optim/tokens"] == single_learner.last_step_metrics["optim/tokens"]
        # A bad call fails on rank 0 before it is broadcast, and the group keeps working.
        with pytest.raises(ConfigError, match="unknown adapter"):
            group.forward_backward(data, "cross_entropy", "nobody")
        with pytest.raises(ConfigError, match="advantages_T"):
            group.forward_backward([Datum([1, 2], [2, 3], [1.0, 1.0])], "ppo", "sum")
        assert len(group.forward(data[:1], "sum")) == 1
    finally:
        group.close()
    torch.testing.assert_close(grouped["losses"], single["losses"], rtol=1e-5, atol=1e-5)
    for run in (single, grouped):
        losses = run["losses"]
        assert isinstance(losses, list) and abs(losses[1] - losses[2]) <= 1e-5 * abs(losses[2]) + 1e-6
        assert run["scored_metrics"] == pytest.approx(run["metrics"], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(flat(grouped["logprobs"]), flat(single["logprobs"]))
    torch.testing.assert_close(flat(grouped["after"]), flat(single["after"]))
    for name in ("sum", "mean"):
        a, b = single[name], grouped[name]
        assert isinstance(a, dict) and isinstance(b, dict)
        moved = sum(float((v != 0).sum()) for k, v in a.items() if "lora_B" in k)
        assert moved > 0, "the step left lora_B at zero: nothing was compared"
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
