"""TextArena's two-player games through the text-env API (the optional ``textarena`` extra).

The tests that play real TextArena games are skipped where textarena is not installed; the
error that names the extra is tested everywhere.
"""

from __future__ import annotations

import random
import re
import warnings

import pytest

from polytinker.envs import Coordinator, CoordinatorConfig, EnvConfig, check_env, env_specs, make, scripted_policy
from polytinker.envs import textarena_adapter as ta_adapter
from polytinker.envs.registry import unregister
from polytinker.envs.types import PolicyInput
from polytinker.errors import ConfigError

needs_textarena = pytest.mark.skipif(
    not ta_adapter.textarena_available(),
    reason="textarena is not installed (optional extra: pip install 'polytinker[textarena]')",
)
NO_PENALTY = EnvConfig(invalid_action_penalty=0.0)


@pytest.fixture(autouse=True)
def _forget_textarena_ids():
    yield
    for env_id in [i for i in env_specs() if i.startswith("textarena/")]:
        unregister(env_id)


def _random_play(env_id, seeds, **kwargs):
    env = make(env_id, **kwargs)
    policies = {a: scripted_policy(env, "random", seed=i) for i, a in enumerate(env.possible_agents)}
    return Coordinator().run_sync(lambda: make(env_id, **kwargs), policies, seeds)


def test_without_textarena_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(ta_adapter, "textarena_available", lambda: False)
    with pytest.raises(ConfigError, match=re.escape("polytinker[textarena]")):
        make("textarena/TicTacToe-v0")
    with pytest.raises(ConfigError, match="textarena extra"):
        ta_adapter.register_textarena()
    assert "textarena/TicTacToe-v0" not in env_specs()


@needs_textarena
@pytest.mark.parametrize("game", ["TicTacToe-v0", "KuhnPoker-v0", "SimpleNegotiation-v0"])
def test_conformance_checks_pass(game):
    findings = check_env(f"textarena/{game}")
    assert not [f for f in findings if not f.passed], findings


@needs_textarena
def test_ids_register_on_demand_or_all_at_once():
    assert "textarena/ConnectFour-v0" not in env_specs()
    env = make("textarena/ConnectFour-v0")
    assert env.env_id == "ConnectFour-v0" and env.possible_agents == ["player_0", "player_1"]
    assert env_specs()["textarena/ConnectFour-v0"].source == "textarena"
    ids = ta_adapter.register_textarena()
    assert len(ids) == len(ta_adapter.OFFLINE_GAMES) and all(i in env_specs() for i in ids)
    with pytest.raises(ConfigError, match="no game 'NoSuchGame-v0'"):
        make("textarena/NoSuchGame-v0")


@needs_textarena
def test_tictactoe_through_the_coordinator():
    results = _random_play("textarena/TicTacToe-v0", range(20))
    assert not [r.aborted for r in results if r.aborted]
    outcomes = [r.total_rewards for r in results]
    assert all(o["player_0"] + o["player_1"] == 0 and o["player_0"] in (-1.0, 0.0, 1.0) for o in outcomes)
    assert {o["player_0"] for o in outcomes} >= {1.0, -1.0}, "random play should let both sides win sometimes"
    turn = results[0].trajectories["player_0"].turns[0]
    assert "Available Moves" in turn.observation.text and turn.observation.legal_moves == ()
    assert "TicTacToe-v0" in make("textarena/TicTacToe-v0").instructions("player_0")  # before reset: generic
    env = make("textarena/TicTacToe-v0")
    env.reset(seed=0)
    assert "You are Player 0 in Tic Tac Toe" in env.instructions("player_0")  # TextArena's own prompt


def _connect_four_policy(agent: str, inp: PolicyInput) -> str:
    """Drops a disc in a random column that is not full, read from the newest board shown."""
    board = inp.observation.text.rsplit("Board state:", 1)[1].split("-------------\n", 1)[1]
    top_row = board.splitlines()[0].split()
    rng = random.Random(f"{inp.seed}/{agent}/{len(inp.history)}")
    return f"[col {rng.choice([c for c, cell in enumerate(top_row) if cell == '.'])}]"


@needs_textarena
def test_connect_four_with_a_scripted_player_ends_in_wins_and_losses():
    results = Coordinator().run_sync(lambda: make("textarena/ConnectFour-v0"), _connect_four_policy, range(10))
    for r in results:
        assert r.aborted is None
        assert not [t for tr in r.trajectories.values() for t in tr.turns if t.invalid_reason]
        assert sum(r.total_rewards.values()) == 0 and r.num_steps >= 7
    assert len({r.total_rewards["player_0"] for r in results}) >= 2


@needs_textarena
def test_negotiation_and_kuhn_poker_finish_with_textarena_rewards():
    for r in _random_play("textarena/SimpleNegotiation-v0", range(5), config=NO_PENALTY):
        assert r.aborted is None and r.num_steps >= 2
        assert set(r.total_rewards.values()) <= {-1.0, 0.0, 1.0}
    kuhn = _random_play("textarena/KuhnPoker-v0", range(10))
    assert all(r.aborted is None and sorted(r.total_rewards.values()) == [-1.0, 1.0] for r in kuhn)


@needs_textarena
def test_an_invalid_move_is_textarenas_with_one_retry_then_a_loss():
    env = make("textarena/TicTacToe-v0", config=EnvConfig(invalid_action_penalty=-0.25))
    env.reset(seed=0)
    env.step("the middle, please")
    info = env.infos["player_0"]
    assert env.agent_selection == "player_0" and info["retries_left"] == 1
    assert "does not follow the correct format" in info["invalid_action"]
    assert env.rewards["player_0"] == -0.25
    env.step("still no brackets")
    assert all(env.terminations.values())
    assert env._cumulative_rewards == {"player_0": -1.25, "player_1": 1.0}
    assert env.infos["player_0"]["retries_left"] == 0
    assert "Game over" in env.observe("player_1")["text"]


@needs_textarena
def test_a_valid_move_after_a_refusal_clears_it():
    env = make("textarena/TicTacToe-v0")
    env.reset(seed=0)
    env.step("[9]")  # outside 0..8
    assert "invalid_action" in env.infos["player_0"]
    env.step("I take the centre: [4]")
    assert env.agent_selection == "player_1" and "invalid_action" not in env.infos["player_0"]
    assert env.inner.state.game_state["board"][1][1] == "O"


@needs_textarena
def test_seeded_episodes_repeat_interleaved_and_leave_global_random_alone():
    def transcripts(results):
        return [
            [(a, t.observation.text, t.action) for a, tr in r.trajectories.items() for t in tr.turns] for r in results
        ]

    def run(concurrent):
        env_id = "textarena/KuhnPoker-v0"  # deals its cards from the global random module
        env = make(env_id)
        policies = {a: scripted_policy(env, "random", seed=i) for i, a in enumerate(env.possible_agents)}
        coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=concurrent))
        return transcripts(coordinator.run_sync(lambda: make(env_id), policies, range(8)))

    random.seed(123)
    expected = random.random()
    random.seed(123)
    one_at_a_time, interleaved = run(1), run(8)
    assert random.random() == expected, "the games drew from the caller's random state"
    assert one_at_a_time == interleaved
    assert len({str(t) for t in one_at_a_time}) > 1, "every seed dealt the same cards"


HOSTILE = ["[", "]", "[]", "[[[]]]", "[-1]", "[" + "9" * 40 + "]", "\x00\x7f", "é[4]ü", "[col -3]", "[Offer: -> ]"]


@needs_textarena
@pytest.mark.parametrize("game", ["TicTacToe-v0", "ConnectFour-v0", "SimpleNegotiation-v0", "KuhnPoker-v0"])
def test_hostile_actions_never_crash(game):
    rng = random.Random(game)
    for seed in range(5):
        env = make(f"textarena/{game}")
        env.reset(seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(40):
                if not env.agents:
                    break
                agent = env.agent_selection
                if env.terminations[agent]:
                    env.step(None)
                    continue
                env.step(rng.choice([*HOSTILE, 12, None, "x" * 5000]))
                assert env.observation_space(agent).contains(env.observe(agent))


@needs_textarena
def test_a_game_that_raises_is_rolled_back_and_the_move_refused():
    env = make("textarena/TicTacToe-v0")
    env.reset(seed=0)
    game_step = type(env.inner).step

    def fragile_step(action):
        if "boom" in action:
            env.inner.state.game_state["board"][0][0] = "X"  # a half-made move, then a crash
            raise RuntimeError("boom")
        return game_step(env.inner, action)

    env.inner.step = fragile_step
    env.step("[boom]")
    assert env.agent_selection == "player_0" and "RuntimeError" in env.infos["player_0"]["invalid_action"]
    assert env.inner.state.game_state["board"][0][0] == ""
    env.step("[0]")
    assert env.inner.state.game_state["board"][0][0] == "O" and env.agent_selection == "player_1"


@needs_textarena
def test_observation_new_shows_only_what_came_since_the_last_move():
    full, new = make("textarena/TicTacToe-v0"), make("textarena/TicTacToe-v0", observation="new")
    for env in (full, new):
        env.reset(seed=0)
        env.step("[4]")
        env.step("[0]")
    assert full.observe("player_0")["text"].count("Current Board") == 3
    assert new.observe("player_0")["text"].count("Current Board") == 2  # after its move, after the reply
    with pytest.raises(ConfigError, match="observation"):
        make("textarena/TicTacToe-v0", observation="some")


@needs_textarena
def test_an_env_server_serves_textarena_games_as_played_here():
    from polytinker.envs import EnvServer, RemoteEnv

    env_id = "textarena/KuhnPoker-v0"

    def policies():
        env = make(env_id)
        return {a: scripted_policy(env, "random", seed=i) for i, a in enumerate(env.possible_agents)}

    with EnvServer("tcp://127.0.0.1:0", env_ids=[env_id]) as server:
        remote = Coordinator().run_sync(lambda: RemoteEnv.aopen(server.address, env_id), policies(), range(16))
    local = Coordinator().run_sync(lambda: make(env_id), policies(), range(16))
    assert [r.aborted for r in remote] == [None] * 16
    assert [r.total_rewards for r in remote] == [r.total_rewards for r in local]
    texts = [[t.observation.text for t in r.trajectories[a].turns] for r in remote for a in r.trajectories]
    assert texts == [[t.observation.text for t in r.trajectories[a].turns] for r in local for a in r.trajectories]
