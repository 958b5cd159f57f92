"""The scheduler service's ``RuntimeConfig`` and its worker tables: validation errors that say
how to fix them, reading a runtime TOML file and the round trip through ``to_dict``/``from_dict``,
and an engine's vllm settings reaching the vLLM arguments it starts with."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytinker.errors import ConfigError
from polytinker.scheduler.service import EngineWorkerConfig, LearnerWorkerConfig, RuntimeConfig, TenantConfig


def test_config_validation_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="unique"):
        RuntimeConfig(engines=(EngineWorkerConfig("x"),), learners=(LearnerWorkerConfig("x"),))
    with pytest.raises(ConfigError, match="at least 16"):
        TenantConfig("t", api_key="short")
    with pytest.raises(ConfigError, match="together"):
        RuntimeConfig(curve_secret_file="k.key_secret")
    with pytest.raises(ConfigError, match="engine_id"):
        EngineWorkerConfig("bad id!")
    with pytest.raises(ConfigError, match="handler_threads"):
        RuntimeConfig(handler_threads=100, max_inflight_samples=90, max_inflight_train=10)


def test_config_from_toml_and_round_trip(tmp_path: Path) -> None:
    toml = tmp_path / "runtime.toml"
    toml.write_text(
        'model = "tiny-random"\nmax_inflight_samples = 7\n'
        '[[engines]]\nengine_id = "e1"\nadapter_slots = 2\n'
        '[[learners]]\nlearner_id = "l1"\n'
        '[[tenants]]\nname = "alice"\napi_key = "alice-key-0123456789"\n'
        "[jobs]\nsteps = 5\n"
    )
    cfg = RuntimeConfig.from_toml(toml)
    assert cfg.engines[0].adapter_slots == 2 and cfg.learners[0].learner_id == "l1" and cfg.jobs.steps == 5
    assert RuntimeConfig.from_dict(cfg.to_dict()) == cfg
    toml.write_text('model = "m"\nunknown_key = 1\n')
    with pytest.raises(ConfigError, match="unknown_key"):
        RuntimeConfig.from_toml(toml)


def test_vllm_settings_reach_the_engine_s_vllm_arguments() -> None:
    engine = EngineWorkerConfig(
        backend="vllm",
        adapter_slots=6,
        vllm={"gpu_memory_utilization": 0.45, "kv_cache_gib": 0, "tensor_parallel_size": 2, "dtype": "float16"},
    )
    kwargs = engine.vllm_config("tiny-random").llm_kwargs(Path("/models/tiny"))
    assert kwargs["max_loras"] == 6 and kwargs["max_lora_rank"] == 32 and kwargs["dtype"] == "float16"
    assert kwargs["gpu_memory_utilization"] == 0.45 and kwargs["tensor_parallel_size"] == 2
    assert "kv_cache_memory_bytes" not in kwargs  # sized from the memory share instead
    raw = RuntimeConfig(engines=(engine,)).to_dict()
    assert RuntimeConfig.from_dict(raw).engines[0] == engine  # and survive the trip to a worker process
