"""The scheduler service's request rate on this machine, its state's write rate, one hop's bandwidth.

    python benchmarks/scheduler_rate.py --quick     # about a minute on two cores
    python benchmarks/scheduler_rate.py             # longer phases, two rounds each

What a larger cluster asks of the one scheduler (docs/cluster.md, "On paper"). One local runtime
(the scheduler and one hf engine on tiny-random, as processes) serves clients in this process:
``--clients`` threads, each with its own ``ServiceClient`` and base-model sampler, call one method
back to back for a fixed time. Rounds take turns so that other load hits every phase alike.

- ``query_calls_per_s``: ``get_job`` of the thread's own job: the scheduler alone (the API key's
  tenant, the job's row from SQLite, its events), no worker;
- ``sample_calls_per_s``: ``sample`` of 1 token after a 4-token prompt: forwarded to the engine
  and back (tiny-random's decode is part of it);
- ``echo_calls_per_s``: the baseline, the same threads with a bare ``RpcClient`` each against
  ``polytinker.transport._echo`` in its own process; ``query_vs_echo_ratio`` is
  ``query_calls_per_s`` over it, in the same run;
- ``scheduler_cpu_ms_per_query`` / ``_per_sample``: the scheduler process's CPU time per call
  (psutil, over the phase), and ``scheduler_capacity_queries_per_s`` /
  ``_samples_per_s``: 1000 over that, what one core would carry (the scheduler's Python runs
  its handlers under one GIL) with the clients and engines on other machines;
- ``sqlite_commits_per_s``: ``StateStore.log_event`` in a loop on this machine's disk (one
  ``BEGIN IMMEDIATE`` ... ``COMMIT``, WAL, ``synchronous=FULL``, as the scheduler's every write);
- ``hop_mb_per_s``: a 64 MiB float32 array in one ``RpcClient`` call to the echo server's
  ``nbytes``: one transport hop's bandwidth on loopback. A LoRA version that an engine cannot read
  from a shared filesystem makes two hops (learner to scheduler, scheduler to engine).

Prints ``name: value`` lines.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from polytinker.client import ServiceClient
from polytinker.scheduler.service import EngineWorkerConfig, LocalRuntime, RuntimeConfig, TenantConfig
from polytinker.scheduler.service.state import StateStore
from polytinker.transport import RpcClient, TransportConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling transport.py, however it is loaded
from transport import spawn_server

MODEL = "tiny-random"
KEY = "bench-rate-key-0123456789abcdef"
PARAMS = {"max_tokens": 1, "temperature": 1.0}


def run_threads(n: int, make: Callable[[int], Callable[[], object]], seconds: float) -> float:
    """Calls per second of ``n`` threads, each calling its ``make(i)`` back to back for ``seconds``."""
    calls = [0] * n
    errors: list[str] = []
    start = threading.Barrier(n + 1)
    stop = threading.Event()

    def loop(i: int) -> None:
        call = make(i)
        start.wait()
        try:
            while not stop.is_set():
                call()
                calls[i] += 1
        except Exception as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client threads failed, first: {errors[0]}")
    return sum(calls) / wall


def measured(proc: psutil.Process, rate: Callable[[], float], seconds: float) -> tuple[float, float]:
    """(calls/s, the process's CPU ms per call) over one phase."""
    before = proc.cpu_times()
    per_s = rate()
    after = proc.cpu_times()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    return per_s, 1000.0 * cpu_s / (per_s * seconds)


def sqlite_commits_per_s(seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-sqlite-") as d:  # where the runtime keeps its own
        store = StateStore(Path(d) / "scheduler.sqlite3")
        try:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                store.log_event("job-0", "bench", "one committed write")
                n += 1
            return n / (time.perf_counter() - t0)
        finally:
            store.close()


def hop_mb_per_s(address: str, reps: int) -> float:
    array = np.ones(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB
    with RpcClient(address, config=TransportConfig(request_timeout_s=120.0)) as client:
        client.call("nbytes", array)  # warm: connection and buffers
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert client.call("nbytes", array) == array.nbytes
            times.append(time.perf_counter() - t0)
    return array.nbytes / statistics.median(times) / 1e6


def spawn_echo() -> tuple[subprocess.Popen[str], str]:
    return spawn_server([sys.executable, "-m", "polytinker.transport._echo", "tcp://127.0.0.1:0"])


def runtime_config(clients: int) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        tenants=(TenantConfig("bench", api_key=KEY),),
        # Room for every client's sampler at once (an inference job declares 0.5 GB by default).
        engines=(EngineWorkerConfig(memory_gb=clients * 0.5 + 1.0, batch_window_s=0.0),),
        learners=(),
        max_inflight_per_tenant=max(128, 2 * clients),
        worker_threads=1,  # the engine's torch shares the two cores with the scheduler and clients
        inference_idle_s=600.0,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round of 4 s phases (default: two of 10 s)")
    p.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    args = p.parse_args(argv)
    seconds, rounds = (4.0, 1) if args.quick else (10.0, 2)
    n = args.clients

    echo_proc, echo_addr = spawn_echo()
    figures: dict[str, list[float]] = {}
    try:
        with LocalRuntime(runtime_config(n)) as rt:
            clients = [ServiceClient(rt.address, api_key=KEY, timeout_s=60.0) for _ in range(n)]
            samplers = [c.create_sampling_client(base_model=MODEL) for c in clients]
            actors = {a["name"]: a["pid"] for a in clients[0].runtime_status()["actors"]}
            scheduler = psutil.Process(actors["scheduler"])
            echoes = [RpcClient(echo_addr) for _ in range(n)]
            phases: dict[str, Callable[[int], Callable[[], object]]] = {
                "echo": lambda i: lambda: echoes[i].call("echo", b"x" * 100, timeout_s=30),
                "query": lambda i: lambda: clients[i].get_job(samplers[i].job_id),
                "sample": lambda i: lambda: samplers[i].sample([1, 2, 3, 4], 1, PARAMS).result(),
            }
            run_threads(n, phases["sample"], 1.0)  # warm: every job placed, the engine's first batches
            for _ in range(rounds):
                for name, make in phases.items():
                    per_s, cpu_ms = measured(scheduler, functools.partial(run_threads, n, make, seconds), seconds)
                    figures.setdefault(f"{name}_calls_per_s", []).append(per_s)
                    if name != "echo":
                        figures.setdefault(f"scheduler_cpu_ms_per_{name}", []).append(cpu_ms)
            for e in echoes:
                e.close()
            for c in clients:
                c.close()  # finishes its sampler's job
        figures["sqlite_commits_per_s"] = [sqlite_commits_per_s(seconds / 2)]
        figures["hop_mb_per_s"] = [hop_mb_per_s(echo_addr, 3 if args.quick else 8)]
    finally:
        echo_proc.kill()
        echo_proc.wait()

    out = {k: statistics.median(v) for k, v in figures.items()}
    out["query_vs_echo_ratio"] = out["query_calls_per_s"] / out["echo_calls_per_s"]
    out["scheduler_capacity_queries_per_s"] = 1000.0 / out["scheduler_cpu_ms_per_query"]
    out["scheduler_capacity_samples_per_s"] = 1000.0 / out["scheduler_cpu_ms_per_sample"]
    print(f"clients: {n}")
    print(f"cpu_count: {psutil.cpu_count()}")
    for key, value in out.items():
        print(f"{key}: {value:.3f}" if value < 10 else f"{key}: {value:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
