"""What the tests of the scheduler service's parts share: two tenants' API keys and a
``RuntimeConfig`` for them on a state directory of the test's own (``config``), the base the
config, state, job and RPC tests build on."""

from __future__ import annotations

from pathlib import Path

from polytinker.scheduler.service import RuntimeConfig, TenantConfig

KEY_A = "alice-key-0123456789"
KEY_B = "bob-key-0123456789ab"


def config(tmp_path: Path, **kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model": "tiny-random",
        "state_dir": str(tmp_path),
        "tenants": (TenantConfig("alice", api_key=KEY_A), TenantConfig("bob", api_key=KEY_B)),
        "worker_token": "worker-token-0123456789",
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]
