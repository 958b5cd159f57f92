"""Failover time: SIGKILL the engine of a real local runtime while a sample call is in flight.

    python benchmarks/failover.py                 # tiny-random model, 256 new tokens per sample
    python benchmarks/failover.py --tokens 512 --heartbeat 10

Prints ``failover_s`` (from the kill to the broker failing the call in flight and waiting for the
engine to come back, read from the scheduler's log), ``restart_registered_s`` (to the restarted
engine's registration), ``call_done_s`` (to the in-flight call's answer, from the restarted engine)
and ``sample_alone_s`` (the same call with no fault). With one engine the call has to wait for the
restart anyway; ``failover_s`` is how long a call in flight to a dead worker stays stuck on it.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from datetime import datetime

from polytinker.actors import read_log
from polytinker.client import ServiceClient
from polytinker.engine.types import SamplingParams
from polytinker.scheduler.service import EngineWorkerConfig, LocalRuntime, RuntimeConfig, TenantConfig
from polytinker.scheduler.service.worker_auth import launcher_credential
from polytinker.scheduler.service.worker_messages import WorkersQuery
from polytinker.transport import RpcClient

KEY = "failover-benchmark-key-0123"


def _registered_after(runtime: LocalRuntime, old: str, killed: float, out: dict[str, float]) -> None:
    """Poll the broker until a new incarnation of the engine is alive; note when."""
    with RpcClient(runtime.local_address) as rpc:
        while True:
            workers = rpc.call(
                "sched.w.workers", WorkersQuery(launcher_credential(runtime.config.worker_token)), timeout_s=5
            )
            if any(w["incarnation"] != old and w["alive"] for w in workers):
                out["restart_registered_s"] = time.monotonic() - killed
                return
            time.sleep(0.02)


def _failed_over_after(runtime: LocalRuntime, killed_wall: float) -> float:
    for record in read_log(runtime.config.state_path / "run", "scheduler"):
        if "waiting for it to come back" in record["message"]:
            return datetime.fromisoformat(record["time"]).timestamp() - killed_wall
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per sample (the call must outlast 0.3 s)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="worker_heartbeat_s (liveness: 3 of them)")
    args = parser.parse_args()
    cfg = RuntimeConfig(
        model="tiny-random",
        tenants=(TenantConfig("bench", api_key=KEY),),
        engines=(EngineWorkerConfig(batch_window_s=0.01),),
        learners=(),
        worker_heartbeat_s=args.heartbeat,
        start_timeout_s=240.0,
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True, seed=1)
    with LocalRuntime(cfg) as runtime, ServiceClient(runtime.address, api_key=KEY) as service:
        sampler = service.create_sampling_client(base_model=cfg.model)
        started = time.monotonic()
        sampler.sample([3, 4, 5], 1, params).result()
        figures = {"sample_alone_s": time.monotonic() - started}
        with RpcClient(runtime.local_address) as rpc:
            old = rpc.call(
                "sched.w.workers", WorkersQuery(launcher_credential(runtime.config.worker_token)), timeout_s=5
            )[0]["incarnation"]
        future = sampler.sample([3, 4, 5], 1, params)
        time.sleep(0.3)
        assert not future.done(), "the sample finished before the kill: raise --tokens"
        pid = runtime.workers["engine-0"].pid
        assert pid is not None
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(pid, signal.SIGKILL)
        watcher = threading.Thread(target=_registered_after, args=(runtime, old, killed, figures), daemon=True)
        watcher.start()
        future.result(timeout=300)
        figures["call_done_s"] = time.monotonic() - killed
        watcher.join(30)
        time.sleep(0.2)  # the scheduler's log line is written by its own process
        figures["failover_s"] = _failed_over_after(runtime, killed_wall)
    timeout_s = 3 * args.heartbeat  # what a call to a dead worker waited before: its connection's silence
    print(f"heartbeat_timeout_s: {timeout_s:.1f}")
    for name in ("failover_s", "restart_registered_s", "call_done_s", "sample_alone_s"):
        print(f"{name}: {figures.get(name, float('nan')):.2f}")
    print(f"failover_vs_heartbeat_timeout_ratio: {figures.get('failover_s', float('nan')) / timeout_s:.3f}")


if __name__ == "__main__":
    main()
