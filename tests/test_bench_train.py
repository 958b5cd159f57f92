"""The parts of benchmarks/train.py that need neither TRL nor the real model: the reward, GRPO's
advantages, the GRPO datums, and the figures computed from step records."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _train_ours  # benchmarks/ is a directory of scripts, not a package
import _train_task
import train


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7", 1.0),
        (" 7.", 1.0),
        ("I pick 7", 1.0),
        ("6", 0.4),
        ("10", 0.2),
        ("1", 0.0),
        ("12", 0.0),
        ("seven", 0.0),
        ("", 0.0),
        ("3 or 7", 0.1),  # the first number counts
    ],
)
def test_reward(text, expected):
    assert _train_task.reward(text) == pytest.approx(expected)


def test_group_advantages_match_grpo():
    rewards = [1.0, 0.0, 0.5, 0.5]
    adv = _train_task.group_advantages(rewards)
    std = statistics.stdev(rewards)
    assert adv == pytest.approx([(r - 0.5) / (std + 1e-4) for r in rewards])
    assert _train_task.group_advantages([0.3] * 8) == [0.0] * 8  # a uniform group teaches nothing
    assert _train_task.group_advantages([]) == []


def test_first_reaching_and_linear_lr():
    assert _train_task.first_reaching([0.1, 0.95, 0.2]) == 2
    assert _train_task.first_reaching([0.1, 0.5]) is None
    assert _train_task.linear_lr(5e-4, 0, 10) == pytest.approx(5e-4)
    assert _train_task.linear_lr(5e-4, 5, 10) == pytest.approx(2.5e-4)


def test_turn_samples_feed_the_agents_grpo():
    from polytinker.agents.algorithms import GRPO
    from polytinker.agents.spec import AlgorithmConfig
    from polytinker.client._convert import to_datum

    prompt = [1, 2, 3]
    seqs = [SimpleNamespace(tokens=[7, 2], logprobs=[-0.5, -0.1]), SimpleNamespace(tokens=[9], logprobs=[-2.0])]
    samples = _train_ours.turn_samples("a", 0, prompt, seqs, [1.0, 0.0])
    algorithm = GRPO(AlgorithmConfig())
    adv = algorithm.advantages(samples)
    assert adv[0] > 0 > adv[1]
    (batch,) = algorithm.minibatches(samples, adv, seed=0)
    first = to_datum(batch[0])  # as the learner reads it
    assert first.input_tokens == [1, 2, 3, 7]
    assert first.target_tokens_T == [2, 3, 7, 2]
    assert first.weights_T[:2] == [0.0, 0.0] and first.weights_T[2] > 0
    assert first.sampling_logprobs_T == [0.0, 0.0, -0.5, -0.1]
    same = _train_ours.turn_samples("a", 1, prompt, seqs, [0.5, 0.5])
    assert algorithm.minibatches(same, algorithm.advantages(same), seed=0) == []  # nothing to learn


def test_prompt_is_rendered_with_the_chat_template():
    from polytinker.engine.models import load_tokenizer

    tok = load_tokenizer("tiny-random")
    text = tok.decode(_train_ours.prompt_ids(tok))
    assert _train_task.PROMPT in text and text.rstrip().endswith("assistant")


def _step(agent, step, reward, t0, t1, tokens=16):
    return {"agent": agent, "step": step, "reward_mean": reward, "completion_tokens": tokens, "step_s": t1 - t0}


def test_figures_from_records():
    def run(records, peak_mib):
        r = train.Run(records=records, peak_rss_by_pid={1: int(peak_mib * 2**20)})
        for s in r.records:
            s.update(t_start=s.get("t_start", 0.0), t_end=s.get("t_end", s["step_s"]))
        return r

    ours = run(
        [
            _step("a", i + 1, [0.0, 0.3, 0.6, 0.9][i], 0, 2.0)
            | {f"{p}_s": 0.5 for p in ("sample", "forward_backward", "optim_step", "weight_sync")}
            for i in range(4)
        ],
        1000,
    )
    trl = run([_step("t", i + 1, 0.1, 0, 4.0) for i in range(4)], 1000)
    multi_ours = run([_step(f"a{k}", 1, 0.0, 0, 2.0) | {"t_start": 0.0, "t_end": 2.0} for k in range(4)], 1500)
    multi_trl = run([_step(f"t{k}", 1, 0.0, 0, 8.0) | {"t_start": 0.0, "t_end": 8.0} for k in range(4)], 4000)
    got = dict(train.figures(ours, trl, multi_ours, multi_trl))
    assert got["step_time_ratio"] == "0.500"
    assert got["steps_to_reward_0_9_ours"] == "4"
    assert got["steps_to_reward_0_9_trl"] == "not reached in 4 steps"
    assert got["multi_agent_memory_ratio"] == "0.375"
    assert got["multi_agent_throughput_ratio"] == "4.000"
    assert got["ours_sample_s"] == "0.50"
