"""An engine the runtime's config does not declare joins at run time ([cluster] join_undeclared):
``polytinker worker`` with a config of its own that declares it registers with a running
runtime, and a job that waited for an adapter slot is placed on it and samples there; stopped
(SIGTERM), it leaves the runtime at once and the job is queued again. A real
runtime (scheduler, engine and learner processes), a real worker process, the tiny-random model."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from fixtures.busy import Busy
from fixtures.client import MODEL

from polytinker.client import ServiceClient
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)
from polytinker.scheduler.service.cluster import ClusterConfig
from polytinker.types import ModelInput, SamplingParams

KEY = "join-test-key-0123456789"
JOINER_TOML = """\
model = "{model}"

[[engines]]
engine_id = "engine-joined"
adapter_slots = 2
memory_gb = 8.0
"""


def wait_for(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_job_waiting_for_a_slot_runs_on_an_engine_that_joins(tmp_path: Path) -> None:
    config = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("t", api_key=KEY),),
        engines=(EngineWorkerConfig(adapter_slots=1),),  # one job's adapter at a time
        learners=(LearnerWorkerConfig(),),
        # A worker that stops on purpose says so and is forgotten at once: not after its heartbeats
        # have been missing for worker_silence_s and then joined_gone_s (600 s).
        cluster=ClusterConfig(join_undeclared=True),
        worker_silence_s=15.0,
        slot_reclaim_idle_s=600.0,  # the first job keeps its slot however long it idles
        start_timeout_s=240.0,
    )
    prompt, params = ModelInput.from_ints([1, 2, 3]), SamplingParams(max_tokens=2, temperature=0.0)
    joiner_toml = tmp_path / "joiner.toml"
    joiner_toml.write_text(JOINER_TOML.format(model=MODEL))
    with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=KEY) as service:
        first = service.create_lora_training_client(base_model=MODEL, rank=4)
        assert first.save_weights_and_get_sampling_client().sample(prompt, 1, params).result(timeout=60).sequences
        second = service.create_lora_training_client(base_model=MODEL, rank=4)
        assert service.get_job(second.job_id)["job"]["state"] == "queued"  # engine-0's one slot is taken

        command = [sys.executable, "-m", "polytinker.cli", "worker", "--config", str(joiner_toml)]
        command += ["--id", "engine-joined", "--scheduler", runtime.address, "--token", runtime.config.worker_token]
        command += ["--state-dir", runtime.config.state_dir]
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            with Busy():  # the join on a machine whose every core is busy
                wait_for(lambda: service.get_job(second.job_id)["job"]["state"] == "running", 180, "the job to run")
                sampler = second.save_weights_and_get_sampling_client()
                assert len(sampler.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 2
            status = service.runtime_status()
            workers = {w["worker_id"]: (w["role"], w["alive"]) for w in status["workers"]}
            assert workers["engine-joined"] == ("engine", True)
            # Started with the runtime's state_dir (--state-dir), each worker reads the runtime's state-id.
            assert all(w["shares_state"] for w in status["workers"]), status["workers"]
            assert status["stats"]["engine-joined"]["sequences"] >= 1  # the second job's sample ran there
        finally:
            worker.terminate()
            output, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, output
        # It said it leaves as it stopped: forgotten already, and the second job queued again.
        assert "engine-joined" not in {w["worker_id"] for w in service.runtime_status()["workers"]}
        told = [(e["kind"], e["reason"]) for e in service.get_job(second.job_id)["events"]]
        assert ("requeue", "engine-joined left the runtime; queued again at version 0") in told
        assert service.get_job(second.job_id)["job"]["state"] == "queued"  # engine-0's slot is still taken
        service.finish_job(first.job_id)  # frees it: the second job goes on on the engine that is left
        wait_for(lambda: service.get_job(second.job_id)["job"]["state"] == "running", 60, "the job to run again")
        sampler = second.save_weights_and_get_sampling_client()
        assert len(sampler.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 2
