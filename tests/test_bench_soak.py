"""benchmarks/soak.py end to end on a smaller budget than --quick: every figure it promises is
printed and parses, so the documented command keeps working as the server changes. The targets
themselves are the benchmark's to report (docs/benchmarks.md), not this test's to enforce."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (
    "good_tenant_p99_s",
    "fairness_ratio",
    "hog_delay_ratio",
    "hog_only_delay_ratio",
    "latency_alone_s",
    "latency_in_soak_without_hog_s",
    "latency_with_hog_s",
    "hog_samples_per_s",
)
COUNTS = (
    "failed_calls",
    "calls_good_a",
    "calls_good_b",
    "probes_alone",
    "probes_with_hog",
    "busy_processes",
    "hostile_refused_4xx",
    "hostile_other",
    "hostile_failed_later",
    "hostile_accepted",
    "hostile_hog_done",
    "hostile_hog_failed",
)


@pytest.mark.timeout(300)
def test_the_soak_benchmark_prints_every_figure() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", "--seconds", "6", "--probes", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    for name in RATIOS:
        float(figures[name])  # nan where no probe ran beside the hog: printed all the same
    counts = {name: int(figures[name]) for name in COUNTS}
    assert counts["calls_good_a"] > 0 and counts["calls_good_b"] > 0, out.stdout
    assert counts["probes_alone"] == 2 and counts["busy_processes"] >= 1, out.stdout
    assert counts["hostile_refused_4xx"] > 0, out.stdout
    assert math.isfinite(float(figures["latency_alone_s"])) and float(figures["duration_s"]) > 0
    assert float(figures["hog_samples_per_s"]) >= 0, out.stdout  # finite: the engine's count was read twice
