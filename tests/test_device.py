"""Device and dtype of learner groups and hf engines: names checked where a config is read, the machine checked
where a worker starts (CUDA asked for on a machine without it is a ConfigError, before any model
loads). The CUDA side itself is in tests/test_gpu_learner.py, run by scripts/gpu_check.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polytinker import cli
from polytinker.engine.device import rank_device, resolve_device, resolve_dtype
from polytinker.errors import ConfigError
from polytinker.scheduler.service import LearnerWorkerConfig, LocalRuntime, RuntimeConfig

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_is_the_gpu_where_there_is_one_and_float32_on_the_cpu() -> None:
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("auto", torch.device("cuda:0")) == "bfloat16"
    assert resolve_dtype("float32", torch.device("cuda:0")) == "float32"
    assert resolve_device("cpu", world_size=4) == torch.device("cpu")


def test_a_group_on_cuda_n_takes_the_next_devices_one_per_rank() -> None:
    assert [rank_device(torch.device("cuda:2"), r) for r in range(3)] == [torch.device(f"cuda:{i}") for i in (2, 3, 4)]
    assert rank_device(torch.device("cuda"), 1) == torch.device("cuda:1")
    assert rank_device(torch.device("cpu"), 3) == torch.device("cpu")


@pytest.mark.parametrize(("field", "value"), [("device", "gpu"), ("device", "cuda:x"), ("dtype", "float16")])
def test_a_misspelt_device_or_dtype_names_the_field(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"LearnerWorkerConfig.{field} must be"):
        LearnerWorkerConfig(**{field: value})  # type: ignore[arg-type]


def test_a_config_read_from_toml_carries_them() -> None:
    config = RuntimeConfig.from_dict(
        {"learners": [{"learner_id": "gpu-learners", "world_size": 2, "device": "cuda:2", "dtype": "bfloat16"}]}
    )
    assert (config.learners[0].device, config.learners[0].dtype) == ("cuda:2", "bfloat16")


@no_cuda
def test_cuda_where_there_is_none_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match="sees no CUDA device on this machine; use device = 'cpu'"):
        resolve_device("cuda:1")


@no_cuda
def test_a_local_runtime_asking_for_cuda_fails_at_start_before_any_worker(tmp_path: Path) -> None:
    config = RuntimeConfig(state_dir=str(tmp_path), learners=(LearnerWorkerConfig(device="cuda"),))
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        LocalRuntime(config).start()
    assert not (tmp_path / "scheduler.sqlite3").exists()  # nothing was started


@no_cuda
def test_polytinker_worker_device_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "runtime.toml"
    config.write_text('model = "tiny-random"\n[[learners]]\nlearner_id = "learner-0"\nlocal = false\n')
    common = ["worker", "--config", str(config), "--scheduler", "tcp://127.0.0.1:1", "--token", "t" * 32]
    common += ["--state-dir", str(tmp_path / "state")]
    assert cli.main([*common, "--id", "learner-0", "--device", "cuda"]) != 0
    assert "sees no CUDA device" in capsys.readouterr().err
    assert cli.main([*common, "--id", "engine-0", "--device", "cuda"]) != 0  # the hf engine: refused alike
    assert "sees no CUDA device" in capsys.readouterr().err


def test_an_hf_engine_takes_a_device_and_a_vllm_engine_refuses_one() -> None:
    from polytinker.scheduler.service import EngineWorkerConfig

    assert EngineWorkerConfig(device="cuda:1", dtype="bfloat16").device == "cuda:1"
    with pytest.raises(ConfigError, match="vllm engine takes the GPUs CUDA_VISIBLE_DEVICES shows it"):
        EngineWorkerConfig(backend="vllm", device="cuda:1")


@no_cuda
def test_an_hf_backend_on_cuda_where_there_is_none_is_refused() -> None:
    from polytinker.engine.inference import HFBackend, HFBackendConfig

    with pytest.raises(ConfigError, match="sees no CUDA device"):
        HFBackend(HFBackendConfig(model="tiny-random", device="cuda"))


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].glob("examples/runtime/*.toml")), ids=str)
def test_the_shipped_gpu_runtime_configs_read(path: Path) -> None:
    config = RuntimeConfig.from_toml(path)
    assert all(g.device.startswith("cuda") for g in config.learners)
    for engine in config.engines:  # and each vllm engine's settings make a VllmBackendConfig
        assert engine.backend == "vllm" and engine.vllm_config(config.model).max_lora_rank == engine.max_lora_rank()
