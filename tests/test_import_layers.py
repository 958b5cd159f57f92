"""Which package may import which: transport <- actors <- engine <- scheduler <- client <- gateway,
envs on transport only, agents on the client and envs (and the public vocabulary,
polytinker.types). Read from the source (every import statement, module-level or in a function),
so a lazy import that crosses a layer the wrong way fails here too."""

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
    "agents": {"client", "envs", "types"},
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


def _unexplained_lazy_imports(path: Path) -> Iterator[int]:
    """Lines of ``path`` with an import of a polytinker module inside a function and no comment
    saying why: on the statement, or on the line above the run of imports it belongs to."""
    lines = path.read_text().splitlines()
    for fn in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {i for n in imports for i in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
        for node in imports:
            if not (
                isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("polytinker")
            ):
                continue
            if any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
                continue
            first = node.lineno  # 1-based: walk up the run of import statements
            while first - 1 in import_lines:
                first -= 1
            if not lines[first - 2].strip().startswith("#"):
                yield node.lineno


def test_an_import_inside_a_function_says_why() -> None:
    """A polytinker module imported in a function, not at the top, buys start-up time (torch,
    transformers or FastAPI load only where they are used) or breaks a cycle: the comment says
    which. Anything else belongs at the top of the module."""
    bad = [
        f"{path.relative_to(PACKAGE).as_posix()}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _unexplained_lazy_imports(path)
    ]
    assert bad == []


def test_the_lazy_import_check_sees_one_without_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n    from polytinker.engine import models\n\n\n"
        "def g():\n    # torch loads only here\n"
        "    from polytinker.engine import models\n    from polytinker import types\n"
    )
    assert list(_unexplained_lazy_imports(path)) == [2]
