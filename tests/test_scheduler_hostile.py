"""A hostile tenant against a shared runtime (scheduler, engine, learner as real processes;
tiny-random model): every bad value is refused at the scheduler's door naming its field, a
well-behaved tenant working meanwhile loses nothing and gets the numbers it gets alone, a fuzzed
request of every kind gets no unexpected-error answer, and the state reads back after a restart.

The scheduler here is the one of a runtime of this module's own: the fuzz creates jobs, and a
shared runtime's other tests must not find their adapter slots taken."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.client import data
from fixtures.hostile import beside_a_hostile_tenant

from polytinker.client import ServiceClient
from polytinker.engine.types import SamplingParams
from polytinker.errors import ProtocolError, RemoteError, RequestTimeout
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    StateStore,
    TenantConfig,
)
from polytinker.scheduler.service import messages as m
from polytinker.transport import RpcClient

MODEL = "tiny-random"
KEY_A = "good-tenant-key-0123456789"
KEY_B = "hostile-tenant-key-0123456"
VOCAB = 49152  # tiny-random's embedding rows (the SmolLM2 tokenizer's)


def _config(state: Path) -> RuntimeConfig:
    return RuntimeConfig(
        model=MODEL,
        state_dir=str(state),
        tenants=(TenantConfig("good", api_key=KEY_A), TenantConfig("hostile", api_key=KEY_B)),
        engines=(EngineWorkerConfig(adapter_slots=4, batch_window_s=0.05),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        worker_retry_s=120.0,
        start_timeout_s=240.0,
        learner_slice_idle_s=0.5,
    )


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile-state")


@pytest.fixture(scope="module")
def runtime(state: Path) -> Iterator[LocalRuntime]:
    rt = LocalRuntime(_config(state)).start()
    try:
        yield rt
    finally:
        rt.stop()


def _forged(cls: type, base: Any, **fields: Any) -> Any:
    """``base`` with ``fields`` replaced, as a hostile client puts it on the wire (``__post_init__``
    would refuse to build it here: the scheduler's edge must refuse it there)."""
    msg: Any = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(msg, f.name, fields.get(f.name, getattr(base, f.name)))
    return msg


def test_a_hostile_tenant_is_refused_field_by_field_and_the_good_one_loses_nothing(runtime: LocalRuntime) -> None:
    beside_a_hostile_tenant(runtime.address, KEY_A, KEY_B, str(runtime.config.state_path))


# --- fuzz ----------------------------------------------------------------------------------------------

# One field replaced at a time by each of these: the wrong type, the edges of what msgpack carries,
# non-finite floats, empty and oversized strings.
MUTATIONS: tuple[Any, ...] = (
    None,
    {"k": 1},
    [1, [2]],
    2**64 - 1,
    2**63,
    -(2**63),
    -1,
    math.nan,
    math.inf,
    True,
    "",
    "x" * 5000,
    "../../etc/passwd",
    b"\x00\xff",
)


def _requests(job_id: str, ckpt: str, model_path: str) -> list[tuple[str, Any]]:
    """A valid request of every client kind, on the good tenant's job."""
    d = tuple(data(5, n=1))
    return [
        ("sched.create_job", m.CreateJob(KEY_A, "lora_rl", MODEL, rank=4)),
        ("sched.job_query", m.JobQuery(KEY_A, job_id)),
        ("sched.job_action", m.JobAction(KEY_A, job_id, "resume")),
        ("sched.list_jobs", m.ListJobs(KEY_A)),
        ("sched.forward_backward", m.ForwardBackward(KEY_A, job_id, d)),
        ("sched.forward", m.Forward(KEY_A, job_id, d)),
        ("sched.optim_step", m.OptimStep(KEY_A, job_id)),
        ("sched.save_state", m.SaveState(KEY_A, job_id, "fuzz")),
        ("sched.load_state", m.LoadState(KEY_A, job_id, ckpt)),
        ("sched.save_weights", m.SaveWeights(KEY_A, job_id)),
        ("sched.sample", m.Sample(KEY_A, model_path, MODEL, (1, 2, 3), 1, SamplingParams(max_tokens=2))),
        ("sched.compute_logprobs", m.ComputeLogprobs(KEY_A, model_path, MODEL, ((1, 2, 3),))),
        ("sched.delete_checkpoint", m.DeleteCheckpoint(KEY_A, job_id, "nope")),
        ("sched.publish_checkpoint", m.PublishCheckpoint(KEY_A, job_id, "nope", True)),
        ("sched.copy_checkpoint", m.CopyCheckpoint(KEY_A, ckpt)),
        ("sched.weights_info", m.WeightsInfo(KEY_A, model_path)),
        ("sched.set_checkpoint_ttl", m.SetCheckpointTtl(KEY_A, job_id, "nope", 60.0)),
        ("sched.export_weights", m.ExportWeights(KEY_A, model_path)),
        ("sched.audit_log", m.AuditLog(KEY_A)),
        ("sched.usage", m.Usage(KEY_A, 0.0, 3600.0)),
        ("sched.storage_usage", m.StorageUsage(KEY_A)),
        ("sched.runtime_status", m.RuntimeStatus(KEY_A)),
    ]


def _outcome(rpc: RpcClient, kind: str, msg: Any) -> str:
    """ "ok" for an answer or a caller's-mistake refusal, else what went wrong."""
    try:
        rpc.call(kind, msg, timeout_s=120)
    except ProtocolError:
        return "ok"  # refused at the edge, naming the field
    except RemoteError as exc:
        if exc.code == "handler" or "Traceback" in str(exc):
            return f"unexpected error: {exc}"
    except RequestTimeout:
        return "no answer"
    return "ok"


def test_fuzzed_requests_of_every_kind_get_no_unexpected_error_and_the_state_reads_back(
    runtime: LocalRuntime, state: Path
) -> None:
    with ServiceClient(runtime.address, api_key=KEY_A) as good:
        trainer = good.create_lora_training_client(MODEL, rank=4, seed=0)
        trainer.forward_backward(data(1, n=2), "cross_entropy").result()
        trainer.optim_step().result()
        ckpt = str(trainer.save_state("c1").result())
        model_path = str(trainer.save_weights_and_get_sampling_client("s1").model_path)
        job_id = trainer.job_id
        before = {j["job_id"] for j in good.list_jobs()}
    failures: list[str] = []
    sent = 0
    with RpcClient(runtime.address) as rpc:
        for kind, base in _requests(job_id, ckpt, model_path):
            for f in dataclasses.fields(base):
                for value in MUTATIONS:
                    outcome = _outcome(rpc, kind, _forged(type(base), base, **{f.name: value}))
                    sent += 1
                    if outcome != "ok":
                        failures.append(f"{kind}.{f.name}={value!r:.40}: {outcome}")
    assert sent > 1000
    assert not failures, "\n".join(failures[:20])
    # Nothing a request carried made the state unreadable: the job table reads whole, nothing was
    # quarantined, and the good tenant's jobs are all there.
    with ServiceClient(runtime.address, api_key=KEY_A) as good:
        assert before <= {j["job_id"] for j in good.list_jobs()}
    store = StateStore(state / "scheduler.sqlite3")
    try:
        assert store.jobs() and not store.quarantined()
    finally:
        store.close()


def test_an_unreadable_job_row_is_quarantined_and_the_rest_are_served(tmp_path: Path) -> None:
    """Defence in depth: a row no request can write any more (an older version's, or one edited
    by hand) is moved aside at start-up instead of failing the scheduler for every tenant."""
    from polytinker.scheduler.service.state_rows import JobRow
    from polytinker.scheduler.types import JobKind, JobState

    path = tmp_path / "scheduler.sqlite3"
    store = StateStore(path)
    lora = {"rank": 4, "alpha": 4, "seed": 0, "target_modules": ["q_proj"]}
    for job_id in ("good-1", "bad-1", "good-2"):
        row = JobRow(job_id, "t", JobKind.LORA_RL, MODEL, "a", lora, JobState.PAUSED, 0, 0, "", 1.0, 1.0)
        store.insert_job(row)
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET steps = ? WHERE job_id = 'bad-1'", (math.inf,))
    store = StateStore(path)
    try:
        assert [r.job_id for r in store.jobs()] == ["good-1", "good-2"]
        (q,) = store.quarantined()
        assert q["job_id"] == "bad-1" and "OverflowError" in q["reason"]
        assert [r.job_id for r in store.jobs("t")] == ["good-1", "good-2"]  # and it stays aside
    finally:
        store.close()


def test_a_restarted_scheduler_comes_up_with_the_good_tenants_jobs(runtime: LocalRuntime) -> None:
    """Last in this module: after the hostile traffic above, the scheduler killed and restarted on
    the same state serves the good tenant's jobs, versions intact."""
    assert runtime.scheduler is not None
    with ServiceClient(runtime.address, api_key=KEY_A) as good:
        before = {j["job_id"]: j["state"] for j in good.list_jobs() if j["kind"] == "lora_rl"}
        versions = {job: good.get_job(job)["adapter"]["version"] for job in before}
        old_pid = runtime.scheduler.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while not (runtime.scheduler.alive and runtime.scheduler.pid != old_pid):
            assert time.monotonic() < deadline, "the scheduler was not restarted"
            time.sleep(0.1)
        after = {j["job_id"]: j["state"] for j in good.list_jobs() if j["kind"] == "lora_rl"}  # rides out the restart
        assert after == before
        assert {job: good.get_job(job)["adapter"]["version"] for job in after} == versions
