"""benchmarks/colocate.py --quick on the tiny random model, in a child interpreter: every line it
promises comes back, from one worker process against two, with less memory. The targets are the
benchmark's to report (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINES = (
    "separate_worker_processes",
    "separate_peak_rss_mb",
    "separate_pss_mb",
    "separate_step_s",
    "separate_sync_ms",
    "colocated_worker_processes",
    "colocated_peak_rss_mb",
    "colocated_pss_mb",
    "colocated_step_s",
    "colocated_sync_ms",
    "colocated_hand_over_ms",
    "colocated_memory_ratio",
    "colocated_pss_ratio",
    "colocated_step_time_ratio",
)


@pytest.mark.timeout(300)
def test_the_quick_run_prints_every_figure_from_one_process_against_two() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "colocate.py"), "--quick", "--model", "tiny-random"],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    ).stdout
    figures = {}
    for line in out.splitlines():
        name, _, value = line.partition(": ")
        if name in LINES:
            figures[name] = float(value)
    assert set(figures) == set(LINES), out
    assert figures["separate_worker_processes"] == 2 and figures["colocated_worker_processes"] == 1
    # One copy of the base and one Python and torch runtime instead of two: less memory, whatever the load.
    assert 0 < figures["colocated_memory_ratio"] < 1 and 0 < figures["colocated_pss_ratio"] < 1
    assert figures["colocated_step_s"] > 0 and figures["colocated_sync_ms"] > 0
