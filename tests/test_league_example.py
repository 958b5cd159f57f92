"""examples/league.py as a user runs it (a child interpreter that starts its own local runtime on
the tiny-random model), then `polytinker show` on the run it wrote: both print the cross-play
table of the final agent against the league's frozen opponents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
EPISODES = 32  # the script's default --cross-play

pytestmark = pytest.mark.timeout(300)


def _table(text: str) -> tuple[list[str], list[list[str]], dict[str, float]]:
    """(header, rows, elo) of the cross-play block in printed text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("cross-play:"))
    elo_at = next(i for i in range(start, len(lines)) if lines[i].startswith("Elo"))
    header, *rows = (line.split() for line in lines[start + 1 : elo_at])
    elo = {}
    for line in lines[elo_at + 1 :]:
        if not line.startswith("  ") or ":" not in line:
            break
        name, rating = line.strip().rsplit(": ", 1)
        elo[name] = float(rating)
    return header, rows, elo


def test_the_league_script_trains_and_prints_the_cross_play_table_that_show_prints(tmp_path):
    args = ["--model", "tiny-random", "--steps", "2", "--root", str(tmp_path), "--no-progress"]
    out = subprocess.run(
        [sys.executable, "examples/league.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "pd-league"
    state = json.loads((run / "state.json").read_text())
    assert state["step"] == 2
    # The opponents: the frozen agent, and the pool's versions other than the final one.
    past = [f"duelist@v{v}" for v in state["pool"]["duelist"] if v != state["versions"]["duelist"]]
    header, rows, elo = _table(out.stdout)
    assert header == ["agent", "base", *past]
    assert [row[0] for row in rows] == ["duelist"]  # one learning agent x its opponents
    for cell in rows[0][1:]:
        wins, draws, losses = (int(n) for n in cell.split("-"))
        assert wins + draws + losses == EPISODES  # prisoner's dilemma episodes never abort
    assert set(elo) == {"duelist", "base", *past}
    assert sum(elo.values()) / len(elo) == pytest.approx(1000, abs=1)
    shown = subprocess.run(
        [sys.executable, "-m", "polytinker.cli", "show", str(run), "-n", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert _table(shown.stdout) == (header, rows, elo)
