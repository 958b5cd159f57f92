"""debate-v0: claims from the seed, the scripted referee's rule, the judge agent, rewards, hostile input."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
from pettingzoo.test import api_test

from polytinker.envs import Coordinator, EnvConfig, InvalidAction, check_env, make, scripted_policy
from polytinker.envs.games.debate import NO_ARGUMENT, Claim, draw_claim, referee_verdict, stated_value
from polytinker.errors import ConfigError

# 47*3 = 141: "47*3 is larger than 150" is false, so con is the side that is right.
CLAIM = Claim("compare", 47, "*", 3, 150)


def _play(kinds, n=100, **kwargs):
    env = make("debate-v0", **kwargs)
    policies = {
        a: scripted_policy(env, k, seed=i) for i, (a, k) in enumerate(zip(env.possible_agents, kinds, strict=True))
    }
    return Coordinator().run_sync(lambda: make("debate-v0", **kwargs), policies, range(n))


@pytest.mark.parametrize("referee", ["scripted", "agent"])
def test_pettingzoo_api_test_and_conformance(referee):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(make("debate-v0", referee=referee), num_cycles=300)
    findings = check_env(lambda: make("debate-v0", referee=referee, rounds=1))
    assert not [f for f in findings if not f.passed], findings


def test_claims_are_seeded_verifiable_and_balanced():
    claims = [draw_claim(np.random.default_rng(s)) for s in range(400)]
    assert claims[:20] == [draw_claim(np.random.default_rng(s)) for s in range(20)]
    assert {c.kind for c in claims} == {"compare", "value"} and {c.op for c in claims} == {"+", "-", "*"}
    assert 0.4 < sum(c.is_true for c in claims) / len(claims) < 0.6
    assert CLAIM.value == 141 and not CLAIM.is_true and CLAIM.right_side == "con"
    assert Claim("compare", 47, "*", 3, 141).is_true is False  # "larger": equal is not larger
    assert Claim("value", 47, "*", 3, 141).text == "47*3 equals 141"
    env = make("debate-v0")
    env.reset(seed=5)
    first = env.claim
    env.reset(seed=5)
    assert env.claim == first and "Claim: " + first.text in env.observe("pro")["text"]


def test_stated_value_reads_the_last_equation_about_the_claim():
    assert stated_value("47*3 = 141", CLAIM) == 141
    assert stated_value("3 x 47 = 141, and 47 × 3 = 140", CLAIM) == 140  # the last one counts
    assert stated_value("47*3 = 151? No: 47*3 = 141.", CLAIM) == 141
    assert stated_value("2*3 = 6 and 47+3 = 50", CLAIM) is None  # other expressions are not about it
    assert stated_value("147*3 = 441", CLAIM) is None and stated_value("4.7*3 = 14.1", CLAIM) is None
    minus = Claim("value", 342, "-", 37, 305)
    assert stated_value("37-342 = -305", minus) is None and stated_value("342 - 37 = 305", minus) == 305


def test_the_referee_rule():
    right, wrong = ("con", "47*3 = 141, so no."), ("pro", "It is larger, trust me.")
    assert referee_verdict(CLAIM, [wrong, right])[0] == "con"  # the right side shows the computation
    assert referee_verdict(CLAIM, [("pro", "47*3 = 160 > 150"), ("con", "No.")])[0] == "con"  # caught lying
    winner, why = referee_verdict(CLAIM, [("pro", "Yes."), ("con", "47*3 = 150, not more.")])
    assert winner == "pro" and "wrong" in why  # the right side caught lying loses, even to the wrong side
    assert referee_verdict(CLAIM, [("pro", "47*3 = 141 ... hm"), ("con", "No.")])[0] == "con"  # proves con right
    assert referee_verdict(CLAIM, [("pro", "Yes."), ("con", "No.")]) == (None, "nobody showed what 47*3 is")
    assert referee_verdict(CLAIM, [("pro", "47*3 = 1"), ("con", "47*3 = 2")])[0] is None  # both caught
    # A later argument replaces an earlier equation: corrected in round 2, not caught.
    rounds = [("pro", "47*3 = 160"), ("con", "No."), ("pro", "Sorry: 47*3 = 141."), ("con", "Indeed.")]
    assert referee_verdict(CLAIM, rounds)[0] == "con"


def test_honest_computation_wins_and_rewards_are_zero_sum():
    env = make("debate-v0")
    for r in _play(["heuristic", "heuristic"]):
        env.reset(seed=r.seed)  # the same claim the episode had
        winner = max(r.total_rewards, key=r.total_rewards.get)
        assert sorted(r.total_rewards.values()) == [-1.0, 1.0] and winner == env.claim.right_side, r.seed
    outcomes = collections.Counter(r.total_rewards["pro"] for r in _play(["random", "random"]))
    assert set(outcomes) == {-1.0, 0.0, 1.0}
    for r in _play(["random", "heuristic"]):
        assert sum(r.total_rewards.values()) == 0.0


def test_judge_agent_decides_and_is_scored_on_the_truth():
    results = _play(["random", "random", "heuristic"], n=60, referee="agent", rounds=1)
    for r in results:
        assert r.total_rewards["judge"] == 1.0
        assert r.total_rewards["pro"] + r.total_rewards["con"] == 0.0
    random_judge = _play(["heuristic", "heuristic", "random"], n=100, referee="agent", rounds=1)
    correct = sum(r.total_rewards["judge"] for r in random_judge)
    assert 25 < correct < 75 and {r.total_rewards["judge"] for r in random_judge} == {0.0, 1.0}
    env = make("debate-v0", referee="agent", rounds=1)
    env.reset(seed=0)
    env.step("argument one")
    env.step("argument two")
    assert env.agent_selection == "judge" and env.legal_moves("judge") == ("pro", "con")
    assert "Who is right?" in env.observe("judge")["text"] and "argument two" in env.observe("judge")["text"]
    env.step("Having read both, I side with con.")
    assert all(env.terminations.values()) and env.verdict[0] == "con"
    assert env.rewards["con"] == 1.0 and env.rewards["pro"] == -1.0
    assert env.rewards["judge"] == (1.0 if env.claim.right_side == "con" else 0.0)


def test_hostile_arguments_are_refused_or_read_safely():
    env = make("debate-v0", config=EnvConfig(max_retries=1), max_argument_chars=40)
    env.reset(seed=0)
    for bad in ("", "   ", None, 17, "x" * 41, "y" * 10_000):
        assert isinstance(env.parse_action("pro", bad), InvalidAction), bad
    env.step("z" * 41)
    assert env.agent_selection == "pro" and "shorten" in env.infos["pro"]["invalid_action"]
    env.step("z" * 41)  # out of retries: the fallback argument is said for pro
    assert env.arguments == [("pro", NO_ARGUMENT)] and env.agent_selection == "con"
    env.step("9" * 20 + "*3=1 é\x00\u202e")
    assert env.agent_selection == "pro" and env.observation_space("pro").contains(env.observe("pro"))
    judge = make("debate-v0", referee="agent", rounds=1)
    judge.reset(seed=0)
    judge.step("a")
    judge.step("b")
    assert isinstance(judge.parse_action("judge", "neither"), InvalidAction)


def test_arguments_are_validated():
    for kwargs, field in (
        ({"rounds": 0}, "rounds"),
        ({"referee": "jury"}, "referee"),
        ({"max_argument_chars": 5}, "max_argument_chars"),
    ):
        with pytest.raises(ConfigError, match=field):
            make("debate-v0", **kwargs)
    assert make("debate-v0", referee="agent").possible_agents == ["pro", "con", "judge"]
    assert make("debate-v0").possible_agents == ["pro", "con"]
