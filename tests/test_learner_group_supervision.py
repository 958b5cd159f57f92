"""A learner group's followers are supervised process actors: their exit breaks the group at once
and says so (``WorkerFailed``, ``on_broken``), they die with rank 0, and they log beside it.
Real processes and a real gloo group on the tiny-random model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from polytinker.actors import read_log
from polytinker.engine.learner import LearnerConfig
from polytinker.engine.learner.group import LearnerGroup
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import Datum
from polytinker.errors import WorkerFailed

pytestmark = pytest.mark.timeout(240)


def rows(n: int = 4, length: int = 24) -> list[Datum]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        tokens = torch.randint(1, 4000, (length + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [1.0] * length))
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(cond, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LearnerGroup, list[str]]]:
    monkeypatch.setenv("POLYTINKER_RUN_DIR", str(tmp_path))
    broken: list[str] = []
    g = LearnerGroup.start(TINY_RANDOM, world_size=2, config=LearnerConfig(), name="lg", on_broken=broken.append)
    g.add_adapter("a")
    yield g, broken
    g.close()


def test_a_follower_that_dies_breaks_the_group_at_once_and_says_so(group, tmp_path: Path) -> None:
    g, broken = group
    assert g.forward_backward(rows(), "cross_entropy", adapter="a").loss > 0
    assert g.followers is not None
    (pid,) = g.followers.pids()
    assert any(r["message"] == "ready" for r in read_log(tmp_path, "lg-rank1"))  # an actor, logging beside rank 0
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: bool(broken), 10.0)
    assert broken == ["learner group rank lg-rank1 exited with code -9"]
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="lg-rank1 exited with code -9"):
        g.forward(rows(), adapter="a")
    assert time.monotonic() - started < 1.0  # refused before any collective: no wait on the dead rank
    started = time.monotonic()
    g.close()
    assert time.monotonic() - started < 10.0


def test_a_rank_that_dies_under_a_call_fails_that_call_as_worker_failed(group) -> None:
    """The collective's own error (gloo's, naming torch's source files) never reaches the caller."""
    g, broken = group
    assert g.followers is not None
    (pid,) = g.followers.pids()
    os.kill(pid, signal.SIGSTOP)  # busy, not dead: rank 0's call waits for it in the collective
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            g.forward_backward(rows(), "cross_entropy", adapter="a")
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(3.0)
    assert caller.is_alive() and not broken  # still waiting: a stopped rank is not a dead one
    os.kill(pid, signal.SIGKILL)
    caller.join(30.0)
    assert not caller.is_alive()
    (exc,) = outcome
    assert isinstance(exc, WorkerFailed), repr(exc)
    assert "lg-rank1 exited with code -9" in str(exc) and "/" not in str(exc)
    assert broken


def test_a_closed_group_is_not_a_broken_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYTINKER_RUN_DIR", str(tmp_path))
    broken: list[str] = []
    g = LearnerGroup.start(TINY_RANDOM, world_size=2, name="closing", on_broken=broken.append)
    assert g.followers is not None
    (pid,) = g.followers.pids()
    g.close()
    assert gone(pid) and broken == []
    assert any(r["message"] == "stopped" and r["extra"]["exit_code"] == 0 for r in read_log(tmp_path, "closing-rank1"))


RANK0 = """
import sys, time
from polytinker.engine.learner.group import LearnerGroup
from polytinker.engine.models import TINY_RANDOM
if __name__ == "__main__":
    g = LearnerGroup.start(TINY_RANDOM, world_size=2, name="orphan")
    print(g.followers.pids()[0], flush=True)
    time.sleep(600)
"""


def test_followers_die_with_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    env = {**os.environ, "POLYTINKER_RUN_DIR": str(tmp_path)}
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert rank0.stdout is not None
        follower = int(rank0.stdout.readline())
        assert not gone(follower)
        rank0.kill()  # SIGKILL: rank 0 runs no clean-up of its own
        wait_until(lambda: gone(follower), 15.0)
    finally:
        rank0.kill()
        rank0.wait()


def test_polytinker_worker_exits_1_when_its_group_loses_a_rank(tmp_path: Path) -> None:
    """What a launcher (Slurm, Kubernetes) sees: the worker's process ends with code 1 and says why,
    so that it is started again with a whole group. No scheduler is needed for it."""
    toml = tmp_path / "learner.toml"
    toml.write_text(f'model = "{TINY_RANDOM}"\n\n[[learners]]\nlearner_id = "learner-0"\nworld_size = 2\n')
    command = [sys.executable, "-m", "polytinker.cli", "worker", "--config", str(toml), "--id", "learner-0"]
    command += ["--scheduler", "tcp://127.0.0.1:9", "--token", "worker-token-0123456789"]
    command += ["--state-dir", str(tmp_path / "state")]
    env = {**os.environ, "POLYTINKER_RUN_DIR": str(tmp_path)}
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            if "serving at" in line:
                break
        (follower,) = [c for c in psutil.Process(worker.pid).children() if "polytinker.actors._child" in c.cmdline()]
        follower.kill()
        output, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == 1, output
    assert "learner-0 failed: learner group rank learner-0-rank1 exited with code -9" in output
