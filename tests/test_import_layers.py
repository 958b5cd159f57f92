"""Which package may import which: transport <- actors <- engine <- scheduler <- client <- gateway,
envs on transport only. Read from the source (every import statement, module-level or in a
function), so a lazy import that crosses a layer the wrong way fails here too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "polytinker"
SHARED = {"errors", "tables", "model_path"}  # leaf modules every layer may use

# Each layer and the polytinker packages its modules may import (besides SHARED).
MAY_IMPORT = {
    "transport": set(),
    "actors": {"transport"},
    "engine": {"transport", "actors"},
    "envs": {"transport"},
    "scheduler": {"transport", "actors", "engine", "types"},
    "client": {"transport", "actors", "engine", "scheduler", "types"},
    "gateway": {"transport", "actors", "engine", "scheduler", "client", "types"},
}


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """The polytinker package each import statement of ``path`` names, with its line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "polytinker"]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "polytinker" and len(parts) > 1:
                yield parts[1], node.lineno


def _violations(layer: str) -> list[str]:
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = MAY_IMPORT[layer] | SHARED | {layer}
        out += [f"{rel}:{line} imports polytinker.{dep}" for dep, line in _imports(path) if dep not in allowed]
    return out


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    assert (PACKAGE / layer).is_dir()
    assert _violations(layer) == []


def test_the_check_sees_a_wrong_way_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from polytinker.scheduler.service import config\n")
    assert list(_imports(bad)) == [("scheduler", 2)]
