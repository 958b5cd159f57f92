"""Slow, restarted or gone: an SDK client's run goes on through a killed scheduler, learner or
engine, and through cores saturated by busy processes.

Each test drives a real ``polytinker serve --http`` (tiny-random model, tests/_serve.py) with the
real ``tinker`` SDK, and SIGKILLs the runtime's own processes (found by ``polytinker status``)
while calls are in flight: no call fails, none is applied twice (each ``optim_step`` answers the
next version), and the next call after a kill is answered within a bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve import KEY, KEY_BOB, Serve
from fixtures.busy import Busy

from polytinker.client import ServiceClient

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "polytinker.cli"]
MODEL = "tiny-random"
# From a kill to the next answer: the supervisor restarts the process (the scheduler in about a
# second; a worker loads tiny-random in seconds, slower on a loaded machine) and the call is sent
# again. Far below any call timeout (60-600 s), which is what a lost call used to wait out.
RECOVERY_BOUND_S = 60.0


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("restarts"), model=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def tinker() -> Any:
    return pytest.importorskip("tinker")


def _scheduler_address(serve: Serve) -> str:
    return (serve.root / "runtime.toml").read_text().split('address = "')[1].split('"')[0]


def _actors(serve: Serve) -> dict[str, dict[str, Any]]:
    """The runtime's actors by name (``polytinker status``), with their pids."""
    out = subprocess.run(
        [*CLI, "status", "--scheduler", _scheduler_address(serve), "--api-key", KEY, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    return {a["name"]: a for a in json.loads(out.stdout)["actors"]}


def _datum(tinker: Any, seed: int) -> Any:
    tokens = [(seed * 7 + i) % 400 + 10 for i in range(33)]
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32},
    )


class Loop:
    """One SDK training run stepping in a thread: forward_backward, optim_step and a sample from
    the new weights, over and over; what each call answered, and when, is kept."""

    def __init__(self, tinker: Any, url: str, key: str) -> None:
        self.tinker = tinker
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.trainer = self.service.create_lora_training_client(base_model=MODEL, rank=4).result()
        self.versions: list[int] = []
        self.answered: list[float] = []  # when each call was answered (monotonic)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        params = self.tinker.types.SamplingParams(max_tokens=8, temperature=1.0)
        prompt = self.tinker.types.ModelInput.from_ints([1, 2, 3, 4])
        step = 0
        while not self.stop.is_set():
            try:
                self.trainer.forward_backward(
                    [_datum(self.tinker, step + i) for i in range(4)], "cross_entropy"
                ).result(timeout=300)
                self.answered.append(time.monotonic())
                self.trainer.optim_step(self.tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=300)
                self.answered.append(time.monotonic())
                self.versions.append(step + 1)
                sampler = self.trainer.save_weights_and_get_sampling_client().result()
                got = sampler.sample(prompt, 2, params).result(timeout=300)
                assert len(got.sequences) == 2
                self.answered.append(time.monotonic())
            except Exception as exc:  # counted, not raised: the test says what failed
                self.errors.append(f"step {step}: {type(exc).__name__}: {exc}"[:500])
                return
            step += 1

    def answers_after(self, t: float) -> list[float]:
        return [a - t for a in self.answered if a > t]


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["scheduler", "learner-0", "engine-0"])
def test_a_killed_process_loses_no_call_and_applies_none_twice(serve: Serve, tinker: Any, victim: str) -> None:
    loop = Loop(tinker, serve.url, KEY)
    loop.thread.start()
    try:
        _wait(lambda: len(loop.answered) >= 6 or loop.errors, 120, "two steps before the kill")
        before = _actors(serve)[victim]
        os.kill(before["pid"], signal.SIGKILL)
        killed = time.monotonic()
        _wait(
            lambda: loop.answers_after(killed) or loop.errors, RECOVERY_BOUND_S, f"a call answered after {victim} died"
        )
        first = loop.answers_after(killed)[0] if not loop.errors else float("nan")
        steps_at_kill = len(loop.versions)
        _wait(lambda: len(loop.versions) >= steps_at_kill + 2 or loop.errors, 120, "two more steps")
    finally:
        loop.stop.set()
        loop.thread.join(300)
    assert not loop.errors, loop.errors
    after = _actors(serve)[victim]
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert first < RECOVERY_BOUND_S
    # Each optim_step answered made one version: none lost, none applied twice.
    with ServiceClient(_scheduler_address(serve), api_key=KEY) as native:
        assert native.get_job(_job_of(serve, loop.trainer.model_id))["adapter"]["version"] == len(loop.versions)


def _job_of(serve: Serve, model_id: str) -> str:
    """The runtime's job behind a Tinker model id (the gateway's own table of them)."""
    with contextlib.closing(sqlite3.connect(serve.root / "state" / "gateway.sqlite")) as db:
        (job_id,) = db.execute("SELECT job_id FROM models WHERE model_id = ?", (model_id,)).fetchone()
    return str(job_id)


def _train_config(serve: Serve, root: Path, steps: int = 1) -> Path:
    agents = "".join(
        f'[[agents]]\nname = "{name}"\nbase_model = "{MODEL}"\n[agents.adapter]\nrank = 4\nalpha = 8\n'
        "[agents.sampling]\nmax_tokens = 4\n"
        for name in ("alice", "bob")
    )
    path = root / "pd.toml"
    path.write_text(
        f'name = "pd-saturated"\n[env]\nid = "prisoners_dilemma-v0"\nkwargs = {{ rounds = 1 }}\n{agents}'
        f"[train]\nsteps = {steps}\ngroups = 1\ngroup_size = 4\n[eval]\nepisodes = 2\nat_start = false\n"
        f'[output]\nroot = "{root}"\ntensorboard = false\nprogress = false\n'
        f'[runtime]\naddress = "{_scheduler_address(serve)}"\napi_key = "{KEY_BOB}"\n'
    )
    return path


@pytest.mark.slow
def test_saturated_cores_fail_no_call_of_two_tenants_and_a_train_run_finishes(
    serve: Serve, tinker: Any, tmp_path: Path
) -> None:
    """SDK runs of two tenants and a ``polytinker train`` run, all at once, while busy processes
    hold every core: every call answers (slowly), every run finishes."""
    config = _train_config(serve, tmp_path)
    with Busy():
        loops = [Loop(tinker, serve.url, key) for key in (KEY, KEY_BOB, KEY_BOB)]
        for loop in loops:
            loop.thread.start()
        train = subprocess.run(
            [*CLI, "train", str(config), "--no-progress"], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        _wait(lambda: all(len(lp.versions) >= 2 or lp.errors for lp in loops), 300, "two steps of each SDK run")
        for loop in loops:
            loop.stop.set()
        for loop in loops:
            loop.thread.join(300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert [e for lp in loops for e in lp.errors] == []
    assert all(len(lp.versions) >= 2 for lp in loops)


@pytest.mark.slow
def test_a_train_run_rides_out_a_killed_learner_and_scheduler(serve: Serve, tmp_path: Path) -> None:
    """``polytinker train`` against serve: the learner SIGKILLed after the first step, the
    scheduler after the second; the run finishes every step, with no error."""
    config = _train_config(serve, tmp_path, steps=4)
    metrics = tmp_path / "pd-saturated" / "metrics.jsonl"
    train = subprocess.Popen(
        [*CLI, "train", str(config), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        for victim, steps in (("learner-0", 1), ("scheduler", 2)):
            _wait(lambda s=steps: _steps(metrics) >= s or train.poll() is not None, 300, f"step {steps}")
            assert train.poll() is None, train.communicate()[1][-3000:]
            os.kill(_actors(serve)[victim]["pid"], signal.SIGKILL)
        err = train.communicate(timeout=600)[1]
    finally:
        train.kill()
    assert train.returncode == 0, err[-3000:]
    assert _steps(metrics) == 4


def _steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return len({r["step"] for r in rows if r.get("step", 0) > 0})  # an evaluation's row repeats its step


# --- a resent call: Tinker's seq_id ------------------------------------------------------------------
def test_seq_ids_answer_a_resend_once_and_refuse_a_reused_id() -> None:
    import asyncio

    from polytinker.gateway.errors import HttpError
    from polytinker.gateway.seq_ids import SeqIds, body_digest

    runs: list[int] = []

    async def run() -> dict[str, Any]:
        runs.append(1)
        await asyncio.sleep(0.01)
        return {"request_id": f"r{len(runs)}"}

    async def main() -> None:
        ids = SeqIds(per_run=2)
        a, b = body_digest("/api/v1/optim_step", {"x": 1}), body_digest("/api/v1/optim_step", {"x": 2})
        first, again = await asyncio.gather(ids.once("t", "m", 1, a, run), ids.once("t", "m", 1, a, run))
        assert first == again == {"request_id": "r1"} and len(runs) == 1  # concurrent resends: one call
        with pytest.raises(HttpError, match="seq_id 1 of m was already used") as refused:
            await ids.once("t", "m", 1, b, run)
        assert refused.value.status == 409
        assert await ids.once("u", "m", 1, b, run) == {"request_id": "r2"}  # another tenant's run
        assert await ids.once("t", "m", None, a, run) == {"request_id": "r3"}  # no seq_id: always runs

        async def broken() -> dict[str, Any]:
            raise RuntimeError("scheduler restarting")

        with pytest.raises(RuntimeError):
            await ids.once("t", "m", 2, a, broken)
        assert await ids.once("t", "m", 2, a, run) == {"request_id": "r4"}  # a failed call's retry runs
        await ids.once("t", "m", 3, a, run)  # per_run=2: seq_id 1 is forgotten
        assert await ids.once("t", "m", 1, b, run) == {"request_id": "r6"}

    asyncio.run(main())


@pytest.mark.slow
def test_a_resent_sdk_call_is_applied_once(serve: Serve, tinker: Any) -> None:
    """What the SDK sends again when an answer is lost: the same body and seq_id, answered with the
    first call's request id (one gradient, one step); the same seq_id with another body: a 409."""
    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    model_id = trainer.model_id
    tokens = list(range(10, 43))
    fb = {
        "model_id": model_id,
        "seq_id": 50,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [32]}},
                }
            ],
        },
    }
    step = {"model_id": model_id, "seq_id": 51, "adam_params": {"learning_rate": 1e-3}}

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"X-API-Key": KEY, "Content-Type": "application/json"}
        return httpx.post(serve.url + path, content=json.dumps(body).encode(), headers=headers, timeout=120)

    sent = [post("/api/v1/forward_backward", fb) for _ in range(2)]
    assert [r.status_code for r in sent] == [200, 200] and sent[0].json() == sent[1].json()
    changed = json.loads(json.dumps(fb).replace("[10, ", "[11, "))  # another first token, the same seq_id
    other = post("/api/v1/forward_backward", changed)
    assert other.status_code == 409 and "seq_id 50" in other.json()["error"]["message"]
    steps = [post("/api/v1/optim_step", step) for _ in range(3)]
    assert len({r.json()["request_id"] for r in steps}) == 1
    _wait(lambda: _version(serve, model_id) == 1, 120, "the step")
    time.sleep(1.0)
    assert _version(serve, model_id) == 1  # one step, not three
    out = trainer.forward_backward([_datum(tinker, 3)], "cross_entropy").result(timeout=120)
    assert out.loss_fn_outputs  # the run goes on from the SDK's own next seq_id


def _version(serve: Serve, model_id: str) -> int:
    with ServiceClient(_scheduler_address(serve), api_key=KEY) as native:
        return int(native.get_job(_job_of(serve, model_id))["adapter"]["version"])
