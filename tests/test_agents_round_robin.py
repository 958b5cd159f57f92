"""Sixteen agents on one base model: the round-robin mapping, ``agent_defaults`` in a config, the
local runtime sized for the agents, and examples/configs/round_robin_16.toml trained for 2 steps
on the tiny-random model (slow: through the whole stack, a local runtime as processes)."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest

from polytinker.agents import AgentSpec, Experiment, ExperimentConfig, MappingConfig
from polytinker.agents.mapping import PolicyMapping, round_robin_pairs
from polytinker.agents.types import SlotKind
from polytinker.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "round_robin_16.toml"
NAMES = [f"p{i:02d}" for i in range(1, 17)]

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [2, 3, 5, 16, 64])
def test_every_pair_meets_once_in_n_minus_one_rounds_and_each_round_is_a_matching(n):
    names = [f"a{i}" for i in range(n)]
    rounds = n - 1 if n % 2 == 0 else n  # with an odd number, each sits out one round
    met = []
    for r in range(rounds):
        pairs = round_robin_pairs(names, r)
        seated = [x for pair in pairs for x in pair]
        assert len(seated) == len(set(seated)) == n - n % 2, (r, pairs)
        met += [frozenset(p) for p in pairs]
    assert sorted(met, key=sorted) == sorted((frozenset(p) for p in combinations(names, 2)), key=sorted)
    assert round_robin_pairs(names, rounds) == round_robin_pairs(names, 0)  # the schedule repeats


def test_assign_seats_every_agent_once_a_step_with_one_group_per_pair_and_alternates_seats():
    agents = [AgentSpec(n) for n in NAMES]
    mapping = PolicyMapping(MappingConfig(kind="round_robin"), ["player_0", "player_1"], agents)  # type: ignore[arg-type]
    opponents: dict[str, set[str]] = {n: set() for n in NAMES}
    for step in range(15):
        seated = []
        for group in range(8):
            seed = 1000 + step * 8 + group
            slots = mapping.assign(seed, step=step, group=group)
            assert all(s.kind is SlotKind.LEARNER for s in slots.values())
            a, b = slots["player_0"].name, slots["player_1"].name
            seated += [a, b]
            opponents[a].add(b)
            opponents[b].add(a)
            # The same seed and place: the same slots (a GRPO group faces one opponent).
            assert mapping.assign(seed, step=step, group=group) == slots
            swapped = mapping.assign(seed + 1, step=step, group=group)
            assert (swapped["player_0"].name, swapped["player_1"].name) == (b, a)
        assert sorted(seated) == NAMES, step
    assert all(len(v) == 15 for v in opponents.values())  # each met all the others
    assert mapping.trained_roles("p07") == ["player_0", "player_1"]


def test_round_robin_refuses_games_that_leave_other_than_two_roles_open_and_keeps_frozen_agents_frozen():
    agents = [AgentSpec("a"), AgentSpec("b"), AgentSpec("c", trainable=False)]
    with pytest.raises(ConfigError, match="two roles"):
        PolicyMapping(MappingConfig(kind="round_robin"), ["r0", "r1", "r2"], agents)  # type: ignore[arg-type]
    pinned = MappingConfig(kind="round_robin", roles={"r2": "scripted:random"})  # type: ignore[arg-type]
    mapping = PolicyMapping(pinned, ["r0", "r1", "r2"], agents)
    kinds = {s.name: s.kind for r in range(3) for s in mapping.assign(0, step=r).values()}
    assert kinds == {"a": SlotKind.LEARNER, "b": SlotKind.LEARNER, "c": SlotKind.FROZEN, "random": SlotKind.SCRIPTED}
    assert mapping.trained_roles("c") == []


def test_agent_defaults_fill_every_agent_and_each_agent_overrides_them_key_by_key():
    raw = {
        "name": "x",
        "agent_defaults": {"adapter": {"rank": 4, "alpha": 8}, "sampling": {"max_tokens": 3}},
        "agents": [{"name": "a"}, {"name": "b", "adapter": {"rank": 2}}],
    }
    a, b = ExperimentConfig.from_dict(raw).agents
    assert (a.adapter.rank, a.adapter.alpha, a.sampling.max_tokens) == (4, 8, 3)
    assert (b.adapter.rank, b.adapter.alpha, b.sampling.max_tokens) == (2, 8, 3)
    with pytest.raises(ConfigError, match="agent_defaults"):
        ExperimentConfig.from_dict({**raw, "agent_defaults": 3})
    with pytest.raises(ConfigError, match="agents"):
        ExperimentConfig.from_dict({**raw, "agents": {"name": "a"}})


def test_the_sixteen_agent_config_reads_and_sizes_its_local_runtime_for_sixteen_adapters():
    config = ExperimentConfig.from_toml(CONFIG)
    assert [a.name for a in config.agents] == NAMES
    assert {a.renderer.system_prompt for a in config.agents} == {config.agents[0].renderer.system_prompt}
    assert config.mapping.kind == "round_robin" and config.train.groups == 8
    # The scheduler pins one engine slot per running job: 16 agents need 16 at least (8 was the
    # default, and the 9th agent's samples were refused until they timed out).
    experiment = Experiment(config)
    assert experiment._adapter_slots() >= 2 * len(NAMES)
    assert experiment._lora_agents() == len(NAMES)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sixteen_agents_train_two_steps_in_a_round_robin(tmp_path):
    """2 steps of the 16-agent config on the tiny-random model (the config's own model, SmolLM2,
    took 279 s for the same on 2 cores that other jobs kept busy, load average 7 to 12), 2
    episodes per pair, 2 evaluation episodes per agent and seat: every agent plays and is
    updated in each step through the whole stack (a local runtime as processes)."""
    overrides = {"output.root": str(tmp_path), "output.progress": False, "output.tensorboard": False}
    overrides |= {"train.steps": 2, "train.group_size": 2, "eval.episodes": 2, "eval.at_start": False}
    overrides |= {"agent_defaults.base_model": "tiny-random"}
    summary = Experiment(ExperimentConfig.from_toml(CONFIG, overrides)).train()
    run = tmp_path / "pd-round-robin-16"
    assert json.loads((run / "state.json").read_text())["step"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/rollout_s" in r]
    assert len(steps) == 2
    for metrics in steps:
        # Every agent played (one pair per group) and reached its update in each step.
        assert {n for n in NAMES if f"reward/{n}" in metrics} == set(NAMES)
        assert {n for n in NAMES if f"train/datums/{n}" in metrics} == set(NAMES)
    for name in NAMES:
        assert f"eval/{name}/random/reward" in summary.after
