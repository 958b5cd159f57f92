"""Work goes to the workers that are there: a runtime declares two engines, one of which never
comes (a remote engine not started yet, ``local = false``) and which comes first in the
policy's order; a new job, its adapter's samples and the base model's samples go to the engine
that registered, where they used to wait for the absent one until ``worker_retry_s`` ran out."""

from __future__ import annotations

from pathlib import Path

from fixtures.client import MODEL

from polytinker.client import ServiceClient
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)
from polytinker.types import ModelInput, SamplingParams

KEY = "presence-test-key-0123456789"


def test_jobs_and_samples_go_to_the_engine_that_is_there_not_to_a_declared_absent_one(tmp_path: Path) -> None:
    config = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("t", api_key=KEY),),
        # "a-absent" sorts first: without presence, the policy places the first job on it.
        engines=(EngineWorkerConfig(engine_id="a-absent", local=False), EngineWorkerConfig(engine_id="b-here")),
        learners=(LearnerWorkerConfig(),),
        worker_retry_s=20.0,  # a call sent to the absent engine fails after this long: the test with it
        start_timeout_s=240.0,
    )
    prompt, params = ModelInput.from_ints([1, 2, 3]), SamplingParams(max_tokens=2, temperature=0.0)
    with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=KEY) as service:
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4)
        sampler = trainer.save_weights_and_get_sampling_client()
        assert len(sampler.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 2
        base = service.create_sampling_client(base_model=MODEL)
        for _ in range(2):  # round-robin over the base model's engines: only the one there
            assert len(base.sample(prompt, 1, params).result(timeout=60).sequences) == 1
        engines = {w["worker_id"]: w["alive"] for w in service.runtime_status()["workers"] if w["role"] == "engine"}
        assert engines == {"b-here": True}  # "a-absent" never registered
