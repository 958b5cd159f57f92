"""A resent create_job makes one job (request_keys.py): through the scheduler's handlers, across a
scheduler restart, and through a real client whose call is resent when the scheduler dies after
committing the job and before answering."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from polytinker.client import ServiceClient
from polytinker.errors import ConfigError, RequestKeyReused
from polytinker.gateway.app import Gateway
from polytinker.gateway.errors import classify
from polytinker.gateway.tinker_names import run_request_key
from polytinker.scheduler.service import RuntimeConfig, SchedulerService, TenantConfig
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.http_config import HttpConfig
from polytinker.transport import RpcServer

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"


def _config(tmp_path: Path) -> RuntimeConfig:
    tenants = (TenantConfig("alice", api_key=KEY_A), TenantConfig("bob", api_key=KEY_B))
    return RuntimeConfig(model="tiny-random", state_dir=str(tmp_path), tenants=tenants, worker_token="w" * 24)


def _create(svc: SchedulerService, api_key: str, request_key: str, **kw: Any) -> dict[str, Any]:
    msg = m.CreateJob(api_key, "lora_rl", "tiny-random", rank=4, request_key=request_key, **kw)
    job: dict[str, Any] = svc.handlers()["sched.create_job"](msg).job
    return job


def _jobs(svc: SchedulerService, api_key: str) -> list[str]:
    return [j["job_id"] for j in svc.handlers()["sched.list_jobs"](m.ListJobs(api_key)).jobs]


def test_a_repeated_key_is_answered_with_its_first_job_per_tenant_and_after_a_restart(tmp_path: Path) -> None:
    svc = SchedulerService(_config(tmp_path), "w" * 24)
    try:
        first = _create(svc, KEY_A, "call-1")
        assert _create(svc, KEY_A, "call-1") == first  # the same job, as it was
        assert _jobs(svc, KEY_A) == [first["job_id"]]
        bobs = _create(svc, KEY_B, "call-1")  # another tenant's same key: its own job
        assert bobs["job_id"] != first["job_id"] and _jobs(svc, KEY_B) == [bobs["job_id"]]
        with pytest.raises(RequestKeyReused, match="request_key 'call-1' was already used") as refused:
            _create(svc, KEY_A, "call-1", priority=5)  # the same key, another call: refused, no job made
        assert isinstance(refused.value, ConfigError)
        assert len({_create(svc, KEY_A, "")["job_id"] for _ in range(2)}) == 2  # no key (an old client): two jobs
        assert len(_jobs(svc, KEY_A)) == 3
    finally:
        svc.stop()
    again = SchedulerService(_config(tmp_path), "w" * 24).start("")  # restarted: it knows the key from its state
    try:
        resent = _create(again, KEY_A, "call-1")
        assert resent["job_id"] == first["job_id"] and len(_jobs(again, KEY_A)) == 3
        assert again.store.adapter(f"alice/{first['job_id']}/default") is not None
    finally:
        again.stop()


def test_the_gateway_keys_a_new_run_by_its_session_and_model_seq_id() -> None:
    first = run_request_key("session-1", 0)  # the SDK numbers a session's runs from 0
    assert first == run_request_key("session-1", 0)  # a resend of the call: the same key
    assert len({first, run_request_key("session-1", 1), run_request_key("session-2", 0)}) == 3
    assert run_request_key("session-1", None) != run_request_key("session-1", None)  # no number: one per request
    assert m.CreateJob(KEY_A, "lora_rl", "tiny-random", request_key=first).request_key == first  # passes the door
    status, body = classify(RequestKeyReused("request_key 'k' was already used for job j with other fields"))
    assert status == 409 and body["error"]["code"] == "request_key_reused" and "request_key" in body["error"]["message"]


@pytest.mark.parametrize("key", ["x" * 65, "a/b", "ké", "a b"])
def test_a_request_key_is_checked_at_the_door(key: str) -> None:
    with pytest.raises(ConfigError, match="request_key: at most 64 ASCII letters"):
        m.CreateJob(KEY_A, "lora_rl", "tiny-random", request_key=key)


def test_a_create_job_resent_across_a_scheduler_death_makes_one_job(tmp_path: Path) -> None:
    """The first scheduler commits the job and dies before answering (its server stops with the call
    in flight); the client sees the connection go, resends the call to the restarted scheduler on
    the same address, and gets the job the first one made: the tenant has one job, not two."""
    address = f"ipc://{tmp_path}/sched.sock"
    cfg = _config(tmp_path / "state")
    first = SchedulerService(cfg, "w" * 24)
    committed, answer = threading.Event(), threading.Event()
    handlers = first.handlers()
    create_job = handlers["sched.create_job"]

    def dies_before_answering(msg: m.CreateJob) -> Any:
        reply = create_job(msg)
        committed.set()
        answer.wait(30)  # never sent: the server stops meanwhile
        return reply

    server = RpcServer(address, {**handlers, "sched.create_job": dies_before_answering}).start()
    made: list[Any] = []
    second = None
    try:
        with ServiceClient(address=address, api_key=KEY_A) as service:
            create = threading.Thread(target=lambda: made.append(service.create_lora_training_client("tiny-random", 4)))
            create.start()
            assert committed.wait(60)
            server.stop()
            answer.set()
            first.stop()
            second = SchedulerService(cfg, "w" * 24).start(address)
            create.join(120)
            assert not create.is_alive() and len(made) == 1
            assert [j["job_id"] for j in service.list_jobs()] == [made[0].job_id]  # one job: the first scheduler's
    finally:
        if second is not None:
            second.stop()


def test_a_resent_create_model_gets_its_runs_one_job(tmp_path: Path) -> None:
    """Through the gateway: the SDK sends create_model again when it got no answer (the same
    session, model_seq_id and body); the run's job is made once. The next model_seq_id is another
    run, and the same one with another body is refused, naming request_key."""
    svc = SchedulerService(_config(tmp_path / "state"), "w" * 24).start("tcp://127.0.0.1:0")
    assert svc.server is not None
    http = HttpConfig(address="127.0.0.1:0")
    try:
        with Gateway(svc.server.address, tmp_path / "gateway", http, base_models=("tiny-random",)) as gw:

            def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
                headers = {"X-API-Key": KEY_A}
                out: dict[str, Any] = httpx.post(gw.url + path, json=body, headers=headers, timeout=30).json()
                deadline = time.monotonic() + 30
                while "request_id" in out and out.get("type") != "create_session":
                    out = httpx.post(gw.url + "/api/v1/retrieve_future", json=out, headers=headers, timeout=60).json()
                    if out.get("type") != "try_again":
                        break
                    assert time.monotonic() < deadline, out
                return out

            session = call("/api/v1/create_session", {})["session_id"]
            body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-random", "lora_config": {"rank": 4}}
            first, resent = call("/api/v1/create_model", body), call("/api/v1/create_model", body)
            assert first["model_id"] == resent["model_id"] == f"{session}:train:0"
            assert call("/api/v1/create_model", {**body, "model_seq_id": 1})["model_id"] == f"{session}:train:1"
            clash = call("/api/v1/create_model", {**body, "lora_config": {"rank": 8}})
            assert clash["category"] == "user" and "request_key" in str(clash["error"]), clash
        with ServiceClient(address=svc.server.address, api_key=KEY_A) as native:
            assert len(native.list_jobs()) == 2  # one job per run: the resend made none
    finally:
        svc.stop()
