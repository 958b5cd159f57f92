"""The Python examples in docs/envs.md and docs/remote-envs.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCKS = [
    block
    for name in ("envs.md", "remote-envs.md")
    for block in re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.DOTALL)
]


def test_the_doc_has_examples():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index):
    from polytinker.envs.registry import unregister

    try:
        exec(compile(BLOCKS[index], f"docs example {index}", "exec"), {"__name__": "docs_example"})
    finally:
        unregister("pd_short-v0")


def test_the_quickstart_example_runs():
    import subprocess
    import sys

    root = DOCS.parent
    out = subprocess.run(
        [sys.executable, "examples/envs_quickstart.py"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("mean reward of player_0 vs heuristic") == 4
