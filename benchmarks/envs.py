"""Benchmark of the environments: a plain PettingZoo loop, the coordinator, remote envs.

    python benchmarks/envs.py --quick     # under a minute
    python benchmarks/envs.py

Prints one ``name: value`` line per figure:

- ``direct_episodes_per_s``: tictactoe-v0 stepped in a plain loop with a trivial policy (the floor);
- ``coordinator_episodes_per_s`` and ``coordinator_overhead_ratio`` (coordinator / direct), with
  ``--concurrency`` episodes in flight and an async policy;
- ``remote_episodes_per_s`` and ``remote_vs_local_ratio`` (remote / local coordinator): the same
  through ``polytinker env serve`` in another process, over tcp on loopback. The two take turns
  in ``--rounds`` rounds (after a warm-up of each), and the ratio is the median of the rounds'
  ratios (``remote_vs_local_ratio_min`` and ``_max`` beside it): a round of each is about a
  second, so a burst of other work on the machine falls on one round of one side, not on the
  whole figure; the episodes-per-second figures are the medians of the rounds;
- ``coordinator_cpu_ms_per_episode``, ``remote_client_cpu_ms_per_episode`` and
  ``remote_server_cpu_ms_per_episode``: CPU time (user + system, every thread) of an episode in this
  process, locally and against the server, and in the server's process: what a machine shared
  with other jobs changes least;
- ``remote_step_latency_ms``: one remote step, request to reply, one episode at a time;
- ``parallel_*``: the same for prisoners_dilemma-v0 (a ParallelEnv);
- ``plain_server_episodes_per_s``: nim-v0 from examples/remote_env_plain.py (pyzmq + msgpack only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from polytinker.envs import Coordinator, CoordinatorConfig, RemoteEnv, make

ROOT = Path(__file__).resolve().parent.parent


def first_legal(agent: str, inp: Any) -> str:
    return inp.observation.legal_moves[0]


async def afirst_legal(agent: str, inp: Any) -> str:
    return inp.observation.legal_moves[0]


def direct_aec(env_id: str, episodes: int) -> float:
    env = make(env_id)
    start = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed=seed)
        for _agent in env.agent_iter():
            obs, _, terminated, truncated, _ = env.last()
            env.step(None if terminated or truncated else obs["legal_moves"][0])
    return episodes / (time.perf_counter() - start)


def direct_parallel(env_id: str, episodes: int) -> float:
    env = make(env_id)
    start = time.perf_counter()
    for seed in range(episodes):
        observations, _ = env.reset(seed=seed)
        while env.agents:
            observations, *_ = env.step({a: observations[a]["legal_moves"][0] for a in env.agents})
    return episodes / (time.perf_counter() - start)


def coordinated(make_env: Any, episodes: int, concurrency: int, cpu: dict[str, float] | None = None) -> float:
    """Episodes per second; ``cpu`` gets the CPU ms per episode of this process (``client``) and of
    the server's (``server``, when ``cpu["server_pid"]`` names it)."""
    coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=concurrency))
    procs = {"client": psutil.Process()}
    if cpu is not None and "server_pid" in cpu:
        procs["server"] = psutil.Process(int(cpu["server_pid"]))
    before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    start = time.perf_counter()
    results = coordinator.run_sync(make_env, afirst_legal, range(episodes))
    elapsed = time.perf_counter() - start
    if cpu is not None:
        cpu.update({k: 1000 * (sum(p.cpu_times()[:2]) - before[k]) / episodes for k, p in procs.items()})
    aborted = [r.aborted for r in results if r.aborted]
    if aborted:
        raise SystemExit(f"{len(aborted)} episodes aborted, e.g. {aborted[0]}")
    return episodes / elapsed


def interleaved(
    address: str, server_pid: int, local_n: int, remote_n: int, concurrency: int, rounds: int
) -> dict[str, float]:
    """The local coordinator and the remote env server taking turns: medians over ``rounds``
    rounds of each (one warm-up of each first), CPU ms per episode of the last round of each."""
    local_cpu: dict[str, float] = {}
    remote_cpu: dict[str, float] = {"server_pid": server_pid}

    def local(episodes: int) -> float:
        return coordinated(lambda: make("tictactoe-v0"), episodes, concurrency, local_cpu)

    def remote(episodes: int) -> float:
        return coordinated(lambda: RemoteEnv.aopen(address, "tictactoe-v0"), episodes, concurrency, remote_cpu)

    local(min(local_n, 256))
    remote(min(remote_n, 128))
    pairs = [(local(local_n), remote(remote_n)) for _ in range(rounds)]
    ratios = sorted(r / c for c, r in pairs)
    return {
        "coordinator_episodes_per_s": statistics.median(c for c, _ in pairs),
        "remote_episodes_per_s": statistics.median(r for _, r in pairs),
        "remote_vs_local_ratio": statistics.median(ratios),
        "remote_vs_local_ratio_min": ratios[0],
        "remote_vs_local_ratio_max": ratios[-1],
        "coordinator_cpu_ms_per_episode": local_cpu["client"],
        "remote_client_cpu_ms_per_episode": remote_cpu["client"],
        "remote_server_cpu_ms_per_episode": remote_cpu["server"],
    }


def step_latency_ms(address: str, steps: int) -> float:
    env = RemoteEnv(address, "guess_number-v0", env_kwargs={"max_guesses": 10**6})
    env.reset(seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        env.step("1" if env.agents else None)
    elapsed = time.perf_counter() - start
    env.close()
    return 1000 * elapsed / steps


def spawn(args: list[str], marker: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return proc, line.split(" on ")[1].split()[0]
    raise SystemExit(f"{args} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes (under a minute)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=None, help="local/remote rounds (default 7, --quick 5)")
    args = parser.parse_args()
    n = 1000 if args.quick else 5000
    # A round of each side is about a second on two cores (local ~2000 episodes/s, remote ~700).
    n_round, n_remote = (2000, 640) if args.quick else (4000, 1280)
    rounds = args.rounds or (5 if args.quick else 7)

    figures: dict[str, float] = {}
    figures["direct_episodes_per_s"] = direct_aec("tictactoe-v0", n)

    server, address = spawn(
        ["-m", "polytinker.cli", "env", "serve", "tictactoe-v0", "prisoners_dilemma-v0", "guess_number-v0",
         "--bind", "tcp://127.0.0.1:0"],
        "serving",
    )  # fmt: skip
    try:
        figures.update(interleaved(address, server.pid, n_round, n_remote, args.concurrency, rounds))
        figures["coordinator_overhead_ratio"] = figures["coordinator_episodes_per_s"] / figures["direct_episodes_per_s"]
        figures["remote_step_latency_ms"] = step_latency_ms(address, 200 if args.quick else 2000)
        figures["parallel_direct_episodes_per_s"] = direct_parallel("prisoners_dilemma-v0", n)
        figures["parallel_coordinator_episodes_per_s"] = coordinated(
            lambda: make("prisoners_dilemma-v0"), n, args.concurrency
        )
        figures["parallel_remote_episodes_per_s"] = coordinated(
            lambda: RemoteEnv.aopen(address, "prisoners_dilemma-v0"), n_remote // 2, args.concurrency
        )
    finally:
        server.kill()

    plain, plain_address = spawn(["examples/remote_env_plain.py", "--bind", "tcp://127.0.0.1:0"], "listening on")
    try:
        figures["plain_server_episodes_per_s"] = coordinated(
            lambda: RemoteEnv.aopen(plain_address, "nim-v0"), n_remote // 2, args.concurrency
        )
    finally:
        plain.kill()

    print(f"# env: tictactoe-v0 (AEC), prisoners_dilemma-v0 (parallel); concurrency {args.concurrency}")
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if "ratio" in name or "cpu_ms" in name else f"{name}: {value:.1f}")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
