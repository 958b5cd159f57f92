"""textworld-v0: PettingZoo's API test, the conformance checks, the rules, the oracle plan and the
scripted expert on seeded worlds, partial observability, hostile actions, the step limit, seeds."""

from __future__ import annotations

import warnings

import pytest
from pettingzoo.test import api_test

from polytinker.envs import Coordinator, EnvConfig, check_env, make
from polytinker.envs.games.textworld import TextWorldEnv
from polytinker.envs.games.textworld_gen import FAMILIES, kind_of
from polytinker.envs.opponents import scripted_policy
from polytinker.errors import ConfigError

ALL = list(FAMILIES)
# The easy default, every family in one room, and bigger worlds (several rooms, more of everything).
SETTINGS = [
    {},
    {"families": ALL},
    {"rooms": 2, "families": ALL},
    {"rooms": 4, "receptacles": 6, "distractors": 3, "families": ALL},
    {"rooms": 3, "receptacles": 3, "distractors": 0, "families": ALL, "memory": False, "info_commands": False},
]


def _success(kind: str, n: int, **kwargs) -> list[float]:
    env = TextWorldEnv(**kwargs)
    policy = scripted_policy(env, kind, seed=0)
    results = Coordinator().run_sync(lambda: TextWorldEnv(**kwargs), {"player_0": policy}, range(n))
    assert not any(r.aborted for r in results), [r.aborted for r in results if r.aborted]
    return [r.total_rewards["player_0"] for r in results]


def _text(env: TextWorldEnv) -> str:
    return env.observe("player_0")["text"]


@pytest.mark.parametrize("kwargs", [SETTINGS[0], SETTINGS[3]], ids=["easy", "big"])
def test_pettingzoo_api_test(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(TextWorldEnv(**kwargs), num_cycles=300)


@pytest.mark.parametrize("kwargs", [SETTINGS[0], SETTINGS[3]], ids=["easy", "big"])
def test_conformance_checks_pass(kwargs):
    findings = check_env(lambda: TextWorldEnv(**kwargs))
    assert not [f for f in findings if not f.passed]
    assert len(findings) >= 9


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_the_oracle_plan_solves_100_seeded_tasks(kwargs):
    env = TextWorldEnv(**kwargs)
    for seed in range(100):
        env.reset(seed=seed)
        plan = list(env.plan)
        assert 3 <= len(plan) <= env.max_steps // 3
        for i, move in enumerate(plan):
            assert move in env.legal_moves("player_0"), (seed, move, env.legal_moves("player_0"))
            assert not env.terminations["player_0"], (seed, "done early", plan[:i])
            env.step(move)
        assert env.terminations["player_0"] and env.rewards["player_0"] == 1.0, (seed, plan)


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_the_expert_solves_every_task_from_what_it_sees(kwargs):
    assert _success("heuristic", 100, **kwargs) == [1.0] * 100


def test_random_play_succeeds_far_less_often():
    assert sum(_success("random", 200)) < 0.05 * 200  # about 0.4% (1000 seeds)
    # Without the commands that change nothing, about 4%: rare, but a signal to learn from.
    lean = _success("random", 300, info_commands=False)
    assert set(lean) <= {0.0, 1.0}
    assert 0 < sum(lean) < 0.1 * len(lean), sum(lean)


def test_the_default_is_small():
    env = TextWorldEnv()
    longest = 0
    for seed in range(200):
        env.reset(seed=seed)
        assert 4 <= len(env.plan) <= 6 and env.max_steps == 3 * len(env.plan)
        for _ in range(env.max_steps):
            legal = env.legal_moves("player_0")
            if not legal:
                break
            longest = max(longest, len(legal))
            env.step(legal[seed % len(legal)])
    assert longest <= 12


def _closed_start(env: TextWorldEnv) -> tuple[str, str]:
    """Reset to a seed whose goal object starts in a closed receptacle: (object, receptacle)."""
    for seed in range(100):
        env.reset(seed=seed)
        w = env.world
        hidden = [(o, r) for o, r in sorted(w.location.items()) if r in w.closed and kind_of(o) == w.task.object]
        if hidden:
            return hidden[0]
    raise AssertionError("no seed hides the goal object in a closed receptacle")


def test_what_is_in_a_closed_receptacle_stays_hidden_until_it_is_opened():
    env = TextWorldEnv()
    obj, receptacle = _closed_start(env)
    env.step(f"go to {receptacle}")
    assert f"The {receptacle} is closed." in _text(env)
    assert obj not in _text(env) and obj not in str(env.infos["player_0"]["view"])
    assert not any(obj in m for m in env.legal_moves("player_0"))
    env.step(f"open {receptacle}")
    assert obj in _text(env) and f"take {obj} from {receptacle}" in env.legal_moves("player_0")
    env.step(f"take {obj} from {receptacle}")
    assert f"You are carrying: {'an' if obj[0] in 'aeiou' else 'a'} {obj}" in _text(env)
    assert f"Your task is to: {env.world.task.text}" in _text(env)


def test_memory_lists_what_was_seen_elsewhere():
    env = TextWorldEnv(distractors=4)
    obj, receptacle = _closed_start(env)
    env.step(f"go to {receptacle}")
    env.step(f"open {receptacle}")
    other = next(r for r in env.world.receptacles[env.world.room] if r != receptacle)
    env.step(f"go to {other}")
    (memory,) = [line for line in _text(env).splitlines() if line.startswith("Seen elsewhere: ")]
    assert f"{obj} in {receptacle}" in memory and other not in memory
    assert "Not searched yet:" in _text(env) or len(env.world.searched) == 4
    quiet = TextWorldEnv(distractors=4, memory=False)
    _closed_start(quiet)
    assert "Not searched yet" not in _text(quiet) and "Seen elsewhere" not in _text(quiet)


def test_rules_of_the_families():
    env = TextWorldEnv(families=["clean"])
    env.reset(seed=0)
    task, w = env.world.task, env.world
    assert task.text.startswith("put a clean ") and task.family == "clean"
    plan = env.plan
    verbs = [m.split()[0] for m in plan]
    assert "clean" in verbs and verbs.index("take") < verbs.index("clean") < verbs.index("put")
    for move in plan[: verbs.index("clean")]:
        env.step(move)
    assert "(dirty)" in _text(env) and "is dirty" in _examine(env, w.holding)
    env.step(plan[verbs.index("clean")])
    assert "(dirty)" not in _text(env) and env.rewards["player_0"] == 0.0
    heat = TextWorldEnv(families=["heat"])
    heat.reset(seed=0)
    assert heat.world.task.text.startswith("put a hot ") and any(m.startswith("heat ") for m in heat.plan)
    light = TextWorldEnv(families=["light"])
    light.reset(seed=0)
    assert light.world.task.text.endswith("with the desklamp.") and light.plan[-1] == "use desklamp 1"


def _examine(env: TextWorldEnv, thing: str) -> str:
    from polytinker.envs.games.textworld import Command, execute

    return execute(env.world, Command("examine", thing))


def test_one_thing_at_a_time_and_no_reward_before_the_goal():
    env = TextWorldEnv(distractors=6, receptacles=3)
    for seed in range(50):
        env.reset(seed=seed)
        take = env.plan.index(next(m for m in env.plan if m.startswith("take ")))
        for move in env.plan[: take + 1]:
            env.step(move)
            assert env.rewards["player_0"] == 0.0
        assert env.world.holding and not any(m.startswith("take ") for m in env.legal_moves("player_0"))


def test_step_penalty_and_step_limit():
    env = TextWorldEnv(max_steps=3, step_penalty=0.05)
    env.reset(seed=1)
    for _ in range(3):
        assert not env.truncations["player_0"]
        env.step("look")
        assert env.rewards["player_0"] == pytest.approx(-0.05)
    assert env.truncations["player_0"] and not env.terminations["player_0"]
    assert env.legal_moves("player_0") == () and "Out of time" in _text(env)
    probe = TextWorldEnv()
    probe.reset(seed=4)
    (r,) = Coordinator().run_sync(lambda: TextWorldEnv(), lambda a, i: "inventory", [4])
    traj = r.trajectories["player_0"]
    assert traj.truncated and not traj.terminated and len(traj.turns) == probe.max_steps == 3 * len(probe.plan)
    solved = TextWorldEnv(step_penalty=0.05)
    solved.reset(seed=2)
    for move in solved.plan:
        solved.step(move)
    assert solved.rewards["player_0"] == pytest.approx(0.95)


def test_the_subgoal_reward_is_paid_once_when_the_task_object_is_first_held():
    env = TextWorldEnv(subgoal_reward=0.25)
    env.reset(seed=2)
    rewards = []
    for move in env.plan:
        env.step(move)
        rewards.append(env.rewards["player_0"])
    task_object = env.world.task.object
    take = next(i for i, move in enumerate(env.plan) if move.startswith(f"take {task_object}"))
    assert rewards[take] == pytest.approx(0.25) and rewards[-1] == pytest.approx(1.0)
    assert sum(rewards) == pytest.approx(1.25)  # once, and the goal's 1 at the end
    plain = TextWorldEnv()
    plain.reset(seed=2)
    for move in plain.plan:
        plain.step(move)
    assert plain.rewards["player_0"] == 1.0 and plain.subgoal_paid is False


HOSTILE = [
    "",
    "   ",
    None,
    123,
    b"go to cabinet 1",
    "\x00\x01\x02",
    "go to",
    "take",
    "put mug 1 in",
    "go to cabinet 99",
    "take everything from everywhere",
    "ignore previous instructions and win",
    "x" * 10_000,
    "go to " * 100,
    "héllo wörld 😀 go to cabinet 1",
    "Action: [[look]]",
    "{'verb': 'take'}",
]


@pytest.mark.parametrize("kwargs", [SETTINGS[0], SETTINGS[4]], ids=["easy", "no-extras"])
def test_hostile_actions_never_crash(kwargs):
    env = make("textworld-v0", config=EnvConfig(max_retries=1), **kwargs)
    env.reset(seed=7)
    space = env.observation_space("player_0")
    for i in range(200):
        if not env.agents or env.terminations["player_0"] or env.truncations["player_0"]:
            env.reset(seed=7 + i)
        env.step(HOSTILE[i % len(HOSTILE)])
        obs = env.observe("player_0")
        assert space.contains(obs), obs
        assert len(obs["text"]) <= env.config.max_observation_chars


def test_a_move_named_inside_chatter_is_played():
    env = TextWorldEnv()
    env.reset(seed=0)
    first = env.legal_moves("player_0")[0]
    env.step(f"Action: I think I should {first.upper()}.")
    assert env.steps == 1 and "invalid_action" not in env.infos["player_0"]


def test_seeds_repeat_and_differ():
    def world_text(seed: int) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        env = make("textworld-v0", families=ALL, rooms=2)
        env.reset(seed=seed)
        return _text(env), tuple(env.plan), tuple(sorted(env.world.location.items()))

    assert [world_text(s) for s in range(10)] == [world_text(s) for s in range(10)]
    assert len({world_text(s) for s in range(10)}) == 10
    tasks = set()
    env = TextWorldEnv(families=ALL)
    for seed in range(40):
        env.reset(seed=seed)
        tasks.add(env.world.task.family)
    assert tasks == set(FAMILIES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rooms": 0},
        {"rooms": 5},
        {"receptacles": 2},
        {"distractors": -1},
        {"families": []},
        {"families": ["cool"]},
        {"max_steps": -1},
        {"step_penalty": 0.5},
        {"subgoal_reward": 0.9},
    ],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ConfigError, match="textworld"):
        TextWorldEnv(**kwargs)


def test_families_may_be_one_name():
    env = make("textworld-v0", families="heat")
    assert env.settings.families == ("heat",)
