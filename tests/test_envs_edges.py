"""Rough edges of writing, checking, playing and serving envs: callable entry points, envs that
raise (never silent), `env play` on simultaneous moves, remote envs named by address (config,
scripted opponents served by the env server)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any, ClassVar

import pytest

from polytinker.envs import (
    Coordinator,
    EnvConfig,
    EnvServer,
    EnvSource,
    PolicyInput,
    RandomPolicy,
    RemoteEnv,
    ScriptedPolicy,
    TextAECEnv,
    check_env,
    make,
    register,
    scripted_policy,
)
from polytinker.envs import _cli as env_cli
from polytinker.envs.checker import format_findings
from polytinker.envs.games.tictactoe import TicTacToeEnv
from polytinker.envs.play import play
from polytinker.envs.registry import unregister
from polytinker.envs.types import AgentID
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


# --- envs for these tests ----------------------------------------------------------------------------
class Crumbles(TextAECEnv):
    """One agent; the second move raises inside the game's rules (as a buggy env would)."""

    metadata: ClassVar[dict[str, Any]] = {"name": "crumbles_v0", "render_modes": ["ansi"]}
    scripted: ClassVar[dict] = {"random": RandomPolicy, "heuristic": RandomPolicy}

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self.moves = 0

    def instructions(self, agent: AgentID) -> str:
        return "Say a or b."

    def _new_game(self) -> None:
        self.moves = 0

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return ("a", "b")

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.moves += 1
        if self.moves == 2:
            raise KeyError("the second move")  # CRUMBLES-HERE
        return {}

    def _is_over(self) -> bool:
        return self.moves >= 3

    def _render(self, agent: AgentID) -> str:
        return f"moves {self.moves}"


class NoRender(Crumbles):
    """Forgets a hook."""

    _render = TextAECEnv._render  # type: ignore[assignment]


class BrokenHeuristic(ScriptedPolicy):
    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        raise ValueError("the heuristic has a bug")


def crumbles_line() -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "CRUMBLES-HERE" in line)


@pytest.fixture(scope="module")
def served():
    """An env server in this process with the built-in games, and two test envs registered by class."""
    from polytinker.envs.games.guess_number import GuessNumberEnv

    class BadOpponentGuess(GuessNumberEnv):
        scripted: ClassVar[dict] = {"random": RandomPolicy, "heuristic": BrokenHeuristic}

    register("crumbles-v0", entry_point=Crumbles)
    register("bad_opponent-v0", entry_point=BadOpponentGuess)
    ids = ["tictactoe-v0", "prisoners_dilemma-v0", "guess_number-v0", "crumbles-v0", "bad_opponent-v0"]
    try:
        with EnvServer("tcp://127.0.0.1:0", env_ids=ids) as server:
            yield server
    finally:
        unregister("crumbles-v0")
        unregister("bad_opponent-v0")


# --- remote envs from config: the EnvConfig reaches the server -----------------------------------------
def write_config(tmp_path: Path, env: str) -> Path:
    path = tmp_path / "x.toml"
    path.write_text(f'name = "x"\n[env]\n{env}\n[[agents]]\nname = "a"\n')
    return path


def test_the_env_table_reaches_a_remote_env_server(served, tmp_path):
    from polytinker.agents.config import ExperimentConfig
    from polytinker.agents.experiment import _make_env

    env = (
        f'id = "guess_number-v0"\naddress = "{served.address}"\nmax_retries = 0\n'
        'invalid_action_penalty = -2.0\non_retries_exhausted = "forfeit"\nforfeit_reward = -7.0'
    )
    config = ExperimentConfig.from_toml(write_config(tmp_path, env))
    remote = _make_env(config)
    try:
        assert isinstance(remote, RemoteEnv) and set(remote.scripted) == {"random", "heuristic"}
        remote.reset(seed=1)
        remote.step("a banana")  # not a number: refused, no retries, forfeit
        assert remote.rewards["player_0"] == -9.0 and remote.terminations["player_0"]
        assert "No tries left" in remote.infos["player_0"]["invalid_action"]
    finally:
        remote.close()
    # The same table without the address: the same rules here.
    local = ExperimentConfig.from_toml(write_config(tmp_path, env.replace(f'address = "{served.address}"', "")))
    env_here = _make_env(local)
    env_here.reset(seed=1)
    env_here.step("a banana")
    assert env_here.rewards["player_0"] == -9.0
    assert served.num_episodes == 0


def test_remote_env_settings_are_checked_where_they_are_given(served):
    with pytest.raises(ConfigError, match=r"env\.open config\.max_retries: expected int, got str '2'"):
        RemoteEnv(served.address, "guess_number-v0", env_config={"max_retries": "2"})
    with pytest.raises(ConfigError, match="must be a ZeroMQ address"):
        EnvSource("tictactoe-v0", address="localhost:5599")
    with pytest.raises(ConfigError, match="named by the id its server serves"):
        EnvSource("mypkg.games:HighCard", address=served.address)
    with pytest.raises(ConfigError, match="must be scalars"):
        EnvSource("tictactoe-v0", address=served.address, kwargs={"board": [1, 2]})


# --- scripted opponents served by the env server -------------------------------------------------------
@pytest.mark.parametrize("env_id", ["tictactoe-v0", "prisoners_dilemma-v0"])
def test_scripted_opponents_played_by_the_server_match_local_ones(served, env_id):
    from polytinker.agents.rollout import Players
    from polytinker.agents.types import Slot, SlotKind

    source = EnvSource(env_id, address=served.address)
    probe = source.make()
    remote_table = {k: scripted_policy(probe, k, seed=5) for k in ("random", "heuristic")}
    probe.close()
    local_env = make(env_id)
    local_table = {k: scripted_policy(local_env, k, seed=5) for k in ("random", "heuristic")}
    seeds = list(range(12))
    # As the training loop's evaluation asks for them: scripted slots of Players' policy.
    slots = {
        s: {a: Slot(SlotKind.SCRIPTED, "heuristic" if a == "player_0" else "random") for a in local_env.possible_agents}
        for s in seeds
    }
    remote = Coordinator().run_sync(source.factory(), Players({}, {}, remote_table).policy(slots), seeds)
    local = Coordinator().run_sync(lambda: make(env_id), Players({}, {}, local_table).policy(slots), seeds)
    assert [r.aborted for r in remote] == [None] * len(seeds)
    assert [r.total_rewards for r in remote] == [r.total_rewards for r in local]
    actions = [[t.action for t in traj.turns] for r in remote for traj in r.trajectories.values()]
    assert actions == [[t.action for t in traj.turns] for r in local for traj in r.trajectories.values()]
    assert served.num_episodes == 0


def test_a_served_opponent_that_fails_aborts_its_episode_not_the_run(served):
    source = EnvSource("bad_opponent-v0", address=served.address)
    probe = source.make()
    policy = {"player_0": scripted_policy(probe, "heuristic", seed=0)}
    probe.close()
    results = Coordinator().run_sync(source.factory(), policy, [0, 1])
    assert all(r.aborted and "ValueError: the heuristic has a bug" in r.aborted for r in results)
    assert "test_envs_edges.py" in str(results[0].aborted)  # where in the env's code
    with pytest.raises(ConfigError, match="plays only in episodes of a remote env"):
        Coordinator().run_sync(lambda: make("guess_number-v0"), policy, [0])
    assert served.num_episodes == 0


# --- an env that raises is never silent ------------------------------------------------------------------
def test_an_aborted_episode_names_the_error_and_the_line_of_the_env(served):
    [local] = Coordinator().run_sync(Crumbles, lambda a, inp: "a", [0])
    where = f"test_envs_edges.py:{crumbles_line()} in _apply"
    assert local.aborted and local.aborted.startswith("KeyError: 'the second move' (at ") and where in local.aborted
    [remote] = Coordinator().run_sync(
        EnvSource("crumbles-v0", address=served.address).factory(), lambda a, inp: "a", [0]
    )
    assert remote.aborted and "the env raised in step: KeyError" in remote.aborted and where in remote.aborted


def test_env_check_shows_the_env_traceback_and_never_ok_for_what_did_not_run():
    text = format_findings("crumbles", check_env(Crumbles))
    assert f'test_envs_edges.py", line {crumbles_line()}, in _apply' in text
    assert 'raise KeyError("the second move")' in text
    assert "fix: _apply() raised KeyError at " in text and f"test_envs_edges.py:{crumbles_line()}: fix it there" in text
    assert "FAIL seeded random play ends" in text
    assert "SKIP legal moves parse back: not run" in text
    assert "ok   deterministic under a seed" not in text
    assert "not run" in text.splitlines()[-1]
    hook = format_findings("norender", check_env(NoRender))
    assert "FAIL text observations" in hook and "fix: implement _render() in the env class" in hook

    def needs_an_argument(size):
        return Crumbles()

    built = check_env(needs_an_argument)
    assert [f.status for f in built] == ["FAIL"] + ["SKIP"] * (len(built) - 1)
    assert "no arguments" in built[0].detail and all("not run" in f.detail for f in built[1:])


def test_env_check_and_play_take_a_remote_env(served, capsys):
    assert env_cli._check(argparse.Namespace(target="tictactoe-v0", seed=0, env_address=served.address)) == 0
    out = capsys.readouterr().out
    assert f"tictactoe-v0 at {served.address}: 9 passed, 0 failed" in out
    stdout = io.StringIO()
    result = play("tictactoe-v0", opponent="heuristic", seed=3, address=served.address,
                  stdin=io.StringIO("5\n1\n9\n3\n7\n2\n4\n6\n8\n" * 2), stdout=stdout)  # fmt: skip
    assert result is not None and result.aborted is None and "player_1: " in stdout.getvalue()
    assert served.num_episodes == 0


def test_env_play_prints_the_error_and_fails(served, flaky_id, monkeypatch, capsys):
    stdout = io.StringIO()
    result = play(flaky_id, seed=0, stdin=io.StringIO("boom\n"), stdout=stdout)
    assert result is not None and result.aborted
    assert "== the game stopped: the env failed: RuntimeError: the env blew up (at " in stdout.getvalue()
    assert "game over" not in stdout.getvalue()
    monkeypatch.setattr("sys.stdin", io.StringIO("a\na\n"))
    args = argparse.Namespace(env_id="crumbles-v0", agent=None, opponent="random", seed=0, env_address=served.address)
    assert env_cli._play(args) == 1
    captured = capsys.readouterr()
    assert "error: the env failed: EnvError" in captured.err and "the env raised in step: KeyError" in captured.err


# --- env play on simultaneous moves ------------------------------------------------------------------------
@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_env_play_shows_a_simultaneous_move_only_after_the_persons_move(served, remote):
    # Remote: the opponent's move comes from the server after the person's answer, in the same round.
    stdout, address = io.StringIO(), served.address if remote else ""
    moves = io.StringIO("defect\n" * 5)
    result = play("prisoners_dilemma-v0", opponent="heuristic", seed=0, address=address, stdin=moves, stdout=stdout)
    assert result is not None and result.aborted is None
    text = stdout.getvalue().split("== game over")[0]
    prompts = [i for i in range(len(text)) if text.startswith("> ", i)]
    moves = [i for i in range(len(text)) if text.startswith("player_1: ", i)]
    assert len(prompts) == len(moves) == 5
    # Each round's opponent move comes after that round's prompt (and before the next one).
    assert all(p < m for p, m in zip(prompts, moves, strict=True))
    assert all(m < p for m, p in zip(moves, prompts[1:], strict=False))
    assert "player_1: cooperate" in text  # tit-for-tat's first move, shown after ours


# --- a server in another language applies the config: the plain example ------------------------------
def test_the_plain_example_server_applies_the_config_and_refuses_what_it_cannot():
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "examples/remote_env_plain.py", "--bind", "tcp://127.0.0.1:0"],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[-1]
        env = RemoteEnv(address, "nim-v0", env_config=EnvConfig(max_retries=1, invalid_action_penalty=-0.7))
        env.reset(seed=0)
        env.step("seven")
        assert env.rewards["player_0"] == -0.7 and env.agent_selection == "player_0"
        assert (
            env.infos["player_0"]["retries_left"] == 1 and "(1 tries left)" in env.infos["player_0"]["invalid_action"]
        )
        env.step("eight")  # the last try: the fallback move is played
        assert env.agent_selection == "player_1" and env.infos["player_0"]["retries_left"] == 0
        env.close()
        with pytest.raises(ConfigError, match="this server only falls back, not 'forfeit'"):
            RemoteEnv(address, "nim-v0", env_config=EnvConfig(on_retries_exhausted="forfeit"))
        with pytest.raises(ConfigError, match="unknown key 'retries'"):
            RemoteEnv(address, "nim-v0", env_config={"retries": 3})
    finally:
        proc.kill()
        proc.wait()


def test_malformed_scripted_requests_get_error_replies_and_the_server_serves_on(served):
    from polytinker.errors import ProtocolError, RemoteError
    from polytinker.transport.rpc import RpcClient

    pd = RemoteEnv(served.address, "prisoners_dilemma-v0")
    pd.reset(seed=0)
    client = RpcClient(served.address)
    try:
        base = {"episode": pd.episode, "agent": "player_0", "policy": "heuristic"}
        for payload, code in [
            ({**base, "turn": -1}, "protocol"),
            ({**base, "turn": "1"}, "protocol"),
            ({**base, "policy_seed": 1.5}, "protocol"),
            ({**base, "agent": 7}, "protocol"),
            ({**base, "policy": "oracle"}, "env"),
            ({**base, "agent": "player_9"}, "env"),
            ({**base, "episode": "nope"}, "env"),
            ([1, 2], "protocol"),
        ]:
            with pytest.raises(RemoteError) as info:
                client.call("env.scripted", payload, timeout_s=5)
            assert info.value.code == code, (payload, info.value)
        for seed in range(40):  # many seeds: the server keeps a bounded number of policies
            assert client.call("env.scripted", {**base, "policy": "random", "policy_seed": seed}, timeout_s=5)["action"]
        assert pd.scripted_move("player_1", "heuristic", 3) == "cooperate"
        pd.step({"player_0": "defect", "player_1": "cooperate"})  # the episode is still alive
    finally:
        client.close()
        pd.close()
    ttt = RemoteEnv(served.address, "tictactoe-v0")
    with pytest.raises(ProtocolError, match="'turn' and 'retry' must be >= 0"):
        ttt.scripted_move("player_0", "heuristic", turn=-3)
    ttt.close()
    assert served.num_episodes == 0
