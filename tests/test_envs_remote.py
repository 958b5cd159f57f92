"""Remote envs over real sockets: EnvServer + RemoteEnv, failures, limits, the plain example."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from pettingzoo.test import api_test, parallel_api_test

from polytinker.envs import (
    Coordinator,
    EnvServer,
    EnvServerConfig,
    RandomPolicy,
    RemoteAECEnv,
    RemoteEnv,
    RemoteEnvConfig,
    RemoteParallelEnv,
    make,
)
from polytinker.envs.opponents import scripted_policy
from polytinker.errors import EnvError, PeerDeadError, ProtocolError, RemoteError, RequestTimeout
from polytinker.transport.rpc import RpcClient, TransportConfig

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def server(flaky_id):
    config = EnvServerConfig(step_timeout_s=1.0, max_observation_bytes=2000)
    with EnvServer(LOOPBACK, config=config) as srv:
        yield srv


def test_remote_envs_pass_the_pettingzoo_api_tests(server):
    aec = RemoteEnv(server.address, "kuhn_poker-v0")
    par = RemoteEnv(server.address, "prisoners_dilemma-v0", env_kwargs={"rounds": 3})
    assert isinstance(aec, RemoteAECEnv) and isinstance(par, RemoteParallelEnv)
    assert aec.instructions("player_0") == make("kuhn_poker-v0").instructions("player_0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(aec, num_cycles=100)
        parallel_api_test(par, num_cycles=100)
    aec.close()
    par.close()


@pytest.mark.parametrize("env_id", ["connect_four-v0", "prisoners_dilemma-v0", "negotiation-v0", "signal-v0"])
def test_remote_episodes_match_local_ones(server, env_id):
    def policies():
        env = make(env_id)
        return {a: scripted_policy(env, "heuristic", i) for i, a in enumerate(env.possible_agents)}

    seeds = range(64)
    open_env = (
        (lambda: RemoteEnv(server.address, env_id))
        if "four" in env_id
        else (
            lambda: RemoteEnv.aopen(server.address, env_id)  # the non-blocking open
        )
    )
    remote = Coordinator().run_sync(open_env, policies(), seeds)
    local = Coordinator().run_sync(lambda: make(env_id), policies(), seeds)
    assert [r.aborted for r in remote] == [None] * 64
    assert [r.total_rewards for r in remote] == [r.total_rewards for r in local]
    texts = [[t.observation.text for t in r.trajectories[a].turns] for r in remote for a in r.trajectories]
    assert texts == [[t.observation.text for t in r.trajectories[a].turns] for r in local for a in r.trajectories]
    assert server.num_episodes == 0  # the coordinator closed them all


def test_a_remote_env_declares_its_tools_and_the_coordinator_passes_them_on(server):
    from polytinker.envs import Coordinator

    env = RemoteEnv(server.address, "math_tool-v0")
    assert env.tools("player_0") == ("calculator",)
    assert RemoteEnv(server.address, "kuhn_poker-v0").tools("player_0") == ()
    seen = []

    def policy(agent, inp):
        seen.append(inp.tools)
        return "42"

    Coordinator().run_sync(lambda: env, policy, seeds=[0])
    assert seen == [("calculator",)]


def test_an_env_that_raises_aborts_its_episode_and_the_server_serves_on(server, flaky_id):
    doomed, other = RemoteEnv(server.address, flaky_id), RemoteEnv(server.address, flaky_id)
    doomed.reset(seed=0)
    other.reset(seed=0)
    with pytest.raises(EnvError, match="the env raised in step: RuntimeError: the env blew up"):
        doomed.step("boom")
    with pytest.raises(EnvError, match="was aborted"):
        doomed.step("ok")
    for _ in range(3):
        other.step("ok")
    assert other.terminations == {"player_0": True} and other._cumulative_rewards["player_0"] == 1.0
    (result,) = Coordinator().run_sync(lambda: RemoteEnv(server.address, flaky_id), lambda a, i: "boom", [0])
    assert result.aborted and "blew up" in result.aborted


def test_step_timeout_and_observation_size_limit_abort_the_episode(server, flaky_id):
    slow = RemoteEnv(server.address, flaky_id)
    slow.reset(seed=0)
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"step took longer than step_timeout_s=1\.0"):
        slow.step("sleep")
    assert time.monotonic() - start < 2.5
    big = RemoteEnv(server.address, flaky_id)
    big.reset(seed=0)
    with pytest.raises(EnvError, match="over max_observation_bytes=2000"):
        big.step("grow")
    fine = RemoteEnv(server.address, flaky_id)
    fine.reset(seed=1)
    fine.step("ok")
    for env in (slow, big, fine):
        env.close()


def test_a_hung_env_holds_no_handler_thread_of_the_server(flaky_id):
    """Env calls run on the transport's handler threads: with one, a step that hangs (3 s) is
    answered with the timeout's error at 0.5 s (the watcher looks every quarter of it), and a new
    thread serves the other episodes meanwhile."""
    config = EnvServerConfig(step_timeout_s=0.5)
    one_thread = TransportConfig(handler_threads=1)
    with EnvServer(LOOPBACK, env_ids=[flaky_id], config=config, transport=one_thread) as srv:
        slow, fine = RemoteEnv(srv.address, flaky_id), RemoteEnv(srv.address, flaky_id)
        slow.reset(seed=0)
        fine.reset(seed=0)
        start = time.monotonic()
        with pytest.raises(EnvError, match=r"step took longer than step_timeout_s=0\.5"):
            slow.step("sleep")
        assert time.monotonic() - start < 2.0
        for _ in range(3):
            fine.step("ok")  # served while the hung step still sleeps
        assert time.monotonic() - start < 2.5
        assert fine.terminations == {"player_0": True}
        with pytest.raises(EnvError, match="was aborted: step took longer"):
            slow.step("ok")
        fine.close()


def test_malformed_requests_get_error_replies(server):
    with RpcClient(server.address) as client:
        with pytest.raises(RemoteError, match="missing field 'episode'") as info:
            client.call("env.step", {"action": "1"})
        assert info.value.remote_type == "ProtocolError"
        with pytest.raises(RemoteError, match="payload must be a map"):
            client.call("env.open", "tictactoe-v0")
        with pytest.raises(RemoteError, match="field 'seed' must be int or nil"):
            client.call("env.reset", {"episode": "x", "seed": "zero"})
        with pytest.raises(RemoteError, match="does not serve 'chess-v9'"):
            client.call("env.open", {"env_id": "chess-v9"})
        with pytest.raises(ProtocolError, match="unknown_kind"):
            client.call("env.fly", {})
        hello = client.call("env.open", {"env_id": "tictactoe-v0"})
        client.call("env.reset", {"episode": hello["episode"], "seed": 0})
        with pytest.raises(RemoteError, match="exceeds max_action_bytes"):
            client.call("env.step", {"episode": hello["episode"], "action": "1" * 20000})
        state = client.call("env.step", {"episode": hello["episode"], "action": "5"})
        assert (
            state["agent_selection"] == "player_1"
            and "X" in client.call("env.observe", {"episode": hello["episode"], "agent": "player_1"})["text"]
        )
        assert client.call("env.close", {"episode": hello["episode"]}) == {"closed": True}


def _spawn(args: list[str], marker: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if marker in line:
            return proc, line.split()[-1] if marker == "listening on" else line.split(" on ")[1].split()[0]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{args} did not start")


def test_a_server_that_dies_mid_episode_makes_the_client_fail_clearly():
    proc, address = _spawn(["-m", "polytinker.cli", "env", "serve", "tictactoe-v0", "--bind", LOOPBACK], "serving")
    try:
        env = RemoteEnv(address, "tictactoe-v0", config=RemoteEnvConfig(request_timeout_s=2.0))
        env.reset(seed=0)
        env.step("5")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        start = time.monotonic()
        with pytest.raises((RequestTimeout, PeerDeadError), match="env server"):
            env.step("1")
        assert time.monotonic() - start < 5.0
        env.close()
    finally:
        proc.kill()


def test_full_episodes_against_the_plain_pyzmq_server():
    proc, address = _spawn(["examples/remote_env_plain.py", "--bind", LOOPBACK], "listening on")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = RemoteEnv(address, "nim-v0")
            api_test(env, num_cycles=100)
            env.close()
        results = Coordinator().run_sync(lambda: RemoteEnv(address, "nim-v0"), RandomPolicy(0), range(32))
        assert all(r.aborted is None for r in results)
        assert all(sorted(r.total_rewards.values()) == [-1.0, 1.0] for r in results)
        (bad,) = Coordinator().run_sync(lambda: RemoteEnv(address, "nim-v0"), lambda a, i: "seven", [0])
        first = bad.trajectories["player_0"].turns[0]
        assert first.invalid_reason and "not a legal move" in first.invalid_reason
        with pytest.raises(EnvError, match="serves only nim-v0"):
            RemoteEnv(address, "tictactoe-v0")
    finally:
        proc.kill()


def test_curve_admits_only_listed_clients(tmp_path):
    from polytinker.transport.auth import ClientCurve, ServerCurve, generate_keypair, load_keypair

    generate_keypair(tmp_path / "server", "server")
    generate_keypair(tmp_path / "clients", "alice")
    server_public, server_secret = load_keypair(tmp_path / "server" / "server.key_secret")
    alice_public, alice_secret = load_keypair(tmp_path / "clients" / "alice.key_secret")
    assert server_secret is not None and alice_secret is not None
    curve = ServerCurve(server_public, server_secret, frozenset({alice_public}))
    with EnvServer(LOOPBACK, env_ids=["guess_number-v0"], curve=curve) as srv:
        alice = ClientCurve(alice_public, alice_secret, server_public)
        (r,) = Coordinator().run_sync(
            lambda: RemoteEnv(srv.address, "guess_number-v0", curve=alice),
            scripted_policy(make("guess_number-v0"), "heuristic"),
            [0],
        )
        assert r.aborted is None and r.total_rewards == {"player_0": 1.0}
        with pytest.raises((RequestTimeout, PeerDeadError)):
            RemoteEnv(srv.address, "guess_number-v0", config=RemoteEnvConfig(request_timeout_s=1.0))
