"""benchmarks/contention.py on the tiny random model: every figure it promises comes back finite and
positive from a real runtime with busy processes, so the function benchmarks/engine.py calls keeps
working as the runtime changes. The targets are the benchmark's to report (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.client import MODEL

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (
    "contended_cpu_s_per_step_ratio",
    "contended_sampling_slowdown",
    "contended_step_slowdown",
    "quiet_step_s",
    "busy_step_s",
    "quiet_sample_s",
    "busy_sample_s",
    "quiet_cpu_s_per_step",
    "busy_cpu_s_per_step",
)


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("contention_bench", ROOT / "benchmarks" / "contention.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_comes_back_from_a_real_runtime_with_busy_processes() -> None:
    figures = _bench().compare({"default": {}}, quick=True, model=MODEL)["default"]
    assert set(figures) == set(FIGURES)
    for name, value in figures.items():
        assert math.isfinite(value) and value > 0, (name, value)


def test_a_malformed_compare_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("x:NOEQUALS", ":A=1", "x:=1"):
        with pytest.raises(SystemExit) as exit_info:
            _bench().main(["--compare", bad])
        assert exit_info.value.code == 2
        assert "--compare" in capsys.readouterr().err
