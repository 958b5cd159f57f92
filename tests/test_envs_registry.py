"""Registry, plugins, the checker on a broken env, the PettingZoo adapter, and `polytinker env`."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import warnings

import pytest
from pettingzoo.test import api_test

from polytinker import cli
from polytinker.envs import Coordinator, PettingZooTextEnv, check_env, env_specs, make, register
from polytinker.envs.opponents import RandomPolicy
from polytinker.envs.registry import unregister
from polytinker.errors import ConfigError


@pytest.fixture
def scratch_ids():
    ids: list[str] = []
    yield ids
    for i in ids:
        unregister(i)


def test_register_and_make_with_overrides(scratch_ids):
    register("pd_short-v0", "polytinker.envs.games.prisoners_dilemma:PrisonersDilemmaEnv", rounds=2)
    scratch_ids.append("pd_short-v0")
    assert make("pd_short-v0").rounds == 2
    assert make("pd_short-v0", rounds=4).rounds == 4
    assert make("polytinker.envs.games.tictactoe:TicTacToeEnv").metadata["name"] == "tictactoe_v0"


def test_registration_is_lazy(scratch_ids):
    register("ghost-v0", "no_such_module_anywhere:Ghost")  # nothing is imported yet
    scratch_ids.append("ghost-v0")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_anywhere'"):
        make("ghost-v0")


def test_ids_are_versioned_and_unique(scratch_ids):
    with pytest.raises(ConfigError, match="name and a version"):
        register("tictactoe", "polytinker.envs.games.tictactoe:TicTacToeEnv")
    with pytest.raises(ConfigError, match=r"already registered.*tictactoe-v1"):
        register("tictactoe-v0", "polytinker.envs.games.tictactoe:TicTacToeEnv")
    with pytest.raises(ConfigError, match=r"package\.module:ClassName"):
        register("x-v0", "not an entry point")
    with pytest.raises(ConfigError, match="Did you mean tictactoe-v0"):
        make("tictactoe-v9")


def test_plugins_come_from_the_entry_point_group(monkeypatch, scratch_ids):
    registry_module = importlib.import_module("polytinker.envs.registry")
    eps = [
        importlib.metadata.EntryPoint("plugged-v0", "fixtures.envs:FlakyEnv", "polytinker.envs"),
        importlib.metadata.EntryPoint("tictactoe-v0", "fixtures.envs:FlakyEnv", "polytinker.envs"),
    ]
    seen_groups = []

    def fake_entry_points(*, group):
        seen_groups.append(group)
        return eps

    monkeypatch.setattr(registry_module.importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry_module, "_plugins_loaded", False)
    scratch_ids.append("plugged-v0")
    specs = env_specs()
    assert seen_groups == ["polytinker.envs"]
    assert specs["plugged-v0"].entry_point == "fixtures.envs:FlakyEnv"
    # A plugin may not take a built-in's id: it is skipped, the built-in stays.
    assert specs["tictactoe-v0"].source == "builtin"
    assert make("plugged-v0").metadata["name"] == "flaky_v0"


def test_checker_says_what_to_fix():
    findings = {f.check: f for f in check_env("fixtures.envs:SloppyEnv")}
    assert findings["pettingzoo api test"].passed
    assert not findings["instructions"].passed and "define instructions" in findings["instructions"].detail
    assert not findings["legal moves parse back"].passed and "'right'" in findings["legal moves parse back"].detail
    assert (
        not findings["deterministic under a seed"].passed
        and "self._rng" in findings["deterministic under a seed"].detail
    )
    assert not findings["scripted opponents"].passed


def test_adapter_turns_pettingzoo_classic_into_text():
    env = make("pz_tictactoe-v3")
    first, second = env.possible_agents  # PettingZoo names them player_1, player_2
    env.reset(seed=0)
    assert env.agent_selection == first
    assert env.legal_moves(second) == ()
    env.step("play 4")
    obs = env.observe(second)
    assert "O" in obs["text"] and obs["legal_moves"] == ("0", "1", "2", "3", "5", "6", "7", "8")
    env.step("9")  # not a legal move: refused, the second player is still to move
    assert env.agent_selection == second and "Invalid action" in env.observe(second)["text"]


def test_adapter_on_a_small_discrete_env_with_the_mask_in_info():
    from fixtures.envs import CountdownAEC

    env = PettingZooTextEnv(CountdownAEC(), action_names=["take one", "take two"], describe="Reach zero first.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(env, num_cycles=100)
    assert "Reach zero first." in env.instructions("player_0")
    results = Coordinator().run_sync(
        lambda: PettingZooTextEnv(CountdownAEC, action_names=["take one", "take two"]), RandomPolicy(1), range(10)
    )
    assert all(sorted(r.total_rewards.values()) == [-1.0, 1.0] for r in results)
    with pytest.raises(ConfigError, match="2 actions"):
        PettingZooTextEnv(CountdownAEC(), action_names=["one"])


def test_adapter_refuses_at_construction_a_game_without_an_action_mask():
    # rock-paper-scissors: Discrete actions, but no mask in its observation or its info.
    with pytest.raises(ConfigError) as refused:
        PettingZooTextEnv("pettingzoo.classic.rps_v2")
    message = str(refused.value)
    assert "rps_v2 cannot be adapted" in message and "'action_mask' over its 3 actions" in message
    assert "TextAECEnv" in message and "legal_moves" in message  # what to do instead
    # The classic games that have one still adapt, the mask read from the space or from a reset.
    assert PettingZooTextEnv("pettingzoo.classic.connect_four_v3").num_actions == 7


def test_cli_list_and_check(capsys):
    assert cli.main(["env", "list"]) == 0
    out = capsys.readouterr().out
    for env_id in ("tictactoe-v0", "kuhn_poker-v0", "signal-v0", "pz_connect_four-v3"):
        assert env_id in out
    assert cli.main(["env", "check", "signal-v0"]) == 0
    assert "signal-v0: 9 passed, 0 failed" in capsys.readouterr().out
    assert cli.main(["env", "check", "fixtures.envs:SloppyEnv"]) == 1
    assert "fix: define instructions" in capsys.readouterr().out


def test_cli_play_reads_moves_from_stdin():
    moves = "".join(f"{c}\n" for c in (5, 1, 9, 3, 7, 2, 4, 6, 8) * 2)
    out = subprocess.run(
        [sys.executable, "-m", "polytinker.cli", "env", "play", "tictactoe-v0", "--seed", "3"],
        input=moves,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "you are player_0" in out.stdout and "player_1: " in out.stdout
    assert "== game over. rewards: player_0:" in out.stdout


def test_cli_play_stops_when_input_ends():
    out = subprocess.run(
        [sys.executable, "-m", "polytinker.cli", "env", "play", "kuhn_poker-v0", "--agent", "player_1"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "input ended" in out.stdout


def test_env_processes_stay_light():
    code = (
        "import sys, polytinker.envs, polytinker.envs.remote, polytinker.envs.checker;"
        "from polytinker.envs import make; make('tictactoe-v0');"
        "assert 'torch' not in sys.modules, 'polytinker.envs pulled in torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
