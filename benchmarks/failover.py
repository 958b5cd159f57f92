"""Failover time: SIGKILL the engine of a real local runtime while a sample call is in flight,
and SIGKILL a Tinker SDK client that holds every adapter slot without closing its session.

    python benchmarks/failover.py                 # tiny-random model, 256 new tokens per sample
    python benchmarks/failover.py --tokens 512 --heartbeat 10
    python benchmarks/failover.py --quick         # the session phase with a 15 s session timeout

Prints ``failover_s`` (from the kill to the broker failing the call in flight and waiting for the
engine to come back, read from the scheduler's log), ``restart_registered_s`` (to the restarted
engine's registration), ``call_done_s`` (to the in-flight call's answer, from the restarted engine)
and ``sample_alone_s`` (the same call with no fault). With one engine the call has to wait for the
restart anyway; ``failover_s`` is how long a call in flight to a dead worker stays stuck on it.

``slots_recovered_s`` (``slots_recovered``): from the SIGKILL of a client process (the official
``tinker`` SDK, through the HTTP gateway) whose run holds the engine's only adapter slot, to another
tenant's run, queued meanwhile, completing a training step: the killed client's session is silent
for ``session_timeout_s`` (``--session-timeout``; the shipped default unless ``--quick``), then ends
and its run's job finishes. Target: at most ``session_timeout_s`` + 10 s.

``scheduler_restart_call_delay_s``: an SDK sample (through the HTTP gateway) in flight when the
scheduler is SIGKILLed, from the kill to its answer; ``scheduler_restart_s``: from the kill to
the restarted scheduler answering a call. Target: the delay at most 3x the restart time
(``scheduler_restart_delay_ratio`` <= 3): the call is sent again at once, not after its timeout.

``saturated_failed_calls``: SDK training runs of two tenants (forward_backward, optim_step, a
sample from the new weights, over and over) for ``--saturated-s`` seconds while busy processes
hold every core, two per core; the calls that raised (target 0) and ``saturated_calls``, the
calls answered.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

from polytinker.actors import read_log
from polytinker.client import ServiceClient
from polytinker.engine.types import SamplingParams
from polytinker.engine.worker.auth import launcher_credential
from polytinker.engine.worker.messages import WorkersQuery
from polytinker.gateway import HttpRuntime
from polytinker.scheduler.service import EngineWorkerConfig, LocalRuntime, RuntimeConfig, TenantConfig
from polytinker.scheduler.service.config import HttpConfig
from polytinker.transport import RpcClient, ask

KEY = "failover-benchmark-key-0123"


def _registered_after(runtime: LocalRuntime, old: str, killed: float, out: dict[str, float]) -> None:
    """Poll the broker until a new incarnation of the engine is alive; note when."""
    with RpcClient(runtime.local_address) as rpc:
        while True:
            workers = ask(rpc, WorkersQuery(launcher_credential(runtime.config.worker_token)), timeout_s=5).workers
            if any(w["incarnation"] != old and w["alive"] for w in workers):
                out["restart_registered_s"] = time.monotonic() - killed
                return
            time.sleep(0.02)


def _failed_over_after(runtime: LocalRuntime, killed_wall: float) -> float:
    for record in read_log(runtime.config.state_path / "run", "scheduler"):
        if "waiting for it to come back" in record["message"]:
            return datetime.fromisoformat(record["time"]).timestamp() - killed_wall
    return float("nan")


# The killed client: a LoRA run that takes the engine's only adapter slot, then waits to be killed.
_CLIENT = """
import sys, time
import tinker
from tinker import types
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = service.create_lora_training_client(base_model="tiny-random", rank=4).result()
datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
tc.forward_backward([datum], "cross_entropy").result()
print("holding", flush=True)
time.sleep(3600)
"""


def slots_recovered(session_timeout_s: float) -> dict[str, float]:
    """``slots_recovered_s``: see the module docstring. Two tenants, one engine with one adapter
    slot; idle runs are never reclaimed for a waiting one here, so only the session's end frees it."""
    import tinker
    from tinker import types

    keys = ("tml-failover-alice-0123456789", "tml-failover-bob-01234567890")
    cfg = RuntimeConfig(
        model="tiny-random",
        tenants=(TenantConfig("alice", api_key=keys[0]), TenantConfig("bob", api_key=keys[1])),
        engines=(EngineWorkerConfig(adapter_slots=1),),
        slot_reclaim_idle_s=3600.0,
        start_timeout_s=240.0,
        http=HttpConfig(address="127.0.0.1:0", session_timeout_s=session_timeout_s),
    )
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
    with HttpRuntime(cfg) as runtime:
        child = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, runtime.http_url, keys[0]], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "holding", "the client failed"
            bob = tinker.ServiceClient(base_url=runtime.http_url, api_key=keys[1])
            waiting = bob.create_lora_training_client(base_model="tiny-random", rank=4).result()
            stepped: list[float] = []

            def step() -> None:
                waiting.forward_backward([datum], "cross_entropy").result()
                stepped.append(time.monotonic())

            stepper = threading.Thread(target=step, daemon=True)
            stepper.start()
            time.sleep(2.0)
            assert not stepped, "the waiting run stepped before the kill: the slot was not held"
            killed = time.monotonic()
            child.send_signal(signal.SIGKILL)
            stepper.join(session_timeout_s + 120)
            assert stepped, "the waiting run never got the slot"
            recovered_s = stepped[0] - killed
            bob.close("success").result()
        finally:
            child.kill()
            child.wait()
    return {"session_timeout_s": session_timeout_s, "slots_recovered_s": recovered_s}


def _tinker_runtime(keys: tuple[str, ...]) -> RuntimeConfig:
    """tiny-random with one engine, one learner and the HTTP gateway, one tenant per key."""
    tenants = tuple(TenantConfig(f"tenant-{i}", api_key=k) for i, k in enumerate(keys))
    return RuntimeConfig(
        model="tiny-random", tenants=tenants, start_timeout_s=240.0, http=HttpConfig(address="127.0.0.1:0")
    )


def scheduler_restart(tokens: int) -> dict[str, float]:
    """``scheduler_restart_call_delay_s`` and ``scheduler_restart_s``: see the module docstring."""
    import tinker
    from tinker import types

    key = "tml-failover-restart-0123456789"
    with HttpRuntime(_tinker_runtime((key,))) as runtime:
        sampler = (
            tinker.ServiceClient(base_url=runtime.http_url, api_key=key)
            .create_sampling_client(base_model="tiny-random")
            .result()
        )
        params = types.SamplingParams(max_tokens=tokens, temperature=1.0)
        prompt = types.ModelInput.from_ints([3, 4, 5])
        sampler.sample(prompt, 1, params).result()  # warm
        assert runtime.scheduler is not None
        old = runtime.scheduler.pid
        assert old is not None
        in_flight = sampler.sample(prompt, 1, params)
        time.sleep(0.3)
        assert not in_flight.done(), "the sample finished before the kill: raise --tokens"
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        with ServiceClient(runtime.address, api_key=key) as probe:
            while runtime.scheduler.pid in (None, old):
                time.sleep(0.01)
            probe.list_jobs()  # answered by the new scheduler
            restart_s = time.monotonic() - killed
        in_flight.result(timeout=300)
        delay_s = time.monotonic() - killed
    return {
        "scheduler_restart_s": restart_s,
        "scheduler_restart_call_delay_s": delay_s,
        "scheduler_restart_delay_ratio": delay_s / restart_s,
    }


def saturated(seconds: float) -> dict[str, float]:
    """``saturated_failed_calls`` and ``saturated_calls``: see the module docstring."""
    import tinker
    from tinker import types

    keys = ("tml-failover-busy-a-0123456789", "tml-failover-busy-b-0123456789")
    calls, failures, lock = [0], [], threading.Lock()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 42))),
        loss_fn_inputs={"target_tokens": list(range(11, 43))},
    )

    def run(url: str, key: str, deadline: float) -> None:
        trainer = (
            tinker.ServiceClient(base_url=url, api_key=key)
            .create_lora_training_client(base_model="tiny-random", rank=4)
            .result()
        )
        with lock:
            calls[0] += 1
        while time.monotonic() < deadline:
            try:
                trainer.forward_backward([datum] * 4, "cross_entropy").result(timeout=600)
                trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=600)
                sampler = trainer.save_weights_and_get_sampling_client().result()
                sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=8)).result(
                    timeout=600
                )
                with lock:
                    calls[0] += 4
            except Exception as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}"[:300])

    with HttpRuntime(_tinker_runtime(keys)) as runtime:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * _cores())]
        try:
            deadline = time.monotonic() + seconds
            threads = [
                threading.Thread(target=run, args=(runtime.http_url, key, deadline), daemon=True)
                for key in (*keys, *keys)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(seconds + 900)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    for failure in failures:
        print(f"saturated failure: {failure}", file=sys.stderr)
    return {"saturated_failed_calls": float(len(failures)), "saturated_calls": float(calls[0])}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per sample (the call must outlast 0.3 s)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="worker_heartbeat_s")
    parser.add_argument("--quick", action="store_true", help="the session phase with a 15 s session timeout")
    parser.add_argument("--saturated-s", type=float, default=None, help="the saturated phase (default 20, --quick 10)")
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=None,
        help="[http] session_timeout_s (default: 15 with --quick, else 180)",
    )
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
            query = WorkersQuery(launcher_credential(runtime.config.worker_token))
            old = ask(rpc, query, timeout_s=5).workers[0]["incarnation"]
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
    # What a call to a dead worker would wait without the supervisor's report and the closed
    # connection: its connection's silence limit.
    timeout_s = cfg.worker_silence_s
    print(f"heartbeat_timeout_s: {timeout_s:.1f}")
    for name in ("failover_s", "restart_registered_s", "call_done_s", "sample_alone_s"):
        print(f"{name}: {figures.get(name, float('nan')):.2f}")
    print(f"failover_vs_heartbeat_timeout_ratio: {figures.get('failover_s', float('nan')) / timeout_s:.3f}")
    # Above the SDK's 10 s heartbeat period: a shorter timeout would end the waiting client's live session too.
    session_timeout_s = args.session_timeout or (15.0 if args.quick else HttpConfig().session_timeout_s)
    for name, value in slots_recovered(session_timeout_s).items():
        print(f"{name}: {value:.2f}")
    for name, value in scheduler_restart(args.tokens).items():
        print(f"{name}: {value:.2f}")
    for name, value in saturated(args.saturated_s or (10.0 if args.quick else 20.0)).items():
        print(f"{name}: {value:.0f}")


if __name__ == "__main__":
    main()
