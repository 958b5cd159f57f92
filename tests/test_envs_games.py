"""Built-in games: PettingZoo's API tests, polytinker's checks, rules, opponents, invalid actions."""

from __future__ import annotations

import warnings

import pytest
from pettingzoo import AECEnv
from pettingzoo.test import api_test, parallel_api_test

from polytinker.envs import Coordinator, EnvConfig, InvalidAction, check_env, env_specs, make, parse_choice
from polytinker.envs.opponents import scripted_policy
from polytinker.errors import ConfigError

BUILTIN = sorted(env_specs())


@pytest.mark.parametrize("env_id", BUILTIN)
def test_pettingzoo_api_test(env_id):
    env = make(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(env, AECEnv):
            api_test(env, num_cycles=300)
        else:
            parallel_api_test(env, num_cycles=300)


@pytest.mark.parametrize("env_id", BUILTIN)
def test_conformance_checks_pass(env_id):
    findings = check_env(env_id)
    failed = [f for f in findings if not f.passed]
    assert not failed, failed
    assert len(findings) >= 9


def _play(env_id, kinds, n=40, seed0=0, **env_kwargs):
    env = make(env_id, **env_kwargs)
    policies = {
        a: scripted_policy(env, k, seed=i) for i, (a, k) in enumerate(zip(env.possible_agents, kinds, strict=True))
    }
    return Coordinator().run_sync(lambda: make(env_id, **env_kwargs), policies, range(seed0, seed0 + n))


@pytest.mark.parametrize("env_id", ["tictactoe-v0", "connect_four-v0"])
def test_heuristic_beats_random_at_board_games(env_id):
    results = _play(env_id, ["random", "heuristic"])
    wins = sum(r.total_rewards["player_1"] > 0 for r in results)
    losses = sum(r.total_rewards["player_1"] < 0 for r in results)
    assert wins >= 30 and losses <= 5, (wins, losses)


def test_heuristic_opponents_of_the_other_games():
    assert all(r.total_rewards["player_0"] == 1.0 for r in _play("guess_number-v0", ["heuristic"]))
    assert sum(r.total_rewards["player_0"] for r in _play("guess_number-v0", ["random"])) < 20
    assert all(r.total_rewards["listener_0"] == 1.0 for r in _play("signal-v0", ["heuristic", "heuristic"]))
    tft = _play("prisoners_dilemma-v0", ["heuristic", "heuristic"], n=5)
    assert all(r.total_rewards == {"player_0": 15.0, "player_1": 15.0} for r in tft)
    deals = _play("negotiation-v0", ["heuristic", "heuristic"])
    assert sum(r.total_rewards["player_0"] > 0 for r in deals) >= 30
    kuhn = _play("kuhn_poker-v0", ["heuristic", "random"], n=200)
    assert sum(r.total_rewards["player_0"] for r in kuhn) > 0


def test_zero_sum_games_sum_to_zero():
    for env_id in ("tictactoe-v0", "connect_four-v0", "kuhn_poker-v0"):
        for r in _play(env_id, ["random", "random"], n=20):
            assert sum(r.total_rewards.values()) == pytest.approx(0.0), env_id


@pytest.mark.parametrize("env_id", BUILTIN)
def test_seeded_episodes_repeat_and_seeds_differ(env_id):
    kinds = ["random"] * len(make(env_id).possible_agents)
    first, again = _play(env_id, kinds, n=6), _play(env_id, kinds, n=6)

    def transcript(rs):
        return [[(a, t.observation.text, t.action) for a, tr in r.trajectories.items() for t in tr.turns] for r in rs]

    assert transcript(first) == transcript(again)
    assert len({str(t) for t in transcript(first)}) > 1, "every seed gave the same episode"


def test_parse_choice_reads_the_last_legal_move():
    legal = ("cooperate", "defect")
    assert parse_choice("  Defect ", legal) == "defect"
    assert parse_choice("I thought about cooperate, but I will defect.", legal) == "defect"
    refused = parse_choice("maybe", legal)
    assert isinstance(refused, InvalidAction) and "cooperate, defect" in refused.reason
    assert isinstance(parse_choice("10", ("1", "2")), InvalidAction)


def test_invalid_action_retries_then_fallback():
    env = make("tictactoe-v0", config=EnvConfig(invalid_action_penalty=-0.5, max_retries=1))
    env.reset(seed=0)
    env.step("nonsense")
    assert env.agent_selection == "player_0"
    obs, reward, *_, info = env.last()
    assert reward == -0.5 and "Invalid action" in obs["text"] and info["retries_left"] == 1
    env.step("still nonsense")  # out of retries: a random legal move is played for player_0
    assert env.agent_selection == "player_1"
    assert env.board.count("X") == 1
    assert env._cumulative_rewards["player_0"] == -0.5


def test_invalid_action_forfeit_ends_the_game():
    config = EnvConfig(max_retries=0, on_retries_exhausted="forfeit", forfeit_reward=-2.0, invalid_action_penalty=0.0)
    env = make("connect_four-v0", config=config)
    env.reset(seed=0)
    env.step("column nine")
    assert all(env.terminations.values())
    assert env._cumulative_rewards["player_0"] == -2.0


def test_parallel_env_waits_for_the_agent_that_retries():
    env = make("prisoners_dilemma-v0", rounds=2)
    env.reset(seed=0)
    obs, rewards, _, _, infos = env.step({"player_0": "cooperate", "player_1": "???"})
    assert env.history == [] and rewards["player_1"] < 0
    assert infos["player_0"]["needs_action"] is False and infos["player_1"]["needs_action"] is True
    assert obs["player_0"]["legal_moves"] == ()
    env.step({"player_0": "defect", "player_1": "defect"})  # player_0's pending move stands
    assert env.history == [("cooperate", "defect")]


def test_game_rules():
    kuhn = make("kuhn_poker-v0")
    kuhn.reset(seed=3)
    for move in ("bet", "fold"):
        kuhn.step(move)
    assert kuhn.rewards == {"player_0": 1.0, "player_1": -1.0}
    neg = make("negotiation-v0")
    neg.reset(seed=1)
    counts, values = neg.counts, neg.values
    neg.step(f"propose books={counts['books']} hats=0 balls=0")
    neg.step("I accept")
    assert neg.rewards["player_0"] == pytest.approx(counts["books"] * values["player_0"]["books"] / 10)
    assert neg.rewards["player_1"] == pytest.approx(
        (counts["hats"] * values["player_1"]["hats"] + counts["balls"] * values["player_1"]["balls"]) / 10
    )
    sig = make("signal-v0")
    sig.reset(seed=0)
    assert isinstance(sig.parse_action("speaker_0", f"it is the {sig.secret}"), InvalidAction)
    assert "secret word is" in sig.observe("speaker_0")["text"]
    assert "secret word is" not in sig.observe("listener_0")["text"]
    assert "secret" not in sig.infos["listener_0"]["view"]


def test_env_arguments_are_validated():
    with pytest.raises(ConfigError, match="rounds"):
        make("prisoners_dilemma-v0", rounds=0)
    with pytest.raises(ConfigError, match="penalty"):
        EnvConfig(invalid_action_penalty=1.0)


def test_retries_start_afresh_after_a_fallback():
    env = make("guess_number-v0", config=EnvConfig(max_retries=1))
    env.reset(seed=0)
    for _ in range(2):  # the second refusal exhausts the retries: a fallback guess is played
        env.step("??")
    assert len(env.guesses) == 1 and env.infos["player_0"]["retries_left"] == 0
    env.step("??")  # a new decision: one retry again
    assert len(env.guesses) == 1 and env.infos["player_0"]["retries_left"] == 1
    env.step("50")
    assert len(env.guesses) == 2 and "invalid_action" not in env.infos["player_0"]


def test_aec_truncation_hook_ends_the_episode_as_truncated():
    from polytinker.envs.games.guess_number import GuessNumberEnv

    class Impatient(GuessNumberEnv):
        def _is_truncated(self):
            return len(self.guesses) >= 2

    (r,) = Coordinator().run_sync(lambda: Impatient(), lambda a, i: "1", [7])
    traj = r.trajectories["player_0"]
    assert len(traj.turns) == 2 and traj.truncated and not traj.terminated
