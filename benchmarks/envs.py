"""Benchmark of the environments: a plain PettingZoo loop, the coordinator, remote envs.

    python benchmarks/envs.py --quick     # under a minute
    python benchmarks/envs.py

Prints one ``name value`` line per figure:

- ``direct_episodes_per_s``: tictactoe-v0 stepped in a plain loop with a trivial policy (the floor);
- ``coordinator_episodes_per_s`` and ``coordinator_overhead_ratio`` (coordinator / direct), with
  ``--concurrency`` episodes in flight and an async policy;
- ``remote_episodes_per_s`` and ``remote_vs_local_ratio`` (remote / local coordinator): the same
  through ``polytinker env serve`` in another process, over tcp on loopback;
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
    args = parser.parse_args()
    n = 1000 if args.quick else 5000
    n_remote = 512 if args.quick else 2048

    figures: dict[str, float] = {}
    figures["direct_episodes_per_s"] = direct_aec("tictactoe-v0", n)
    local_cpu: dict[str, float] = {}
    figures["coordinator_episodes_per_s"] = coordinated(lambda: make("tictactoe-v0"), n, args.concurrency, local_cpu)
    figures["coordinator_overhead_ratio"] = figures["coordinator_episodes_per_s"] / figures["direct_episodes_per_s"]

    server, address = spawn(
        ["-m", "polytinker.cli", "env", "serve", "tictactoe-v0", "prisoners_dilemma-v0", "guess_number-v0",
         "--bind", "tcp://127.0.0.1:0"],
        "serving",
    )  # fmt: skip
    try:
        remote_cpu: dict[str, float] = {"server_pid": server.pid}
        figures["remote_episodes_per_s"] = coordinated(
            lambda: RemoteEnv.aopen(address, "tictactoe-v0"), n_remote, args.concurrency, remote_cpu
        )
        figures["remote_vs_local_ratio"] = figures["remote_episodes_per_s"] / figures["coordinator_episodes_per_s"]
        figures["coordinator_cpu_ms_per_episode"] = local_cpu["client"]
        figures["remote_client_cpu_ms_per_episode"] = remote_cpu["client"]
        figures["remote_server_cpu_ms_per_episode"] = remote_cpu["server"]
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
        print(f"{name} {value:.3f}" if "ratio" in name or "cpu_ms" in name else f"{name} {value:.1f}")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
