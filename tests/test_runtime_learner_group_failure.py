"""A local runtime's learner group of two processes loses its follower: the learner actor fails as
a whole, its supervisor starts it anew, and the job's training goes on with no step lost or made
twice (the call in flight is resent to the new incarnation). A real runtime: the scheduler, an
engine and a learner group in their own processes, the tiny-random model."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
from fixtures.client import data

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import SamplingParams
from polytinker.scheduler.service.config import EngineWorkerConfig, LearnerWorkerConfig, RuntimeConfig

pytestmark = pytest.mark.timeout(420)
ADAM = AdamParams(learning_rate=1e-2)


def learner_actor(service: ServiceClient) -> dict[str, Any]:
    (actor,) = [a for a in service.runtime_status()["actors"] if a["name"] == "learner-0"]
    return actor


def follower_pid(learner_pid: int) -> int:
    """Rank 1 of the group: the learner's one child that is an actor process."""
    (child,) = [c for c in psutil.Process(learner_pid).children() if "polytinker.actors._child" in c.cmdline()]
    return child.pid


def test_a_group_that_loses_a_rank_is_restarted_whole_and_training_goes_on(tmp_path) -> None:
    cfg = RuntimeConfig(
        model=TINY_RANDOM,
        state_dir=str(tmp_path / "state"),
        engines=(EngineWorkerConfig(adapter_slots=2),),
        learners=(LearnerWorkerConfig(world_size=2, micro_batch_size=4),),
        start_timeout_s=240.0,
        worker_retry_s=180.0,
    )
    with ServiceClient(runtime_config=cfg) as service:
        trainer = service.create_lora_training_client(TINY_RANDOM, rank=4, agent="a")
        trainer.forward_backward(data(1)).result()
        assert trainer.optim_step(ADAM).result().version == 1
        first = learner_actor(service)
        rank1 = follower_pid(first["pid"])

        # The follower stops (busy, not dead) while the step's call waits for it in a collective,
        # then dies under that call: the learner answers WorkerFailed and exits; the scheduler
        # resends the call to the restarted group.
        os.kill(rank1, signal.SIGSTOP)
        future = trainer.forward_backward(data(2))
        time.sleep(2.0)
        os.kill(rank1, signal.SIGKILL)
        assert future.result(timeout=300).loss > 0
        assert trainer.optim_step(ADAM).result(timeout=300).version == 2  # the step's one call, once

        after = learner_actor(service)
        assert after["restarts"] == 1 and after["pid"] != first["pid"] and after["alive"]
        assert after["last_exit_code"] == 1  # it failed itself (a SIGKILL of its own would read -9)
        (traceback,) = (tmp_path / "state").rglob(f"learner-0.{first['pid']}.traceback")
        assert "WorkerFailed: learner group rank learner-0-rank1 exited with code -9" in traceback.read_text()
        # The adapter came back from its checkpoint at version 1 and went on from there: it serves.
        sampler = trainer.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=4, seed=1)
        assert sampler.sample([3, 4, 5], num_samples=1, sampling_params=params).result(timeout=120).sequences
