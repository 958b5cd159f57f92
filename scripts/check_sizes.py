"""Size limits for the package: no module over 500 lines, no function or method over 60.

A function's length runs from its ``def`` line to its last line (decorators not counted,
nested functions counted in the function that holds them and on their own).

Usage: ``python scripts/check_sizes.py [PATH ...]`` (default: ``polytinker``). Prints each
offender as ``path:line: what (length > limit)`` and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def python_files(paths: list[Path]) -> Iterator[Path]:
    """Every ``.py`` file under the given files and folders, in a stable order."""
    for path in paths:
        if path.is_dir():
            yield from sorted(path.rglob("*.py"))
        elif path.suffix == ".py":
            yield path


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) for every function and method, nested ones included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def offenders(path: Path, max_module: int, max_function: int) -> list[str]:
    """The size violations in one file, one line of text each."""
    source = path.read_text(encoding="utf-8")
    found = []
    n_lines = len(source.splitlines())
    if n_lines > max_module:
        found.append(f"{path}:1: module has {n_lines} lines (> {max_module})")
    for name, node in _functions(ast.parse(source, filename=str(path))):
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > max_function:
            found.append(f"{path}:{node.lineno}: function {name} has {length} lines (> {max_function})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("polytinker")])
    parser.add_argument("--max-module-lines", type=int, default=MAX_MODULE_LINES)
    parser.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES)
    args = parser.parse_args(argv)
    found = [
        line
        for path in python_files(args.paths)
        for line in offenders(path, args.max_module_lines, args.max_function_lines)
    ]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} size limit(s) exceeded", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
