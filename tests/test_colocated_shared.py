"""The colocated worker shared as a runtime is shared: a good tenant's training and sampling beside a
hostile tenant's bad inputs, every core busy, lose nothing and give the numbers they give alone;
and when the one process that serves both roles is killed, the good tenant's job comes back from
its checkpoint and goes on, no step lost or made twice. A real runtime (tiny-random): the scheduler
and one colocated worker process, registered as the engine and as the learner."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from fixtures.busy import Busy
from fixtures.client import data
from fixtures.hostile import MODEL, beside_a_hostile_tenant

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import SamplingParams
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)

pytestmark = pytest.mark.timeout(480)
KEY_GOOD = "colocated-good-key-0123456789"
KEY_BAD = "colocated-hostile-key-0123456"
ADAM = AdamParams(learning_rate=1e-2)


def _worker(service: ServiceClient) -> dict[str, Any]:
    """The colocated worker's actor: one process behind both worker ids."""
    actors = {a["name"]: a for a in service.runtime_status()["actors"]}
    assert actors["engine-0"]["pid"] == actors["learner-0"]["pid"]
    return actors["learner-0"]


def test_a_hostile_neighbour_and_a_killed_worker_cost_the_good_tenant_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = RuntimeConfig(
        model=MODEL,
        state_dir=str(state),
        colocate=True,
        tenants=(TenantConfig("good", api_key=KEY_GOOD), TenantConfig("hostile", api_key=KEY_BAD)),
        engines=(EngineWorkerConfig(adapter_slots=4, batch_window_s=0.05),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        start_timeout_s=240.0,
        worker_retry_s=180.0,
        learner_slice_idle_s=0.5,
    )
    batch = data(3, n=4)
    with LocalRuntime(cfg) as runtime:
        beside_a_hostile_tenant(runtime.address, KEY_GOOD, KEY_BAD, str(state), during=Busy)

        with ServiceClient(runtime.address, api_key=KEY_GOOD) as good:
            trainer = good.create_lora_training_client(MODEL, rank=4, seed=0)
            trainer.forward_backward(batch, "cross_entropy").result()
            assert trainer.optim_step(ADAM).result().version == 1
            before = trainer.forward(batch).result()
            first = _worker(good)
            os.kill(first["pid"], signal.SIGKILL)
            # The next calls wait for the restarted worker, which loads the job's adapter from the
            # checkpoint of version 1: the same weights, and the next step is version 2.
            after = trainer.forward(batch).result(timeout=300)
            pairs = [pair for x, y in zip(before, after, strict=True) for pair in zip(x, y, strict=True)]
            assert all(abs(a - b) <= 1e-5 for a, b in pairs)
            trainer.forward_backward(batch, "cross_entropy").result(timeout=300)
            assert trainer.optim_step(ADAM).result(timeout=300).version == 2
            sampler = trainer.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=4, seed=1)
            assert sampler.sample([3, 4, 5], num_samples=2, sampling_params=params).result(timeout=120).sequences
            now = _worker(good)
            assert now["restarts"] == 1 and now["pid"] != first["pid"] and now["alive"]
