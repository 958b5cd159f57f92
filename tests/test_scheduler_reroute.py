"""A sample whose engine dies under it goes to another engine at once: a runtime of two engines,
a LoRA job's adapter resident on one of them, a long sample in progress there, and that engine
SIGKILLed. The sample is answered by the other engine (which loads the adapter first), not by the
killed one's restarted process after it comes back; the runtime restarts the killed one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

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

KEY = "reroute-test-key-0123456789abc"
ENGINES = ("engine-0", "engine-1")


def _engine_stats(service: ServiceClient) -> dict[str, dict[str, Any]]:
    stats = service.runtime_status()["stats"]
    return {e: stats[e] for e in ENGINES if e in stats}


def _wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_sample_whose_engine_dies_is_answered_by_the_other_engine(tmp_path: Path) -> None:
    config = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("t", api_key=KEY),),
        engines=tuple(EngineWorkerConfig(engine_id=e) for e in ENGINES),
        learners=(LearnerWorkerConfig(),),
        worker_retry_s=120.0,
        start_timeout_s=240.0,
    )
    prompt = ModelInput.from_ints([1, 2, 3])
    with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=KEY) as service:
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4)
        sampler = trainer.save_weights_and_get_sampling_client()
        assert sampler.sample(prompt, 1, SamplingParams(max_tokens=2)).result(timeout=60).sequences
        stats = _engine_stats(service)
        holder = next(e for e in ENGINES if stats[e]["resident"])  # the engine the adapter was placed on
        other = next(e for e in ENGINES if e != holder)
        requests_before = stats[holder]["requests"]
        other_sequences = stats[other]["sequences"]

        # Long enough to be in progress on the holder when it is killed: 32 rows of 400 tokens.
        n, params = 32, SamplingParams(max_tokens=400, temperature=1.0, seed=7)
        future = sampler.sample(prompt, n, params)
        _wait_for(lambda: _engine_stats(service)[holder]["requests"] > requests_before, 60, "the holder to start")
        pid = next(a.pid for a in runtime.actors() if a.name == holder)
        os.kill(pid, signal.SIGKILL)

        out = future.result(timeout=120)
        assert len(out.sequences) == n
        assert all(len(s.tokens) == params.max_tokens or s.stop_reason != "length" for s in out.sequences)
        # The other engine answered it (the killed one's new process would have counted it).
        assert _engine_stats(service)[other]["sequences"] >= other_sequences + n
        # The killed engine is restarted and serves again.
        _wait_for(lambda: holder in _engine_stats(service), 120, "the killed engine to come back")
        assert any(a.name == holder and a.restarts >= 1 for a in runtime.actors())
