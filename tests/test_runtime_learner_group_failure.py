"""A local runtime's learner group of two processes loses its follower: the learner actor fails as
a whole, its supervisor starts it anew, and its jobs' training goes on with no step lost or made
twice (the calls in flight are resent to the new incarnation). A real runtime: the scheduler, an
engine and a learner group in their own processes, the tiny-random model."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
from fixtures.busy import Busy
from fixtures.client import data

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import SamplingParams
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)

pytestmark = pytest.mark.timeout(420)
ADAM = AdamParams(learning_rate=1e-2)
KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"


def learner_actor(service: ServiceClient) -> dict[str, Any]:
    (actor,) = [a for a in service.runtime_status()["actors"] if a["name"] == "learner-0"]
    return actor


def follower_pid(learner_pid: int) -> int:
    """Rank 1 of the group: the learner's one child that is an actor process."""
    (child,) = [c for c in psutil.Process(learner_pid).children() if "polytinker.actors._child" in c.cmdline()]
    return child.pid


def test_a_group_that_loses_a_rank_is_restarted_whole_and_training_goes_on(tmp_path) -> None:
    """Two tenants train on the group, every core busy; the follower dies under both tenants'
    forward_backward calls: each call is answered by the restarted group, each step once."""
    cfg = RuntimeConfig(
        model=TINY_RANDOM,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("a", api_key=KEY_A), TenantConfig("b", api_key=KEY_B)),
        engines=(EngineWorkerConfig(adapter_slots=2),),
        learners=(LearnerWorkerConfig(world_size=2, micro_batch_size=4),),
        start_timeout_s=240.0,
        worker_retry_s=180.0,
    )
    with (
        LocalRuntime(cfg) as runtime,
        ServiceClient(runtime.address, api_key=KEY_A) as tenant_a,
        ServiceClient(runtime.address, api_key=KEY_B) as tenant_b,
    ):
        trainers = [t.create_lora_training_client(TINY_RANDOM, rank=4) for t in (tenant_a, tenant_b)]
        for i, trainer in enumerate(trainers):
            trainer.forward_backward(data(1 + i)).result()
            assert trainer.optim_step(ADAM).result().version == 1
        first = learner_actor(tenant_a)
        rank1 = follower_pid(first["pid"])

        with Busy():
            # The follower stops (busy, not dead) while the calls wait for it in a collective, then
            # dies under them: the learner answers WorkerFailed and exits; the scheduler resends
            # each call to the restarted group.
            os.kill(rank1, signal.SIGSTOP)
            futures = [trainer.forward_backward(data(3 + i)) for i, trainer in enumerate(trainers)]
            time.sleep(2.0)
            os.kill(rank1, signal.SIGKILL)
            assert all(f.result(timeout=300).loss > 0 for f in futures)
            for trainer in trainers:  # the step's one call, once: no gradient lost or applied twice
                assert trainer.optim_step(ADAM).result(timeout=300).version == 2

        after = learner_actor(tenant_a)
        assert after["restarts"] == 1 and after["pid"] != first["pid"] and after["alive"]
        assert after["last_exit_code"] == 1  # it failed itself (a SIGKILL of its own would read -9)
        (traceback,) = (tmp_path / "state").rglob(f"learner-0.{first['pid']}.traceback")
        assert "WorkerFailed: learner group rank learner-0-rank1 exited with code -9" in traceback.read_text()
        # The adapters came back from their checkpoints at version 1 and went on from there: each
        # job's events say so, to its own tenant; and they serve.
        for service, trainer in zip((tenant_a, tenant_b), trainers, strict=True):
            restores = [e["reason"] for e in service.get_job(trainer.job_id)["events"] if e["kind"] == "restore"]
            assert restores == [
                "learner-0 restarted (a new process) and loaded it at version 1, from that version's checkpoint"
            ]
        params = SamplingParams(max_tokens=4, seed=1)
        for trainer in trainers:
            sampler = trainer.save_weights_and_get_sampling_client()
            assert sampler.sample([3, 4, 5], num_samples=1, sampling_params=params).result(timeout=120).sequences
