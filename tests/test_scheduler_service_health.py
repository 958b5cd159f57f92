"""A runtime that cannot keep an actor alive fails loudly; `polytinker status` shows every actor;
a worker's exit fails its calls in flight at once. Real processes and sockets throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.client import MODEL
from test_scheduler_service_cli import read_until

from polytinker.client import ServiceClient
from polytinker.engine.types import SamplingParams
from polytinker.engine.worker.auth import launcher_credential
from polytinker.engine.worker.messages import WorkersQuery
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    RuntimeDead,
    TenantConfig,
)
from polytinker.scheduler.service.runtime import resolve_address
from polytinker.transport import RpcClient

KEY = "health-tenant-key-0123456789"
LONG = SamplingParams(max_tokens=256, temperature=1.0, ignore_eos=True, seed=1)
CMD = [sys.executable, "-m", "polytinker.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _serve(tmp_path: Path, *, max_restarts: int, local_engine: bool) -> tuple[subprocess.Popen[str], str]:
    address = resolve_address("tcp://127.0.0.1:0")
    if local_engine:
        workers = 'learners = []\n[[engines]]\nengine_id = "engine-0"\n'
    else:  # a remote learner that never joins: the runtime's only actor is its scheduler
        workers = 'engines = []\n[[learners]]\nlearner_id = "learner-remote"\nlocal = false\n'
    (tmp_path / "runtime.toml").write_text(
        f'model = "{MODEL}"\naddress = "{address}"\nmax_restarts = {max_restarts}\n{workers}'
        f'[[tenants]]\nname = "ops"\napi_key = "{KEY}"\n'
    )
    args = [*CMD, "serve", "--config", str(tmp_path / "runtime.toml"), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    read_until(proc, "scheduler at", timeout_s=180.0)
    return proc, address


@pytest.fixture
def stop_after() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _status(address: str) -> dict:
    out = subprocess.run(
        [*CMD, "status", "--scheduler", address, "--api-key", KEY, "--json"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def _actor(address: str, name: str) -> dict:
    return next(a for a in _status(address)["actors"] if a["name"] == name)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def _exits_with(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> tuple[int, str]:
    code = proc.wait(timeout_s)
    assert proc.stderr is not None
    return code, proc.stderr.read()


def test_serve_exits_nonzero_naming_the_scheduler_when_it_stays_down(tmp_path, stop_after) -> None:
    serve, address = _serve(tmp_path, max_restarts=0, local_engine=False)
    stop_after.append(serve)
    scheduler = _actor(address, "scheduler")
    assert scheduler["alive"] and scheduler["pid"] > 0
    os.kill(scheduler["pid"], signal.SIGKILL)
    code, stderr = _exits_with(serve)
    assert code == 1
    line = next(ln for ln in stderr.splitlines() if ln.startswith("polytinker serve:"))
    assert "actor 'scheduler'" in line and "not restarted again" in line and "exit code -9" in line


def test_status_shows_each_actor_and_serve_stops_when_an_engine_stays_down(tmp_path, stop_after) -> None:
    serve, address = _serve(tmp_path, max_restarts=1, local_engine=True)
    stop_after.append(serve)
    table = subprocess.run(
        [*CMD, "status", "--scheduler", address, "--api-key", KEY], capture_output=True, text=True, env=ENV, timeout=60
    ).stdout
    assert table.splitlines()[1].split() == ["ACTOR", "STATE", "PID", "RESTARTS", "LAST", "EXIT", "NODE"]
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines()[2:4]}
    assert rows["scheduler"][1:2] == ["alive"] and rows["engine-0"][1:2] == ["alive"]
    assert rows["scheduler"][-2:] == rows["engine-0"][-2:] == ["this", "machine"]  # not placed by Ray
    engine = _actor(address, "engine-0")
    assert engine["restarts"] == 0 and engine["last_exit_code"] is None and not engine["gave_up"]
    os.kill(engine["pid"], signal.SIGKILL)
    # Restarted once (max_restarts=1); the status says so, with the exit code of the one killed.
    _wait_for(lambda: _actor(address, "engine-0")["restarts"] == 1, 180.0, "the engine's restart")
    engine = _actor(address, "engine-0")
    assert engine["last_exit_code"] == -9 and engine["alive"]
    assert "last_error" not in engine  # a line of a server traceback is the operator's, not a tenant's
    assert any(w["worker_id"] == "engine-0" and w["alive"] for w in _status(address)["workers"])
    os.kill(engine["pid"], signal.SIGKILL)  # a second death within the window: the runtime gives up
    code, stderr = _exits_with(serve)
    assert code == 1
    assert "polytinker serve: the runtime stopped: actor 'engine-0' is down, and not restarted again" in stderr


def _engine_runtime(**changes: object) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        tenants=(TenantConfig("t", api_key=KEY),),
        engines=(EngineWorkerConfig(batch_window_s=0.01),),
        learners=(),
        start_timeout_s=240.0,
        **changes,  # type: ignore[arg-type]
    )


def test_an_embedded_runtime_that_loses_its_engine_raises_runtime_dead(tmp_path) -> None:
    with ServiceClient(runtime_config=_engine_runtime(max_restarts=0, state_dir=str(tmp_path / "s"))) as service:
        sampler = service.create_sampling_client(base_model=MODEL)
        assert sampler.sample([3, 4], 1, SamplingParams(max_tokens=2)).result().sequences
        runtime = service.runtime
        in_flight = sampler.sample([3, 4, 5], 1, LONG)
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(runtime.workers["engine-0"].pid, signal.SIGKILL)
        why = r"the runtime stopped: actor 'engine-0' is down, and not restarted again.*exit code -9"
        with pytest.raises(RuntimeDead, match=why):
            in_flight.result(timeout=60)
        # Well inside the client's reconnect window (120 s): it does not retry a runtime that is gone.
        assert time.monotonic() - killed < 30.0
        assert runtime.dead.wait(30.0) and runtime.supervisor is None  # it stopped everything
        with pytest.raises(RuntimeDead, match=why):
            sampler.sample([3, 4], 1, SamplingParams(max_tokens=2)).result(timeout=60)


def test_a_call_in_flight_to_a_killed_engine_fails_over_before_the_heartbeat_timeout() -> None:
    """With 10 s heartbeats the broker's connection to a dead engine goes silent only after 30 s;
    the supervisor's report fails the call at once, and it is resent to the restarted engine."""
    cfg = _engine_runtime(worker_heartbeat_s=10.0)
    heartbeat_timeout_s = 3 * cfg.worker_heartbeat_s
    with LocalRuntime(cfg) as runtime, ServiceClient(runtime.address, api_key=KEY) as service:
        sampler = service.create_sampling_client(base_model=MODEL)
        sampler.sample([3, 4, 5], 1, SamplingParams(max_tokens=2)).result()
        engine = runtime.workers["engine-0"]
        future = sampler.sample([3, 4, 5], 1, LONG)
        time.sleep(0.3)
        assert not future.done()  # in flight on the engine
        seen: list[tuple[str, bool]] = []
        stop = threading.Event()

        def watch() -> None:  # what the broker believes, every 20 ms
            with RpcClient(runtime.local_address) as rpc:
                while not stop.is_set():
                    workers = rpc.call(
                        "sched.w.workers", WorkersQuery(launcher_credential(runtime.config.worker_token)), timeout_s=5
                    ).workers
                    seen.extend((w["incarnation"], w["alive"]) for w in workers)
                    time.sleep(0.02)

        old = _incarnation(runtime)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        result = future.result(timeout=120)
        elapsed = time.monotonic() - killed
        stop.set()
        watcher.join(10)
        assert len(result.sequences[0].tokens) == LONG.max_tokens
        assert elapsed < heartbeat_timeout_s - 5.0, f"failed over after {elapsed:.1f} s"
        # The old incarnation was marked dead before the new one registered: the report, not the
        # new registration (nor a heartbeat), ended the call.
        first_new = next((i for i, (inc, _) in enumerate(seen) if inc != old), len(seen))
        assert (old, False) in seen[:first_new]


def _incarnation(runtime: LocalRuntime) -> str:
    with RpcClient(runtime.local_address) as rpc:
        workers = rpc.call(
            "sched.w.workers", WorkersQuery(launcher_credential(runtime.config.worker_token)), timeout_s=5
        ).workers
    return str(workers[0]["incarnation"])
