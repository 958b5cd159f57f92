"""A local runtime (scheduler and one engine as real processes, tiny-random model) under many
concurrent clients of two tenants, each a base-model sampler: every call completes, both tenants
progress together, the inference jobs the table lists match what the clients did (at most the
engine's share running, the rest queued; finished when the clients close; a dead client's job
paused, then finished; finished ones pruned), refusals past a small in-flight bound are counted,
and `polytinker jobs list` into a closed pipe exits quietly."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import wait

import pytest

from polytinker.client import ServiceClient
from polytinker.errors import JobNotRunning
from polytinker.scheduler.service import EngineWorkerConfig, LocalRuntime, RuntimeConfig, TenantConfig

MODEL = "tiny-random"
KEYS = {"alice": "alice-load-key-0123456789", "bob": "bob-load-key-0123456789ab"}
CLIENTS_PER_TENANT = 12
CALLS_PER_CLIENT = 6  # submitted at once: more than max_inflight_per_tenant, so some are refused
ENGINE_SHARE = 4  # inference jobs running at once: memory_gb / JobDefaults.engine_mem_gb (0.5)
KEEP_FINISHED = 3
PARAMS = {"max_tokens": 2, "temperature": 1.0}


@pytest.fixture(scope="module")
def runtime() -> Iterator[LocalRuntime]:
    cfg = RuntimeConfig(
        model=MODEL,
        tenants=tuple(TenantConfig(name, api_key=key) for name, key in KEYS.items()),
        # A batch window long enough that a client's six calls are in flight together, whatever the
        # transport's speed: the refusals past max_inflight_per_tenant are then certain, not a race.
        engines=(EngineWorkerConfig(memory_gb=ENGINE_SHARE * 0.5, batch_window_s=0.1),),
        learners=(),
        max_inflight_per_tenant=4,
        inference_idle_s=4.0,
        job_idle_pause_s=3.0,  # an idle-paused inference job is finished 3 s later
        keep_finished_inference=KEEP_FINISHED,
        worker_retry_s=60.0,
        start_timeout_s=240.0,
    )
    with LocalRuntime(cfg) as rt:
        yield rt


def client(runtime: LocalRuntime, tenant: str) -> ServiceClient:
    return ServiceClient(runtime.address, api_key=KEYS[tenant], timeout_s=60.0, job_wait_s=120.0)


def inference_jobs(runtime: LocalRuntime, tenant: str, live: bool = False) -> list[dict]:
    with client(runtime, tenant) as sc:
        return [j for j in sc.list_jobs(include_finished=not live) if j["kind"] == "inference"]


def live_ids(runtime: LocalRuntime, tenant: str) -> set[str]:
    return {j["job_id"] for j in inference_jobs(runtime, tenant, live=True)}


def test_many_samplers_of_two_tenants_all_complete_fairly_and_the_job_table_tells_the_truth(runtime):
    done: dict[str, list[float]] = {t: [] for t in KEYS}  # completion times per tenant
    lock, errors, job_ids = threading.Lock(), [], {t: [] for t in KEYS}
    stop_watch, running_seen = threading.Event(), []

    def one_client(tenant: str, i: int) -> None:
        try:
            with client(runtime, tenant) as sc:
                sampler = sc.create_sampling_client(base_model=MODEL)
                with lock:
                    job_ids[tenant].append(sampler.job_id)
                futures = [sampler.sample([1 + i, 2, 3], 1, PARAMS) for _ in range(CALLS_PER_CLIENT)]
                wait(futures)
                for f in futures:
                    assert 1 <= len(f.result().sequences[0].tokens) <= PARAMS["max_tokens"]
                    with lock:
                        done[tenant].append(time.monotonic())
        except Exception as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(f"{tenant}-{i}: {type(exc).__name__}: {exc}")

    def watch() -> None:  # the job table an operator reads while the load runs, both tenants at once
        db = sqlite3.connect(f"file:{runtime.config.state_path / 'scheduler.sqlite3'}?mode=ro", uri=True)
        query = "SELECT count(*) FROM jobs WHERE kind = 'inference' AND state = 'running'"
        while not stop_watch.wait(0.2):
            running_seen.append(db.execute(query).fetchone()[0])
        db.close()

    threads = [threading.Thread(target=one_client, args=(t, i)) for i in range(CLIENTS_PER_TENANT) for t in KEYS]
    watcher = threading.Thread(target=watch)
    start = time.monotonic()
    for th in [*threads, watcher]:
        th.start()
    for th in threads:
        th.join(timeout=180)
    stop_watch.set()
    watcher.join()
    wall_s = time.monotonic() - start
    assert not errors, errors[:5]
    calls = CLIENTS_PER_TENANT * CALLS_PER_CLIENT
    assert {t: len(v) for t, v in done.items()} == {t: calls for t in KEYS}  # no call lost
    # Fairness: when half of all calls were done, each tenant had done a fair part of them.
    half = sorted(done["alice"] + done["bob"])[calls - 1]
    at_half = {t: sum(1 for x in v if x <= half) for t, v in done.items()}
    assert min(at_half.values()) >= calls // 4, at_half
    # The policy gated the samplers: never more running than the engine's share.
    assert running_seen and max(running_seen) <= ENGINE_SHARE, running_seen

    with client(runtime, "alice") as sc:
        status = sc.runtime_status()
        report = sc.jobs_report(include_finished=True)
    mine = status["tenants"]["alice"]
    assert set(status["tenants"]) == {"alice"}  # a tenant sees its own figures only
    assert mine["completed"] >= calls and mine["in_flight"] == 0
    assert mine["refused"] > 0, mine  # 2+ running samplers x 6 calls at once against a bound of 4
    assert mine["waiting"] > 0, mine  # 12 samplers, 4 places: calls of queued jobs waited
    assert status["totals"]["refused"] >= mine["refused"]
    assert report["load"]["refused"] == mine["refused"]
    print(f"load: {2 * calls} calls of {2 * CLIENTS_PER_TENANT} clients in {wall_s:.1f} s; at half {at_half}; "
          f"alice {mine}; running seen at most {max(running_seen)}")  # fmt: skip
    for tenant in KEYS:
        assert inference_jobs(runtime, tenant, live=True) == []  # every sampler finished at close
    # A finished job's history says what happened: no cancel nobody asked for.
    kept = [j["job_id"] for j in inference_jobs(runtime, "bob") if j["job_id"] in job_ids["bob"]]
    with client(runtime, "bob") as sc:
        events = sc.get_job(kept[0])["events"]
    assert events and "cancel" not in {e["kind"] for e in events} and events[-1]["kind"] == "finish"
    # Finished samplers are pruned to the newest KEEP_FINISHED per tenant (a pass every 5 s).
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(len(inference_jobs(runtime, t)) > KEEP_FINISHED for t in KEYS):
        time.sleep(0.5)
    assert all(len(inference_jobs(runtime, t)) <= KEEP_FINISHED for t in KEYS)


def test_a_dead_clients_sampler_is_paused_then_finished_and_a_busy_one_stays_running(runtime):
    dead = client(runtime, "bob")
    sampler = dead.create_sampling_client(base_model=MODEL)
    sampler.sample([4, 5], 1, PARAMS).result()
    dead.close(keep_jobs=True)  # the process "dies": no finish reaches the scheduler
    with client(runtime, "bob") as busy_client:
        busy = busy_client.create_sampling_client(base_model=MODEL)
        start = time.monotonic()
        while time.monotonic() - start < 6.0:  # past inference_idle_s, calling all the time
            busy.sample([6, 7], 1, PARAMS).result()
            busy.compute_logprobs([6, 7, 8]).result()
        jobs = {j["job_id"]: j for j in inference_jobs(runtime, "bob", live=True)}
        assert jobs[busy.job_id]["state"] == "running" and jobs[busy.job_id]["calls"] > 10
        assert jobs[sampler.job_id]["state"] == "paused", jobs[sampler.job_id]
        assert jobs[sampler.job_id]["reason"].startswith("idle:")
        events = busy_client.get_job(sampler.job_id)["events"]
        assert [e["kind"] for e in events][-1] == "pause" and "cancel" not in {e["kind"] for e in events}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sampler.job_id in live_ids(runtime, "bob"):
            time.sleep(0.5)  # finished job_idle_pause_s later: its client is gone
        gone = busy_client.get_job(sampler.job_id)
        assert gone["job"]["state"] == "done" and gone["job"]["reason"].startswith("idle:"), gone["job"]
        assert [e["kind"] for e in gone["events"]][-2:] == ["pause", "finish"]
        assert busy.job_id in live_ids(runtime, "bob")


def test_a_sampler_whose_job_was_deleted_samples_on_a_new_one(runtime):
    with client(runtime, "alice") as sc:
        sampler = sc.create_sampling_client(base_model=MODEL)
        first = sampler.job_id
        sc.cancel_job(first)
        with pytest.raises(JobNotRunning, match="cancelled"):  # the tenant's cancel holds while the job is listed
            sampler.sample([1, 2], 1, PARAMS).result()
        for _ in range(KEEP_FINISHED):  # newer finished samplers: the cancelled one is pruned
            sc.cancel_job(sc.create_sampling_client(base_model=MODEL).job_id)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and first in {j["job_id"] for j in inference_jobs(runtime, "alice")}:
            time.sleep(0.5)
        assert len(sampler.sample([1, 2], 1, PARAMS).result().sequences) == 1
        assert sampler.job_id != first and sampler.job_id in live_ids(runtime, "alice")


def test_jobs_list_into_a_closed_pipe_exits_quietly(runtime):
    cmd = [sys.executable, "-m", "polytinker.cli", "jobs", "--scheduler", runtime.address]
    cmd += ["--api-key", KEYS["alice"], "list"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line is written (`| head` that exits)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err
    shell = subprocess.run(" ".join(cmd) + " | head -1", shell=True, capture_output=True, text=True, timeout=60)
    assert shell.stdout.startswith("JOB") and shell.stderr == "", shell.stderr
    full = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert full.returncode == 0 and "refused (overloaded)" in full.stdout.splitlines()[-1], full.stdout
