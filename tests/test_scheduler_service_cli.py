"""`polytinker serve` and `polytinker worker` as real processes, secured with Curve: a learner joins
the scheduler over TCP and a client trains through it; a tenant known by its Curve key alone; and
`polytinker jobs` sees the job."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.client import data

from polytinker import cli
from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.errors import PeerDeadError, RequestTimeout, TransportError
from polytinker.scheduler.service.runtime import resolve_address
from polytinker.transport import ClientCurve, generate_keypair, load_keypair

KEY = "cli-tenant-key-0123456789"
TOKEN = "cli-worker-token-0123456789"


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float = 120.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            seen.append(line)
            if marker in line:
                return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"no {marker!r} from {proc.args}; output: {''.join(seen)}")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    keys, clients = tmp_path / "keys", tmp_path / "keys" / "clients"
    generate_keypair(keys, "scheduler")
    generate_keypair(clients, "learner-remote")
    me_public = load_keypair(generate_keypair(clients, "me")[0])[0].decode()
    address = resolve_address("tcp://127.0.0.1:0")
    (tmp_path / "runtime.toml").write_text(
        f'model = "tiny-random"\naddress = "{address}"\nworker_token = "{TOKEN}"\n'
        f'curve_secret_file = "{keys}/scheduler.key_secret"\ncurve_clients_dir = "{clients}"\n'
        "engines = []\n"
        '[[learners]]\nlearner_id = "learner-remote"\nlocal = false\n'
        f'[[tenants]]\nname = "team"\napi_key = "{KEY}"\n'
        f'[[tenants]]\nname = "keyed"\ncurve_public_key = "{me_public}"\n'
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "polytinker.cli"]
    config = ["--config", str(tmp_path / "runtime.toml")]
    serve_args = [*cmd, "serve", *config, "--state-dir", str(tmp_path / "state")]
    serve = subprocess.Popen(serve_args, stdout=subprocess.PIPE, text=True, env=env)
    worker = None
    try:
        read_until(serve, "scheduler at")
        secret, scheduler_key = clients / "learner-remote.key_secret", keys / "scheduler.key"
        curve = ["--curve-secret", str(secret), "--scheduler-key", str(scheduler_key)]
        worker_args = [*cmd, "worker", *config, "--id", "learner-remote", "--scheduler", address, "--token", TOKEN]
        worker_args += ["--state-dir", str(tmp_path / "worker-state")]  # its own root, as on another machine
        worker = subprocess.Popen([*worker_args, *curve], stdout=subprocess.PIPE, text=True, env=env)
        read_until(worker, "serving at")
        yield address, keys
    finally:
        for proc in (worker, serve):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        for proc in (worker, serve):
            if proc is not None:
                assert proc.wait(60) == 0


def test_serve_and_a_remote_worker_with_curve(served: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    address, keys = served
    curve = ClientCurve.from_files(keys / "clients" / "me.key_secret", keys / "scheduler.key")
    with ServiceClient(address, api_key=KEY, curve=curve) as service:
        trainer = service.create_lora_training_client("tiny-random", rank=4, kind="sft")
        trainer.forward_backward(data(21))
        assert trainer.optim_step(AdamParams(learning_rate=1e-2)).result().version == 1
        job_id = trainer.job_id
    # No API key: the Curve key the client was admitted with names its tenant, which sees only its own jobs.
    with ServiceClient(address, curve=curve) as keyed:
        assert job_id not in [j["job_id"] for j in keyed.list_jobs()]
        mine = keyed.create_lora_training_client("tiny-random", rank=4, kind="sft")
        assert [j["job_id"] for j in keyed.list_jobs()] == [mine.job_id]
    # Without the Curve keys the scheduler does not even answer.
    with ServiceClient(address, api_key=KEY, timeout_s=3.0) as stranger:
        stranger._connection().reconnect_s = 0.0
        with pytest.raises((PeerDeadError, RequestTimeout)):
            stranger.list_jobs()
    curve_args = [
        "--curve-secret",
        str(keys / "clients" / "me.key_secret"),
        "--scheduler-key",
        str(keys / "scheduler.key"),
    ]
    assert cli.main(["jobs", "--scheduler", address, "--api-key", KEY, *curve_args, "list"]) == 0
    out = capsys.readouterr().out
    assert job_id in out and "done" in out
    # The remote learner wrote the job's checkpoints under its own --state-dir, from ids alone.
    assert list((keys.parent / "worker-state" / "checkpoints" / "team" / job_id).glob("*/v1"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--bind", "0.0.0.0:7100"], "--bind '0.0.0.0:7100': use tcp://HOST:PORT or ipc://PATH"),
        (["--scheduler", "tcp://10.1.2.3:7000"], "pass --curve-secret"),
        (["--curve-secret", "w.key_secret"], "with --scheduler-key"),
    ],
)
def test_worker_refuses_bad_addresses_and_missing_keys_before_loading_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    from polytinker.engine.worker import server as workers

    def no_model(*_a: object) -> None:
        raise AssertionError("the worker loaded a model before checking its arguments")

    monkeypatch.setattr(workers, "build_worker", no_model)
    base = ["worker", "--id", "learner-0", "--token", TOKEN, "--scheduler", "tcp://127.0.0.1:7000"]
    base += ["--state-dir", str(tmp_path)]
    assert cli.main([*base, *args]) == 1
    assert says in capsys.readouterr().err


def test_a_remote_worker_without_keys_of_its_own_serves_with_the_tokens_keys(tmp_path: Path) -> None:
    """A scheduler without Curve (loopback) and a `polytinker worker` given only the token: the
    worker still serves with Curve (keys derived from the token), the scheduler reaches it, and a
    process without the token does not."""
    from polytinker.engine.worker import messages as wm
    from polytinker.transport import RpcClient

    address = resolve_address("tcp://127.0.0.1:0")
    (tmp_path / "runtime.toml").write_text(
        f'model = "tiny-random"\naddress = "{address}"\nworker_token = "{TOKEN}"\nengines = []\n'
        '[[learners]]\nlearner_id = "learner-remote"\nlocal = false\n'
        f'[[tenants]]\nname = "team"\napi_key = "{KEY}"\n'
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    config = ["--config", str(tmp_path / "runtime.toml")]
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "polytinker.cli", *args], stdout=subprocess.PIPE, text=True, env=env
            )
        )
        return procs[-1]

    try:
        read_until(start("serve", *config, "--state-dir", str(tmp_path / "state")), "scheduler at")
        joins = ["--id", "learner-remote", "--scheduler", address, "--token", TOKEN]  # no keys of its own
        worker = start("worker", *config, *joins, "--state-dir", str(tmp_path / "worker-state"))
        worker_address = read_until(worker, "serving at").split("serving at ")[1].split(",")[0]
        with ServiceClient(address, api_key=KEY) as service:
            trainer = service.create_lora_training_client("tiny-random", rank=4, kind="sft")
            trainer.forward_backward(data(22))
            assert trainer.optim_step(AdamParams(learning_rate=1e-2)).result().version == 1
        with RpcClient(worker_address) as stranger, pytest.raises((RequestTimeout, TransportError)):
            stranger.call("sched.w.stats", wm.WorkerStats(), timeout_s=2.0)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(60) == 0
