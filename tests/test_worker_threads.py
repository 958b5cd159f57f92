"""A local runtime's worker processes: torch threads fit to the cores the runtime may run on and
shared by its engines and learner ranks, and OpenMP threads that sleep while they wait
(``RuntimeConfig.worker_threads``, ``polytinker.engine.worker.server.worker_env``)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from fixtures.client import MODEL

from polytinker.engine.worker.server import worker_env
from polytinker.errors import ConfigError
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
    TenantConfig,
)


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def test_a_worker_takes_the_cores_shared_by_its_ranks_and_its_waiting_threads_sleep(eight_cores: None) -> None:
    assert worker_env(0, 1, {}) == {"OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    assert worker_env(0, 3, {})["OMP_NUM_THREADS"] == "2"  # 8 // 3: a group's ranks never exceed the cores
    assert worker_env(0, 16, {})["OMP_NUM_THREADS"] == "1"  # at least one each


def test_a_set_thread_count_wins_then_the_environment_then_the_cores(eight_cores: None) -> None:
    assert worker_env(3, 1, {"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in worker_env(0, 1, {"OMP_NUM_THREADS": "6"})  # inherited as it is
    assert worker_env(0, 2, {"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "4"


def test_a_wait_policy_or_spin_count_in_the_environment_is_kept(eight_cores: None) -> None:
    assert "OMP_WAIT_POLICY" not in worker_env(0, 1, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert "GOMP_SPINCOUNT" not in worker_env(0, 1, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY" not in worker_env(0, 1, {"GOMP_SPINCOUNT": "10000"})


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None, True])
def test_worker_threads_is_a_whole_number_of_at_least_zero(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"RuntimeConfig\.worker_threads must be a whole number >= 0"):
        RuntimeConfig(worker_threads=bad)  # type: ignore[arg-type]


def test_worker_threads_reads_from_a_runtime_table() -> None:
    assert RuntimeConfig.from_dict({"model": MODEL, "worker_threads": 2}).worker_threads == 2
    with pytest.raises(ConfigError, match="worker_threads"):
        RuntimeConfig.from_dict({"model": MODEL, "worker_threads": "2"})


def test_a_local_runtime_starts_its_workers_with_the_threads_and_wait_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cores = len(os.sched_getaffinity(0))
    config = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("t", api_key="worker-threads-key-0123"),),
        engines=(EngineWorkerConfig(),),
        learners=(LearnerWorkerConfig(world_size=2),),
        start_timeout_s=240.0,
    )
    with LocalRuntime(config) as runtime:
        for worker_id, threads in (("engine-0", cores), ("learner-0", max(1, cores // 2))):
            pid = runtime.workers[worker_id].pid
            assert pid is not None
            env = psutil.Process(pid).environ()
            assert env["OMP_NUM_THREADS"] == str(threads), worker_id
            assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["GOMP_SPINCOUNT"] == "1000", worker_id


def test_worker_threads_take_omp_num_threads_else_the_cores_shared_by_a_groups_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polytinker.engine.worker.server import worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads() == worker_threads(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert (worker_threads(), worker_threads(1), worker_threads(2), worker_threads(16)) == (8, 8, 4, 1)


def test_a_worker_process_takes_the_threads_its_role_and_group_size_give_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from polytinker.engine.worker.server import set_worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    given: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", given.append)
    config = RuntimeConfig(
        engines=(EngineWorkerConfig("engine-0"),),
        learners=(LearnerWorkerConfig("solo"), LearnerWorkerConfig("pair", world_size=2)),
    )
    for worker_id in ("engine-0", "solo", "pair"):
        set_worker_threads(config.worker_plan(worker_id))
    assert given == [8, 8, 4]  # a group's ranks share the cores
