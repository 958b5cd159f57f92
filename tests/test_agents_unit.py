"""Unit tests of polytinker.agents that need no runtime: specs, configs, mapping, rendering,
advantages and datums. The renderer tests use the real SmolLM2 tokenizer (shipped with tiny-random)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polytinker.agents import (
    GRPO,
    PPO,
    AgentSpec,
    AlgorithmConfig,
    ExperimentConfig,
    MappingConfig,
    PolicyMapping,
    Reinforce,
    Renderer,
    RendererConfig,
    Slot,
    SlotKind,
    TurnSample,
    turn_datum,
)
from polytinker.agents.algorithms import turn_scores
from polytinker.agents.checkpoint import RunState
from polytinker.agents.loop import step_seeds
from polytinker.client._convert import to_datum
from polytinker.envs.types import PolicyInput, TextObservation, Turn
from polytinker.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def sample(agent="a", role="player_0", group="0", reward=0.0, episode_reward=None, turn=0, episode="e", n=2):
    return TurnSample(
        agent=agent,
        role=role,
        version=0,
        group=group,
        episode_id=episode,
        turn_index=turn,
        prompt_tokens=(1, 2, 3),
        completion_tokens=tuple(range(10, 10 + n)),
        logprobs_T=tuple([-0.5] * n),
        reward=reward,
        episode_reward=reward if episode_reward is None else episode_reward,
    )


# --- specs and configs -------------------------------------------------------------------------------


def test_specs_reject_bad_settings_with_a_fix():
    with pytest.raises(ConfigError, match="learning_rate"):
        AlgorithmConfig(learning_rate=0)
    with pytest.raises(ConfigError, match="choose one of"):
        AlgorithmConfig(name="dqn")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="sft_data"):
        AlgorithmConfig(name="sft")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="name"):
        AgentSpec(name="bad name")
    with pytest.raises(ConfigError, match="trainable = false"):
        AgentSpec(name="x", model_path="polytinker://j/x@1")
    with pytest.raises(ConfigError, match="one base model"):
        ExperimentConfig(name="e", agents=(AgentSpec("a"), AgentSpec("b", base_model="tiny-random")))


def test_toml_unknown_keys_are_errors(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\n[[agents]]\nname = "a"\n[agents.adapter]\nrank = 4\nranks = 8\n')
    with pytest.raises(ConfigError, match="unknown keys \\['ranks'\\]"):
        ExperimentConfig.from_toml(path)
    path.write_text('name = "x"\n[[agents]]\nname = "a"\n[trian]\nsteps = 1\n')
    with pytest.raises(ConfigError, match="trian"):
        ExperimentConfig.from_toml(path)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_example_configs_load_and_map(path):
    from polytinker.agents.experiment import _make_env

    config = ExperimentConfig.from_toml(path, {"train.steps": 1})
    assert config.train.steps == 1
    env = _make_env(config)
    PolicyMapping(config.mapping, env.possible_agents, config.agents)  # every role is covered


# --- mapping -------------------------------------------------------------------------------------------


def test_independent_mapping_gives_each_role_its_agent_and_pins_scripted_roles():
    agents = [AgentSpec("alice"), AgentSpec("bob")]
    m = PolicyMapping(MappingConfig(), ["player_0", "player_1"], agents)
    slots = m.assign(3)
    assert (slots["player_0"].name, slots["player_1"].name) == ("alice", "bob")
    assert all(s.kind is SlotKind.LEARNER for s in slots.values())
    m = PolicyMapping(MappingConfig(roles={"player_1": "scripted:random"}), ["player_0", "player_1"], agents[:1])
    assert m.assign(0)["player_1"].kind is SlotKind.SCRIPTED
    assert m.trained_roles("alice") == ["player_0"]
    with pytest.raises(ConfigError, match="no agent left"):
        PolicyMapping(MappingConfig(), ["p0", "p1", "p2"], agents)


def test_self_play_and_league():
    me = [AgentSpec("me")]
    sp = PolicyMapping(MappingConfig(kind="self_play"), ["player_0", "player_1"], me)  # type: ignore[arg-type]
    assert {s.name for s in sp.assign(0).values()} == {"me"} and sp.trained_roles("me") == ["player_0", "player_1"]
    league = PolicyMapping(MappingConfig(kind="league", pool_size=2), ["player_0", "player_1"], me)  # type: ignore[arg-type]
    assert all(s.kind is SlotKind.LEARNER for s in league.assign(0).values())  # empty pool: plays itself
    for version in (1, 2, 3):
        league.add_to_pool("me", version)
    assert league.pool["me"] == [2, 3]
    for seed in range(6):
        slots = league.assign(seed)
        mine = ["player_0", "player_1"][seed % 2]
        assert slots[mine].kind is SlotKind.LEARNER
        other = slots["player_1" if mine == "player_0" else "player_0"]
        assert other.kind is SlotKind.PAST and other.version in (2, 3) and not other.trains
    assert league.assign(5) == league.assign(5)  # a pure function of the seed
    with pytest.raises(ConfigError, match="exactly one"):
        PolicyMapping(MappingConfig(kind="self_play"), ["a", "b"], [AgentSpec("x"), AgentSpec("y")])  # type: ignore[arg-type]


def test_the_team_is_every_role_as_training_fills_it_with_current_versions_only():
    pair = PolicyMapping(MappingConfig(), ["speaker_0", "listener_0"], [AgentSpec("s"), AgentSpec("l")])
    assert pair.team() == pair.assign(0)
    pinned_roles = MappingConfig(roles={"player_1": "scripted:weak"})
    pinned = PolicyMapping(pinned_roles, ["player_0", "player_1"], [AgentSpec("a")])
    assert pinned.team()["player_1"] == Slot(SlotKind.SCRIPTED, "weak")
    league = PolicyMapping(MappingConfig(kind="league"), ["player_0", "player_1"], [AgentSpec("me")])  # type: ignore[arg-type]
    league.add_to_pool("me", 1)
    assert league.team() == {r: Slot(SlotKind.LEARNER, "me") for r in ("player_0", "player_1")}  # no past version


# --- advantages and datums ---------------------------------------------------------------------------


def test_grpo_normalises_within_groups_per_agent_and_drops_flat_groups():
    samples = [sample(group="g1", reward=r) for r in (1.0, 0.0, 1.0, 0.0)]
    samples += [sample(group="g2", reward=5.0) for _ in range(3)]  # all equal: nothing to learn
    samples += [sample(agent="b", group="g1", reward=r) for r in (10.0, 20.0)]
    adv = GRPO(AlgorithmConfig()).advantages(samples)
    np.testing.assert_allclose(adv[:4], [1, -1, 1, -1], atol=1e-4)
    np.testing.assert_allclose(adv[4:7], 0.0)
    np.testing.assert_allclose(adv[7:], [-1, 1], atol=1e-4)  # agent b's group is its own


def test_per_turn_returns_are_discounted_from_each_turn():
    samples = [sample(reward=r, turn=i) for i, r in enumerate((1.0, 0.0, 2.0))]
    scores = turn_scores(samples, AlgorithmConfig(reward_mode="per_turn", gamma=0.5))
    np.testing.assert_allclose(scores, [1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2])


def test_reinforce_baseline_moves_slowly_and_is_saved():
    algo = Reinforce(AlgorithmConfig(name="reinforce", baseline_decay=0.5, normalize_advantages=False))  # type: ignore[arg-type]
    first = algo.advantages([sample(reward=r) for r in (0.0, 2.0)])
    np.testing.assert_allclose(first, [-1, 1])  # the first batch centres on its own mean
    second = algo.advantages([sample(reward=3.0), sample(reward=3.0)])
    np.testing.assert_allclose(second, [2, 2])  # baseline 1 from before, not this batch's 3
    restored = Reinforce(algo.config)
    restored.load_state_dict(algo.state_dict())
    assert restored.baselines == {"a/player_0": 2.0}


def test_minibatch_weights_make_a_per_token_mean_and_mask_the_prompt():
    algo = PPO(AlgorithmConfig(name="ppo", epochs=2, minibatches=2))  # type: ignore[arg-type]
    samples = [sample(group="g", reward=r, n=n) for r, n in ((1.0, 2), (0.0, 3), (1.0, 1), (0.0, 4))]
    batches = algo.minibatches(samples, algo.advantages(samples), seed=0)
    assert len(batches) == 4  # 2 epochs x 2 minibatches
    for batch in ([to_datum(d) for d in b] for b in batches):  # as the learner reads them
        assert sum(sum(d.weights_T) for d in batch) == pytest.approx(1.0)
        for d in batch:
            assert d.weights_T[:2] == [0.0, 0.0]  # prompt (1, 2, 3) predicts nothing we train
    assert algo.loss_fn == "ppo" and algo.loss_fn_config()["clip_epsilon"] == 0.2


def test_turn_datum_aligns_targets_logprobs_and_advantages():
    d = to_datum(turn_datum([5, 6, 7], [8, 9], [-0.1, -0.2], advantage=2.0, weight=0.5))
    assert d.input_tokens == [5, 6, 7, 8] and d.target_tokens_T == [6, 7, 8, 9]
    assert d.weights_T == [0, 0, 0.5, 0.5] and d.advantages_T == [0, 0, 2.0, 2.0]
    assert d.sampling_logprobs_T == [0, 0, -0.1, -0.2]


# --- rendering -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from polytinker.engine.models import load_tokenizer

    return load_tokenizer("tiny-random")


def test_renderer_lists_legal_moves_names_roles_and_keeps_own_history(tokenizer):
    obs = TextObservation("Round 2: cooperate or defect?", legal_moves=("cooperate", "defect"))
    earlier = Turn(TextObservation("Round 1: cooperate or defect?"), "defect", reward=5.0)
    inp = PolicyInput("player_1", "ep", "pd", "Play the dilemma.", obs, history=(earlier,), seed=1)
    r = Renderer(tokenizer, RendererConfig(name_role=True))
    text = tokenizer.decode(r.prompt_tokens(inp))
    assert "You are player_1." in text and "Legal moves: cooperate, defect." in text
    assert text.index("Round 1") < text.index("defect<|im_end|>") < text.index("Round 2")
    assert text.endswith("<|im_start|>assistant\n")
    short = tokenizer.decode(Renderer(tokenizer, RendererConfig(history="none")).prompt_tokens(inp))
    assert "Round 1" not in short


def test_conversation_datum_trains_only_assistant_tokens(tokenizer):
    r = Renderer(tokenizer)
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Pick one."},
        {"role": "assistant", "content": "7"},
    ]
    d = to_datum(r.conversation_datum(messages))
    trained = [t for t, w in zip(d.target_tokens_T, d.weights_T, strict=True) if w]
    assert tokenizer.decode(trained).startswith("7<|im_end|>")
    assert sum(d.weights_T) == len(trained) <= 3


# --- the loop's bookkeeping ------------------------------------------------------------------------------


class _RecordingSampler:
    """Stands in for a SamplingClient: records each call's sampling seed."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    async def sample_async(self, prompt, n, params):
        from types import SimpleNamespace

        self.seeds.append(params.seed)
        return SimpleNamespace(sequences=[SimpleNamespace(text="1", tokens=(16,), logprobs=(-0.5,))])


def test_sampling_seeds_repeat_with_the_seeds_and_differ_within_a_group(tokenizer):
    import asyncio

    from polytinker.agents.rollout import Players
    from polytinker.agents.types import Slot

    spec = AgentSpec("a")
    players = Players({"a": spec}, {"a": Renderer(tokenizer)}, {})
    players.samplers[("a", 0)] = sampler = _RecordingSampler()
    slots = {7: {"player_0": Slot(SlotKind.LEARNER, "a")}}

    def inp(episode: str, turn: int = 0) -> PolicyInput:
        history = tuple(Turn(TextObservation("guess"), "1") for _ in range(turn))
        return PolicyInput("player_0", episode, "g", "Guess.", TextObservation("guess"), history=history, seed=7)

    async def calls(sample_seed: int, evaluation: bool = False) -> list[int | None]:
        policy = players.policy(slots, evaluation=evaluation, sample_seed=sample_seed)
        sampler.seeds.clear()
        # Two episodes of one group (same episode seed), then each one's second turn.
        for i in (inp("x"), inp("y"), inp("y", 1), inp("x", 1)):
            await policy("player_0", i)
        return list(sampler.seeds)

    first = asyncio.run(calls(0))
    assert len(set(first)) == 4  # the episodes of a group, and their turns, draw apart
    assert asyncio.run(calls(0)) == first  # the same seeds: the same draws (episode ids differ per run)
    assert not set(asyncio.run(calls(1))) & set(first)
    assert not set(asyncio.run(calls(0, evaluation=True))) & set(first)


def test_step_seeds_repeat_each_group_and_never_collide():
    config = ExperimentConfig(name="x", agents=(AgentSpec("a"),))
    groups, seeds = step_seeds(config, 0)
    assert len(groups) == config.train.groups and seeds.count(groups[0]) == config.train.group_size
    assert not set(step_seeds(config, 1)[0]) & set(groups)


def test_run_state_round_trips(tmp_path):
    state = RunState(step=3, checkpoints={"a": "polytinker-ckpt://j/step-3"}, versions={"a": 3}, pool={"a": [1, 2]})
    state.save(tmp_path)
    assert RunState.load(tmp_path) == state
    with pytest.raises(ConfigError, match="nothing to resume"):
        RunState.load(tmp_path / "other")


def test_a_fresh_runs_runtime_directory_is_private_from_the_start(tmp_path, caplog):
    import logging
    import os
    import stat

    from polytinker.agents.checkpoint import tenant_key
    from polytinker.scheduler.service.home import private_state_dir

    old_umask = os.umask(0o022)  # the usual umask, under which a plain mkdir makes 0755
    try:
        runtime_dir = tmp_path / "runs" / "fresh" / "runtime"
        assert tenant_key(runtime_dir) == tenant_key(runtime_dir)  # made once, read back after
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    with caplog.at_level(logging.WARNING):
        private_state_dir(runtime_dir)  # what the runtime does with it when it starts
    assert "had mode" not in caplog.text


def test_sampled_turns_reach_the_training_samples_typed(tokenizer):
    import asyncio

    from polytinker.agents.rollout import Players, collect_samples
    from polytinker.agents.types import Slot
    from polytinker.envs import Coordinator, CoordinatorConfig, EnvConfig, make

    class Sampler(_RecordingSampler):
        async def sample_async(self, prompt, n, params):
            if len(self.seeds) == 1:  # the second call outlives the policy's timeout
                self.seeds.append(params.seed)
                await asyncio.sleep(30)
            return await super().sample_async(prompt, n, params)

    players = Players({"a": AgentSpec("a")}, {"a": Renderer(tokenizer)}, {})
    players.samplers[("a", 3)] = Sampler()
    players.current["a"] = 3
    slots = {5: {"player_0": Slot(SlotKind.LEARNER, "a")}}
    env_config = EnvConfig(max_retries=0)
    coordinator = Coordinator(CoordinatorConfig(policy_timeout_s=2.0))
    (result,) = asyncio.run(
        coordinator.run(lambda: make("guess_number-v0", config=env_config, max_guesses=3), players.policy(slots), [5])
    )
    turns = result.trajectories["player_0"].turns
    assert [t.sample is None for t in turns] == [False, True, False]  # the timed-out call sampled nothing
    first = turns[0].sample
    assert first is not None and (first.agent, first.version) == ("a", 3)
    assert first.completion_tokens == (16,) and first.logprobs_T == (-0.5,) and first.prompt_tokens
    samples = collect_samples([result], slots)["a"]
    assert [s.turn_index for s in samples] == [0, 2]
    for s in samples:
        sampled = turns[s.turn_index].sample
        assert sampled is not None and s.version == sampled.version == 3
        assert (s.prompt_tokens, s.completion_tokens, s.logprobs_T) == (
            sampled.prompt_tokens,
            sampled.completion_tokens,
            sampled.logprobs_T,
        )


def test_a_train_run_that_stops_after_a_checkpoint_says_how_to_resume(tmp_path, monkeypatch, capsys) -> None:
    from polytinker import cli
    from polytinker.agents.checkpoint import STATE_FILE
    from polytinker.agents.experiment import Experiment
    from polytinker.errors import WorkerUnavailable

    def stops(self: Experiment, **_: object) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config.name == "checkpointed":
            (self.run_dir / STATE_FILE).write_text("{}")
        raise WorkerUnavailable("worker learner-0 died and did not come back")

    monkeypatch.setattr(Experiment, "train", stops)
    config = "examples/configs/prisoners_dilemma.toml"
    for name in ("checkpointed", "fresh"):
        assert cli.main(["train", config, "--name", name, "--root", str(tmp_path), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "polytinker train: error: worker learner-0 died" in err
        hint = f"the run's last checkpoint is in {tmp_path / name}; to continue from it"
        assert (hint in err and f"polytinker train {config} ... --resume" in err) == (name == "checkpointed"), err
