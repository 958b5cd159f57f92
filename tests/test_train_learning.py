"""Learning tests on the real default model (SmolLM2-135M-Instruct), fixed seeds, on the CPU.

Each states its margin and its number of steps: the reward must rise by that much within them.
They run the whole stack: a local runtime (scheduler, HF engine, learner), the coordinator, GRPO.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from polytinker.agents import Experiment, ExperimentConfig
from polytinker.agents.metrics import read_metrics

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"

# Minutes each on 2 idle cores, far more when shared: `make test-learning`, not `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(1800)]


def train_rewards(run: Path, agent: str) -> list[float]:
    return [r[f"reward/{agent}"] for r in read_metrics(run) if f"reward/{agent}" in r]


def test_single_agent_guess_number_reward_rises(tmp_path):
    """guess_number (1..8, 3 guesses): mean reward of the last 2 of 8 steps >= first 2 + 0.3.
    Most of the gain is the answer format (an invalid guess costs 0.5), then the search.
    One step plays 8 episodes (one group of 8 from the same secret)."""
    overrides = {"output.root": str(tmp_path), "output.progress": False, "train.steps": 8, "train.groups": 1}
    overrides |= {"eval.at_start": False, "eval.episodes": 4}
    Experiment(ExperimentConfig.from_toml(CONFIGS / "guess_number.toml", overrides)).train()
    rewards = train_rewards(tmp_path / "guess-number", "guesser")
    assert len(rewards) == 8
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last >= first + 0.3, rewards


def test_two_agents_prisoners_dilemma_reward_against_random_rises(tmp_path):
    """The main job, shortened to 8 steps: each agent's evaluation reward against the random
    opponent (32 episodes, fixed seeds) rises by at least 0.3 (legal answers, then defection,
    the dominant move). Their reward against each other may fall: both learn to defect."""
    overrides = {"output.root": str(tmp_path), "output.progress": False, "train.steps": 8}
    summary = Experiment(ExperimentConfig.from_toml(CONFIGS / "prisoners_dilemma.toml", overrides)).train()
    for agent in ("alice", "bob"):
        key = f"eval/{agent}/random/reward"
        assert summary.after[key] >= summary.before[key] + 0.3, (agent, summary.before, summary.after)
