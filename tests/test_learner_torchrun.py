"""Learner groups launched by torchrun (RANK/WORLD_SIZE/MASTER_* from the environment).

Run as a script under torchrun, this file is the training program every rank runs; as a test
module it launches that program and compares rank 0's result with one in-process learner.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polytinker.engine.learner import AdamParams, LearnerConfig, MultiAdapterLearner
from polytinker.engine.learner.group import LearnerGroup, run_rank
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum, LoraConfig

CONFIG = LearnerConfig(micro_batch_size=2)


def batch() -> list[Datum]:
    g = torch.Generator().manual_seed(21)
    out = []
    for n in (5, 8, 6):
        tokens = torch.randint(1, 4000, (n + 1,), generator=g).tolist()
        out.append(
            Datum(
                tokens[:-1],
                tokens[1:],
                [0.0] + [1.0] * (n - 1),
                torch.randn(n, generator=g).tolist(),
                (-9.0 + torch.rand(n, generator=g)).tolist(),
            )
        )
    return out


def train(learner: MultiAdapterLearner | LearnerGroup) -> dict[str, torch.Tensor]:
    learner.add_adapter("alice", LoraConfig(rank=4, alpha=8), seed=2)
    learner.forward_backward(batch(), "importance_sampling", "alice")
    learner.optim_step(AdamParams(learning_rate=1e-2), "alice")
    return learner.export_adapter("alice").tensors


def launch(nproc: int, device: str, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        __file__,
        "--device",
        device,
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_against_single(out: Path) -> None:
    torch.set_num_threads(1)
    expected = train(MultiAdapterLearner(load_model(TINY_RANDOM)[0], CONFIG))
    got = load_file(str(out))
    assert set(got) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_on_cpu(tmp_path) -> None:
    launch(2, "cpu", tmp_path / "alice.safetensors")
    check_against_single(tmp_path / "alice.safetensors")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_torchrun_nccl_on_gpu(tmp_path) -> None:
    launch(1, "cuda", tmp_path / "alice.safetensors")
    check_against_single(tmp_path / "alice.safetensors")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_group_start_nccl_on_gpu() -> None:
    import torch.distributed as dist

    group = LearnerGroup.start(TINY_RANDOM, world_size=1, config=CONFIG, device="cuda")
    try:
        assert dist.get_backend() == "nccl"
        assert next(group.learner.base_model.parameters()).device.type == "cuda"
        got = train(group)
    finally:
        group.close()
    expected = train(MultiAdapterLearner(load_model(TINY_RANDOM)[0], CONFIG))
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-3, atol=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = run_rank(TINY_RANDOM, CONFIG, device=args.device)
    if group is not None:  # rank 0 drives; the others served inside run_rank until close()
        tensors = train(group)
        save_file({k: v.contiguous() for k, v in tensors.items()}, args.out)
        group.close()


if __name__ == "__main__":
    main()
