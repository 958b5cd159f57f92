"""The episode coordinator: trajectories, rewards, history, barriers, invalid actions, timeouts."""

from __future__ import annotations

import asyncio

import pytest
from fixtures.envs import FlakyEnv

from polytinker.envs import (
    AgentAction,
    Coordinator,
    CoordinatorConfig,
    EnvConfig,
    PolicyInput,
    make,
)
from polytinker.envs.opponents import scripted_policy


def test_aec_trajectories_add_up_to_the_env_rewards():
    env = make("tictactoe-v0")
    policies = {a: scripted_policy(env, "random", i) for i, a in enumerate(env.possible_agents)}
    for r in Coordinator().run_sync(lambda: make("tictactoe-v0"), policies, range(20), env_id="tictactoe-v0"):
        assert r.aborted is None and r.env_id == "tictactoe-v0"
        x, o = r.trajectories["player_0"], r.trajectories["player_1"]
        assert len(x.turns) in (len(o.turns), len(o.turns) + 1)
        assert r.num_steps == len(x.turns) + len(o.turns)
        for traj in (x, o):
            assert traj.terminated and not traj.truncated
            assert sum(t.reward for t in traj.turns) == pytest.approx(traj.total_reward)
        # The last mover's final turn carries the result.
        if r.total_rewards["player_0"]:
            assert abs(x.turns[-1].reward) == 1.0 or abs(o.turns[-1].reward) == 1.0


def test_policy_input_carries_instructions_history_and_chat_messages():
    seen: list[PolicyInput] = []

    async def policy(agent, inp):
        seen.append(inp)
        return inp.observation.legal_moves[0]

    (r,) = Coordinator().run_sync(lambda: make("guess_number-v0"), policy, [5])
    assert seen[0].instructions.startswith("Find a secret") and seen[0].history == ()
    last = seen[-1]
    assert [t.action for t in last.history] == [t.action for t in r.trajectories["player_0"].turns[:-1]]
    messages = last.to_messages()
    assert messages[0] == {"role": "system", "content": last.instructions}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * len(last.history) + ["user"]
    assert messages[-1]["content"] == last.observation.text
    assert last.episode_id == r.episode_id


def test_parallel_moves_wait_behind_a_barrier():
    """Both agents are asked before the env steps: the slow one holds the round."""
    order: list[str] = []

    async def policy(agent, inp):
        order.append(f"ask {agent}")
        await asyncio.sleep(0.02 if agent == "player_0" else 0.0)
        order.append(f"answer {agent}")
        return "cooperate"

    (r,) = Coordinator().run_sync(lambda: make("prisoners_dilemma-v0", rounds=3), policy, [0])
    assert set(order[:2]) == {"ask player_0", "ask player_1"}  # both asked before anyone answers
    assert order[2:5] == ["answer player_1", "answer player_0", order[0]]  # the round waits for the slow one
    assert r.num_steps == 3 and r.total_rewards == {"player_0": 9.0, "player_1": 9.0}


def test_invalid_actions_are_recorded_and_retried():
    calls = {"n": 0}

    def policy(agent, inp):
        calls["n"] += 1
        return "no idea" if inp.retry == 0 else inp.observation.legal_moves[0]

    env_config = EnvConfig(invalid_action_penalty=-0.25)
    (r,) = Coordinator().run_sync(lambda: make("guess_number-v0", config=env_config), policy, [1])
    turns = r.trajectories["player_0"].turns
    assert turns[0].invalid_reason and "whole number" in turns[0].invalid_reason
    assert turns[0].reward == -0.25
    assert turns[1].invalid_reason is None and "Invalid action" in turns[1].observation.text
    assert all(t.invalid_reason for t in turns[0::2]) and not any(t.invalid_reason for t in turns[1::2])


def test_policy_timeout_counts_as_an_invalid_action():
    async def slow(agent, inp):
        await asyncio.sleep(10)
        return "1"

    config = CoordinatorConfig(policy_timeout_s=0.05)
    env_config = EnvConfig(max_retries=0)
    (r,) = Coordinator(config).run_sync(lambda: make("guess_number-v0", config=env_config, max_guesses=2), slow, [0])
    turns = r.trajectories["player_0"].turns
    assert len(turns) == 2 and all(t.timed_out and t.action == "" and t.invalid_reason for t in turns)


def test_many_episodes_run_concurrently_and_keep_seed_order():
    active = {"now": 0, "peak": 0}

    async def policy(agent, inp):
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        await asyncio.sleep(0.001)
        active["now"] -= 1
        return inp.observation.legal_moves[0]

    config = CoordinatorConfig(max_concurrent_episodes=16)
    results = Coordinator(config).run_sync(lambda: make("tictactoe-v0"), policy, range(40))
    assert active["peak"] == 16
    assert [r.seed for r in results] == list(range(40))


def test_agent_action_meta_is_kept():
    def policy(agent, inp):
        return AgentAction(inp.observation.legal_moves[-1], meta={"logprobs": [-0.5], "adapter": agent})

    (r,) = Coordinator().run_sync(lambda: make("kuhn_poker-v0"), policy, [0])
    for agent, traj in r.trajectories.items():
        assert all(t.meta == {"logprobs": [-0.5], "adapter": agent} for t in traj.turns)


def test_an_env_that_raises_aborts_only_its_episode():
    def policy(agent, inp):
        return "boom" if inp.episode_id == "bad" else "ok"

    async def main():
        coordinator = Coordinator()
        good = coordinator.run_episode(FlakyEnv(), policy, seed=0, episode_id="good")
        bad = coordinator.run_episode(FlakyEnv(), policy, seed=0, episode_id="bad")
        return await asyncio.gather(good, bad)

    good, bad = asyncio.run(main())
    assert good.aborted is None and good.total_rewards == {"player_0": 3.0}
    assert bad.aborted is not None and "the env blew up" in bad.aborted


def test_a_failing_policy_is_the_callers_error():
    def policy(agent, inp):
        raise KeyError("no such adapter")

    with pytest.raises(KeyError, match="no such adapter"):
        Coordinator().run_sync(lambda: make("tictactoe-v0"), policy, [0])
    with pytest.raises(TypeError, match="return str or AgentAction"):
        Coordinator().run_sync(lambda: make("tictactoe-v0"), lambda a, i: 5, [0])


def test_step_limit_aborts_an_endless_episode():
    config = CoordinatorConfig(max_steps_per_episode=3)
    (r,) = Coordinator(config).run_sync(lambda: make("connect_four-v0"), lambda a, i: i.observation.legal_moves[0], [0])
    assert r.aborted and "step limit" in r.aborted and r.num_steps == 3
