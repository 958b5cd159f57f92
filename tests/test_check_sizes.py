"""scripts/check_sizes.py: the module and function size limits `make lint` checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_sizes.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_within_limits_passes(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text(_function("short", 59))  # 60 lines with its def
    done = _check(str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_long_function_method_and_module_are_named(tmp_path: Path) -> None:
    method = "class Box:\n    @staticmethod\n" + _function("long_method", 60, indent="    ")
    nested = "def outer():\n" + _function("inner", 60, indent="    ")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "funcs.py").write_text(method + "\n" + nested)
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * 501)
    done = _check(str(tmp_path))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any("big.py:1: module has 501 lines (> 500)" in line for line in lines), lines
    assert any("funcs.py:3: function Box.long_method has 61 lines (> 60)" in line for line in lines), lines
    assert any("function outer has 62 lines" in line for line in lines), lines
    assert any("function outer.inner has 61 lines" in line for line in lines), lines
    assert len(lines) == 4, lines


def test_limits_can_be_set(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(_function("f", 10))
    assert _check("--max-function-lines", "10", str(tmp_path)).returncode == 1
    assert _check("--max-function-lines", "11", "--max-module-lines", "11", str(tmp_path)).returncode == 0
