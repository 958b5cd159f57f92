"""One local runtime (scheduler, one engine, one learner as real processes; tiny-random model) shared
by the client and service tests of a session: starting one costs the most of these tests' time.
Two tenants, alice and bob. Imported by tests; it holds no tests itself."""

from __future__ import annotations

import atexit
import functools
import random

from polytinker.client import ServiceClient
from polytinker.engine.types import Datum
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)

MODEL = "tiny-random"
KEY_ALICE = "alice-api-key-0123456789"
KEY_BOB = "bob-api-key-0123456789ab"


@functools.cache
def shared_runtime() -> LocalRuntime:
    cfg = RuntimeConfig(
        model=MODEL,
        tenants=(TenantConfig("alice", api_key=KEY_ALICE), TenantConfig("bob", api_key=KEY_BOB)),
        engines=(EngineWorkerConfig(adapter_slots=4, batch_window_s=0.05),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        worker_retry_s=120.0,
        start_timeout_s=240.0,
        learner_slice_idle_s=0.5,
    )
    runtime = LocalRuntime(cfg).start()
    atexit.register(runtime.stop)
    return runtime


def client(key: str, **kw: float) -> ServiceClient:
    return ServiceClient(shared_runtime().address, api_key=key, **kw)


def data(seed: int, n: int = 4, length: int = 12) -> list[Datum]:
    """Random token sequences with the first three targets masked out (a prompt)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(1, 4000) for _ in range(length + 1)]
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 3 + [1.0] * (length - 3)))
    return out
