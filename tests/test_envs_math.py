"""Math envs: the problem generator, answer parsing, math-v0 / math_tool-v0 rewards and attempts,
the solver/verifier team's credit rules, scripted baselines, hostile answers."""

from __future__ import annotations

import importlib.util
import warnings
from fractions import Fraction

import msgpack
import numpy as np
import pytest
from pettingzoo.test import api_test

from polytinker.envs import Coordinator, EnvConfig, InvalidAction, check_env, make
from polytinker.envs.games.math_tasks import MathTaskConfig, evaluate, generate, parse_answer
from polytinker.envs.opponents import scripted_policy
from polytinker.errors import ConfigError

VARIANTS = [
    ("math-v0", {}),
    ("math-v0", {"attempts": 3, "digits": 2, "operations": 3, "ops": ["+", "-", "*", "/"], "allow_negative": True}),
    ("math_tool-v0", {}),
    ("math_tool-v0", {"attempts": 2, "tools": ["python"]}),
    ("solver_verifier-v0", {}),
    ("solver_verifier-v0", {"rounds": 3, "verifier_credit": "sum", "digits": 2}),
]


@pytest.mark.parametrize(("env_id", "kwargs"), VARIANTS)
def test_pettingzoo_api_test_and_conformance(env_id, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(make(env_id, **kwargs), num_cycles=300)
    failed = [f for f in check_env(lambda: make(env_id, **kwargs)) if not f.passed]
    assert not failed, failed


def _play(env_id, kinds, n=60, **kwargs):
    env = make(env_id, **kwargs)
    policies = {
        a: scripted_policy(env, k, seed=i) for i, (a, k) in enumerate(zip(env.possible_agents, kinds, strict=True))
    }
    return Coordinator().run_sync(lambda: make(env_id, **kwargs), policies, range(n))


def _problems(seed, n=20, **knobs):
    rng = np.random.default_rng(seed)
    config = MathTaskConfig(**knobs)
    return [generate(config, rng) for _ in range(n)]


# -- the generator


def test_problems_repeat_under_a_seed_and_differ_across_seeds():
    assert _problems(1) == _problems(1)
    assert _problems(1) != _problems(2)
    assert len({p.question for p in _problems(3, digits=2)}) > 10


def test_difficulty_knobs_shape_the_problems():
    for p in _problems(0, digits=(3, 2), ops=("*",)):
        a, op, b = p.expression.split()
        assert op == "*" and len(a) == 3 and len(b) == 2 and p.answer == int(a) * int(b)
    for p in _problems(0, digits=1, operations=4, ops=("+", "-")):
        assert len(p.expression.split()) == 9 and p.answer >= 0  # allow_negative is off by default
    signs = {p.answer < 0 for p in _problems(0, n=60, ops=("-",), allow_negative=True)}
    assert signs == {True, False}
    for p in _problems(5, n=60, digits=2, operations=3, ops=("*", "/", "+"), allow_negative=True):
        assert evaluate(p.expression) == p.answer  # divisions come out even
        assert p.question == f"{p.expression} = ?"


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"operations": 0}, "operations"),
        ({"digits": (2, 2, 2)}, "one digit count per operand"),
        ({"digits": 12}, "1..9 digits"),
        ({"ops": ("^",)}, "ops must be"),
        ({"source": "elsewhere"}, "source"),
    ],
)
def test_bad_knobs_are_refused(knobs, match):
    with pytest.raises(ConfigError, match=match):
        MathTaskConfig(**knobs)


def test_env_arguments_are_validated():
    with pytest.raises(ConfigError, match="unknown keyword arguments"):
        make("math-v0", digitz=2)
    with pytest.raises(ConfigError, match="attempts"):
        make("math-v0", attempts=0)
    with pytest.raises(ConfigError, match="tools"):
        make("math_tool-v0", tools=["no such tool!"])
    with pytest.raises(ConfigError, match="rounds"):
        make("solver_verifier-v0", rounds=-1)
    with pytest.raises(ConfigError, match="verifier_credit"):
        make("solver_verifier-v0", verifier_credit="max")


def test_evaluate_is_exact_with_precedence_signs_and_parentheses():
    assert evaluate("2 + 3 * 4") == 14
    assert evaluate("3 - -6 * -9") == -51
    assert evaluate("(2 + 3) * 4 - 7 / 2") == Fraction(33, 2)
    for bad in ("2 +", "2 ** 3", "(1 + 2", "4 / 0", "import os", "1" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("19", 19),
        ("So 12 + 7 = 19.", 19),
        ("I first thought 18, but it is 19", 19),
        ("-7", -7),
        ("x=-7", -7),
        ("10-7", 7),
        ("1,234", 1234),
        ("19.0", 19),
        ("7.5", None),
        ("nineteen", None),
        ("\u0661\u0669", None),  # Arabic-Indic digits are not the ASCII numbers asked for
        ("²", None),
        ("12abc", None),
        ("", None),
    ],
)
def test_parse_answer_reads_the_last_whole_number(text, value):
    assert parse_answer(text) == value


# -- math-v0 and math_tool-v0


def test_a_right_answer_earns_one_and_a_wrong_one_nothing():
    for text, reward in (("right", 1.0), ("wrong", 0.0)):
        env = make("math-v0")
        env.reset(seed=4)
        answer = env.problem.answer if text == "right" else env.problem.answer + 1
        assert env.observe("player_0")["text"] == f"Problem: {env.problem.question}"
        env.step(f"The answer is {answer}.")
        assert env.terminations["player_0"] and env.rewards["player_0"] == reward
        assert ("Correct!" in env.render()) == (reward == 1.0)


def test_attempts_give_decreasing_reward():
    env = make("math-v0", attempts=3)
    env.reset(seed=0)
    right = env.problem.answer
    assert "3 attempts" in env.instructions("player_0")
    env.step(str(right + 1))
    obs, reward, terminated, *_ = env.last()
    assert reward == 0.0 and not terminated and "Try again (2 attempts left)" in obs["text"]
    env.step(str(right + 2))
    env.step(str(right))
    assert env.terminations["player_0"] and env.rewards["player_0"] == pytest.approx(1 / 3)
    env.reset(seed=0)
    for _ in range(3):
        env.step("0" if right else "1")
    assert env.terminations["player_0"] and env._cumulative_rewards["player_0"] == 0.0
    assert f"The answer was {right}." in env.render()


def test_an_answer_without_a_number_is_refused_then_counts_as_no_answer():
    env = make("math-v0", config=EnvConfig(max_retries=1, invalid_action_penalty=-0.25))
    env.reset(seed=0)
    env.step("I do not know")
    obs, reward, terminated, _, info = env.last()
    assert reward == -0.25 and not terminated and info["retries_left"] == 1 and "whole number" in obs["text"]
    env.step("still no idea")  # out of retries: no answer, a wrong attempt
    assert env.terminations["player_0"] and env.answers == [None]
    assert env.rewards["player_0"] == -0.25  # the second refusal's penalty


def test_math_tool_declares_its_tools_and_poses_harder_problems():
    env = make("math_tool-v0")
    env.reset(seed=0)
    assert env.tools("player_0") == ("calculator",) and "calculator tool" in env.instructions("player_0")
    assert env.metadata["name"] == "math_tool_v0"
    a, op, b = env.problem.expression.split()
    assert (len(a), op, len(b)) == (3, "*", 2)
    assert make("math_tool-v0", tools=["python"]).tools("player_0") == ("python",)
    plain = make("math-v0")
    assert plain.tools("player_0") == () and "tool" not in plain.instructions("player_0")


@pytest.mark.parametrize("env_id", ["math-v0", "math_tool-v0"])
def test_heuristic_solves_everything_and_random_rarely(env_id):
    assert all(r.total_rewards["player_0"] == 1.0 for r in _play(env_id, ["heuristic"]))
    assert sum(r.total_rewards["player_0"] for r in _play(env_id, ["random"])) < 20


def test_hostile_answers_are_played_or_refused_and_views_stay_packable():
    env = make("math-v0", attempts=10, config=EnvConfig(max_retries=20))
    env.reset(seed=1)
    hostile = ["9" * 500, "-" * 100 + "5", "\x00\u202e12", "<calculator>1/0</calculator>", None, 12, "1e309", "  "]
    for text in hostile:
        if env.terminations["player_0"]:
            break
        env.step(text)
        obs = env.observe("player_0")
        assert env.observation_space("player_0").contains(obs)
        msgpack.packb(env.infos["player_0"]["view"])  # answers as text: no 64-bit overflow
    assert "9" * 500 in env.view("player_0")["answers"]
    assert isinstance(env.parse_action("player_0", "x" * 600), InvalidAction)


# -- solver_verifier-v0


def _team(**kwargs):
    env = make("solver_verifier-v0", **kwargs)
    env.reset(seed=2)
    return env, env.problem.answer


def _steps(env, actions):
    """Play the actions; each agent's rewards summed over the episode."""
    totals = dict.fromkeys(env.possible_agents, 0.0)
    for action in actions:
        env.step(action)
        for agent, reward in env.rewards.items():
            totals[agent] += reward
    return totals


def test_solver_then_verifier_and_an_accept_ends_the_episode():
    env, right = _team()
    assert env.agent_selection == "solver" and env.observe("solver")["legal_moves"] == ()
    env.step(str(right))
    assert env.agent_selection == "verifier" and env.observe("verifier")["legal_moves"] == ("accept", "reject")
    assert f"The solver answers: {right}." in env.observe("verifier")["text"]
    env.step("accept")
    assert all(env.terminations.values())
    assert env.final_correct and env.rewards == {"solver": 1.0, "verifier": 1.0}


def test_accepting_a_wrong_answer_earns_nothing():
    env, right = _team()
    env.step(str(right + 5))
    env.step("Accepted.")
    assert all(env.terminations.values()) and env.rewards == {"solver": 0.0, "verifier": 0.0}


def test_a_reject_shows_the_critique_and_the_solver_revises():
    env, right = _team()
    env.step(str(right - 1))
    env.step(f"REJECT: {right - 1} is too low")
    assert env.agent_selection == "solver" and not any(env.terminations.values())
    text = env.observe("solver")["text"]
    assert f"Your answer {right - 1} was rejected: {right - 1} is too low." in text and "revision 1 of 1" in text
    assert env.infos["solver"]["view"]["critiques"] == [f"{right - 1} is too low"]
    env.step(str(right))
    env.step("accept")
    assert all(env.terminations.values())
    assert env.rewards == {"solver": 1.0, "verifier": 1.0}  # mean over two right decisions


@pytest.mark.parametrize(("credit", "verifier_total"), [("mean", 0.5), ("sum", 1.0), ("team", 1.0)])
def test_a_needless_reject_costs_the_verifier_under_mean_credit(credit, verifier_total):
    env, right = _team(verifier_credit=credit)
    totals = _steps(env, (str(right), "reject: check again", str(right), "accept"))
    assert all(env.terminations.values())
    assert totals == {"solver": 1.0, "verifier": verifier_total}


def test_team_credit_pays_the_verifier_the_final_answer_only():
    env, right = _team(verifier_credit="team")
    assert "You score when the solver's final answer is right." in env.instructions("verifier")
    # A right reject whose critique does not lead to a right revision earns nothing under team credit.
    assert _steps(env, (str(right + 1), f"reject: {right + 1} is wrong", str(right + 2), "reject")) == {
        "solver": 0.0,
        "verifier": 0.0,
    }
    env, right = _team(verifier_credit="team")
    assert _steps(env, (str(right + 1), f"reject: it is {right}", str(right), "accept")) == {
        "solver": 1.0,
        "verifier": 1.0,
    }


def test_correction_credit_counts_a_reject_only_with_the_right_answer():
    env, right = _team(verifier_credit="correction")
    assert "reject: <the right answer>" in env.instructions("verifier")
    env.step(str(right + 1))
    assert "reject: <the right answer>." in env.observe("verifier")["text"]
    # A reject that names no number, then one that names the right answer: one of two decisions right.
    totals = _steps(env, ("reject: too high", str(right + 2), f"reject: it is {right}"))
    assert all(env.terminations.values()) and totals == {"solver": 0.0, "verifier": 0.5}
    env, right = _team(verifier_credit="correction")
    assert _steps(env, (str(right), "accept")) == {"solver": 1.0, "verifier": 1.0}
    env, right = _team(verifier_credit="correction")
    assert _steps(env, (str(right), f"reject: {right}", str(right), "accept")) == {"solver": 1.0, "verifier": 0.5}


def test_the_episode_ends_when_the_revisions_run_out():
    env, right = _team(rounds=2, verifier_credit="sum")
    totals = _steps(env, (str(right + 1), "reject", str(right + 2), "reject", str(right + 3)))
    assert not any(env.terminations.values())
    totals["verifier"] += _steps(env, ["reject: still wrong"])["verifier"]
    assert all(env.terminations.values()) and not env.final_correct
    assert totals == {"solver": 0.0, "verifier": 3.0}
    env, right = _team(rounds=0)
    totals = _steps(env, (str(right + 1), "reject"))
    assert all(env.terminations.values()) and totals == {"solver": 0.0, "verifier": 1.0}


def test_the_verifier_is_read_by_its_first_keyword_and_critiques_are_bounded():
    env, _ = _team(max_critique_chars=10)
    env.step("3")
    assert env.parse_action("verifier", "I accept") == (True, "")
    assert env.parse_action("verifier", "reject: I cannot accept this") == (False, "I cannot a")
    assert env.parse_action("verifier", "It rejects; fine") == (False, "fine")
    # A bare number is the verifier's own answer: equal to the solver's accepts, else it is the critique.
    assert env.parse_action("verifier", " 3.") == (True, "")
    assert env.parse_action("verifier", "The answer is 12") == (False, "12")
    for text in ("looks fine to me", "acceptable", "unaccepted", ""):
        assert isinstance(env.parse_action("verifier", text), InvalidAction), text


def test_only_the_verifier_gets_the_tools_it_is_given():
    env, _ = _team()
    assert env.tools("solver") == env.tools("verifier") == ()
    env, _ = _team(verifier_tools=["calculator"])
    assert env.tools("verifier") == ("calculator",) and env.tools("solver") == ()
    assert "calculator tool to check the answer" in env.instructions("verifier")
    assert "calculator" not in env.instructions("solver")
    with pytest.raises(ConfigError, match="tools must be tool names"):
        make("solver_verifier-v0", verifier_tools=["rm -rf /"])


def test_a_verifier_beats_the_lenient_baseline():
    lenient = _play("solver_verifier-v0", ["heuristic", "lenient"], n=80)
    checked = _play("solver_verifier-v0", ["heuristic", "heuristic"], n=80)
    alone = sum(r.total_rewards["solver"] for r in lenient) / 80
    team = sum(r.total_rewards["solver"] for r in checked) / 80
    assert 0.3 < alone < 0.7 and team == 1.0, (alone, team)
    assert all(r.total_rewards["verifier"] == 1.0 for r in checked)
    noisy_alone = _play("solver_verifier-v0", ["random", "lenient"], n=80, rounds=3)
    noisy_team = _play("solver_verifier-v0", ["random", "heuristic"], n=80, rounds=3)
    assert sum(r.total_rewards["solver"] for r in noisy_team) > sum(r.total_rewards["solver"] for r in noisy_alone)


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="needs the reasoning-gym extra")
def test_reasoning_gym_problems_through_the_same_env():
    kwargs = {"source": "reasoning_gym:chain_sum", "source_kwargs": {"min_terms": 2, "max_terms": 3, "max_digits": 2}}
    first, again = _problems(7, n=5, **kwargs), _problems(7, n=5, **kwargs)
    assert first == again and all(p.answer == evaluate(p.expression) for p in first)
    results = _play("math-v0", ["heuristic"], n=10, **kwargs)
    assert all(r.total_rewards["player_0"] == 1.0 for r in results)
    with pytest.raises(ConfigError, match="no_such_task"):
        _problems(0, n=1, source="reasoning_gym:no_such_task")
