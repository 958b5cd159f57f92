"""Rough edges of writing, checking, playing and serving envs: callable entry points, envs that
raise (never silent), `env play` on simultaneous moves, remote envs named by address (config,
scripted opponents served by the env server)."""

from __future__ import annotations

import argparse

import pytest

from polytinker.envs import _cli as env_cli
from polytinker.envs import make, register
from polytinker.envs.games.tictactoe import TicTacToeEnv
from polytinker.envs.registry import unregister
from polytinker.errors import ConfigError


@pytest.fixture
def scratch_ids():
    ids: list[str] = []
    yield ids
    for i in ids:
        unregister(i)


# --- register(entry_point=<callable>) ----------------------------------------------------------------
def test_register_takes_a_class_or_a_factory_function(scratch_ids, capsys):
    def short_pd(rounds: int = 2):
        return make("prisoners_dilemma-v0", rounds=rounds)

    register("ttt_callable-v0", entry_point=TicTacToeEnv)
    register("pd_callable-v0", entry_point=short_pd, rounds=3)
    scratch_ids += ["ttt_callable-v0", "pd_callable-v0"]
    assert isinstance(make("ttt_callable-v0"), TicTacToeEnv)
    assert make("pd_callable-v0").rounds == 3 and make("pd_callable-v0", rounds=1).rounds == 1
    with pytest.raises(ConfigError, match=r"already registered \(entry point 'polytinker\.envs\.games\.tictactoe:Tic"):
        register("ttt_callable-v0", entry_point=TicTacToeEnv)
    with pytest.raises(ConfigError, match="a class or a function returning an env, got int"):
        register("bad_callable-v0", entry_point=42)  # type: ignore[arg-type]
    assert env_cli._list(argparse.Namespace()) == 0
    listing = capsys.readouterr().out
    assert "polytinker.envs.games.tictactoe:TicTacToeEnv" in listing and "short_pd" in listing
