"""Learners on a CUDA GPU (tiny-random model): the runtime's learner worker placed by its
``device`` and ``dtype``, and agents' batched updates on the GPU, against the CPU in float32.
Run by scripts/gpu_check.sh; skipped (and so failed by that script) where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _worker import worker_process

from polytinker.engine.learner import AdamParams, DistInfo, LearnerConfig, MultiAdapterLearner
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum, LoraConfig
from polytinker.engine.worker import messages as wm
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.config import LearnerWorkerConfig

pytestmark = pytest.mark.gpu

LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2)
AGENTS = ("alice/job/a", "bob/job/b")


def rows(seed: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 11, 9):
        tokens = torch.randint(1, 4000, (n + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 2 + [1.0] * (n - 2)))
    return out


def learner(device: str) -> MultiAdapterLearner:
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device(device))
    out = MultiAdapterLearner(load_model(TINY_RANDOM)[0], LearnerConfig(micro_batch_size=4), info)
    for i, name in enumerate(AGENTS):
        out.add_adapter(name, LORA, seed=i)
    return out


def test_batched_updates_on_the_gpu_match_the_cpu() -> None:
    data = {name: rows(i) for i, name in enumerate(AGENTS)}
    results = {}
    for device in ("cpu", "cuda:0"):
        lrn = learner(device)
        out = lrn.forward_backward_many(data, "cross_entropy")
        for name in AGENTS:
            lrn.optim_step(ADAM, name)
        results[device] = (out, {name: lrn.export_adapter(name).tensors for name in AGENTS})
    (cpu_out, cpu_w), (gpu_out, gpu_w) = results["cpu"], results["cuda:0"]
    for name in AGENTS:
        assert gpu_out[name].loss == pytest.approx(cpu_out[name].loss, rel=1e-3)
        for k, v in cpu_w[name].items():
            torch.testing.assert_close(gpu_w[name][k], v, rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_learner_worker_trains_on_its_device(tmp_path: Path, dtype: str) -> None:
    config = LearnerWorkerConfig(micro_batch_size=4, device="cuda", dtype=dtype)
    with worker_process(config, model=TINY_RANDOM, state_dir=tmp_path / "state", run_dir=tmp_path) as worker:
        for i, name in enumerate(AGENTS):
            worker.call("sched.w.ensure", wm.EnsureAdapter(name, 0, rank=LORA.rank, alpha=LORA.alpha, seed=i))
        items = tuple(
            wm.LearnerForwardBackward(name, tuple(rows(i)), "cross_entropy", request_id=f"r{i}")
            for i, name in enumerate(AGENTS)
        )
        out: r.ForwardBackwardManyReply = worker.call("sched.w.fb_many", wm.LearnerForwardBackwardMany(items))
        for name in AGENTS:
            step = wm.LearnerStep(name, ADAM, expected_fb=1)
            assert worker.call("sched.w.step", step).version == 1
    reference = learner("cpu").forward_backward_many({n: rows(i) for i, n in enumerate(AGENTS)}, "cross_entropy")
    # float32 on the GPU is the CPU's result; bfloat16 (auto on CUDA) keeps about 3 digits.
    rel = 1e-3 if dtype == "float32" else 5e-2
    for got, name in zip(out.results, AGENTS, strict=True):
        assert got.loss == pytest.approx(reference[name].loss, rel=rel)
