"""benchmarks/gpu.py (what scripts/gpu_check.sh prints on a GPU) dry-run on the CPU with the tiny
shape: every figure it promises comes out, finite, so a GPU machine's only run is not its first."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (
    "gpu_engine_mixed_vs_single_ratio",
    "gpu_engine_mixed_tok_per_s",
    "gpu_learner_batched_vs_in_turn_ratio",
    "gpu_learner_batched_tok_per_s",
    "gpu_adapter_sync_ms",
    "gpu_runtime_rl_step_s",
)


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--shape", "tiny", "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line and not line.startswith("#"))
    for name in FIGURES:
        value = float(figures[name])
        assert math.isfinite(value) and value > 0, f"{name}: {value}"
