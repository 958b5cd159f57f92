"""Full-parameter groups sharded with FSDP2: K=2 real processes (gloo, CPU) make the same updates
as one process on the whole batch, hold half the weights each, and save checkpoints that load into
a group of either size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_learner_distributed import batch

from polytinker.engine.learner import AdamParams, FullParamLearner, LearnerConfig
from polytinker.engine.learner.group import LearnerGroup
from polytinker.engine.learner.sharding import is_sharded
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum
from polytinker.errors import ConfigError

ADAM = AdamParams(learning_rate=1e-3, weight_decay=0.01)
# One datum per pass: 3 datums on 2 ranks are 2 passes and 1, and a call of 1 leaves rank 1 with
# none, so the ranks' lockstep fillers are exercised on every call but the even ones.
CONFIG = LearnerConfig(mode="full", micro_batch_size=1)


def steps(learner: FullParamLearner | LearnerGroup, data: list[Datum]) -> dict[str, Any]:
    first = learner.forward_backward(data[:3], "cross_entropy")
    second = learner.forward_backward(data, "importance_sampling")
    learner.optim_step(ADAM)
    masked = Datum(data[0].input_tokens, data[0].target_tokens_T, [0.0] * len(data[0].weights_T))
    learner.forward_backward([masked, data[1]], "cross_entropy")  # one rank's pass trains nothing
    learner.forward_backward(data[:1], "ppo", None, {"clip_epsilon": 0.2})  # rank 1 holds no datum
    learner.optim_step(ADAM)
    return {
        "losses": [first.loss, second.loss],
        "logprobs": second.logprobs,
        "after": learner.forward(data),
        "one": learner.forward(data[:1]),
    }


def flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row])


def weights(learner: FullParamLearner) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in learner.base_model.named_parameters()}


@pytest.mark.timeout(300)
def test_two_sharded_ranks_match_one_process_and_checkpoints_move_between_sizes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    data = batch()  # 5 datums of unequal lengths, with loss inputs for every loss
    single = FullParamLearner(load_model(TINY_RANDOM)[0], CONFIG)
    expected = steps(single, data)
    single.save_state(tmp_path / "single")
    group = LearnerGroup.start(TINY_RANDOM, world_size=2, config=CONFIG)
    try:
        lead = group.learner
        assert isinstance(lead, FullParamLearner) and lead.sharded
        params = dict(lead.base_model.named_parameters())
        assert all(is_sharded(p) for p in params.values())
        local = sum(p.to_local().numel() for p in params.values())  # type: ignore[attr-defined]
        whole = sum(p.numel() for p in params.values())
        assert local <= whole // 2 + 4096, f"rank 0 holds {local} of {whole} elements: not sharded"
        got = steps(group, data)
        group.save_state(tmp_path / "grouped")
        # A single process's checkpoint loads into the sharded group and scores as it did there.
        group.load_state(tmp_path / "single")
        reloaded = group.forward(data)
    finally:
        group.close()
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(flat(got["logprobs"]), flat(expected["logprobs"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(flat(got["after"]), flat(expected["after"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(flat(got["one"]), flat(expected["one"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(flat(reloaded), flat(expected["after"]), rtol=1e-5, atol=1e-4)
    # The group's checkpoint is whole tensors, and its AdamW state too: it loads into one process
    # and that process's next step is the one the single learner takes.
    other = FullParamLearner(load_model(TINY_RANDOM)[0], CONFIG)
    other.load_state(tmp_path / "grouped")
    for name, value in weights(single).items():
        torch.testing.assert_close(weights(other)[name], value, rtol=1e-5, atol=1e-5)
    for learner in (single, other):
        learner.forward_backward(data, "cross_entropy")
        learner.optim_step(ADAM)
    for name, value in weights(single).items():
        torch.testing.assert_close(weights(other)[name], value, rtol=1e-5, atol=1e-5)


def test_only_full_parameter_groups_of_two_or_more_are_sharded() -> None:
    with pytest.raises(ConfigError, match="full_sharding"):
        LearnerConfig(mode="full", full_sharding="zero3")  # type: ignore[arg-type]
    assert CONFIG.sharded(2) and not CONFIG.sharded(1)
    assert not LearnerConfig(mode="full", full_sharding="replicate").sharded(2)
    assert not LearnerConfig(mode="lora").sharded(2)  # LoRA groups replicate
    single = FullParamLearner(load_model(TINY_RANDOM)[0], CONFIG)
    assert not single.sharded  # a group of one has nothing to shard
