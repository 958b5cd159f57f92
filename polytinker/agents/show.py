"""``polytinker show RUN_DIR``: a run's summary, its cross-play table, its metrics at a glance, and a
few transcripts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytinker.agents.crossplay import CrossPlay
from polytinker.agents.experiment import RunSummary
from polytinker.agents.metrics import read_metrics
from polytinker.errors import ConfigError


def _episode_text(row: dict[str, Any]) -> list[str]:
    players = ", ".join(f"{role}={who}" for role, who in row.get("players", {}).items())
    rewards = ", ".join(f"{role} {r:+g}" for role, r in row.get("rewards", {}).items())
    lines = [f"- {row.get('kind', '?')} episode at step {row.get('step')} (seed {row.get('seed')}): {players}"]
    for role, turns in row.get("turns", {}).items():
        for turn in turns:
            obs = " / ".join(turn["observation"].splitlines()[-2:])
            flag = "  [invalid]" if turn.get("invalid") else ""
            lines.append(f"    {role} sees: {obs[:100]}")
            lines.append(f"    {role} says: {turn['action'][:80]!r}{flag}")
    lines.append(f"    rewards: {rewards}")
    return lines


def show_run(run_dir: Path, *, transcripts: int = 3) -> str:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run directory (runs/<name>, written by polytinker train)")
    rows = read_metrics(run_dir)
    if not rows:
        raise ConfigError(f"{run_dir} has no metrics.jsonl yet")
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        out = [RunSummary(**json.loads(summary_path.read_text())).report()]
    else:
        out = [f"run {run_dir} (unfinished: no summary.json)"]
    table = CrossPlay.load(run_dir)
    none = "cross-play: none in this run (eval.cross_play_episodes plays the final agents against the frozen ones)"
    out.append(table.render() if table else none)
    train_rows = [r for r in rows if any(k.startswith("reward/") for k in r)]
    if train_rows:
        agents = sorted({k.split("/", 1)[1] for r in train_rows for k in r if k.startswith("reward/")})
        out.append(f"training steps logged: {len(train_rows)}")
        for agent in agents:
            series = [r[f"reward/{agent}"] for r in train_rows if f"reward/{agent}" in r]
            head, tail = series[: max(1, len(series) // 4)], series[-max(1, len(series) // 4) :]
            out.append(
                f"  {agent}: reward {sum(head) / len(head):.2f} (first quarter) -> {sum(tail) / len(tail):.2f} (last)"
            )
    for name in ("curves.png", "state.json"):
        if (run_dir / name).exists():
            out.append(f"{name}: {run_dir / name}")
    path = run_dir / "transcripts.jsonl"
    if path.exists() and transcripts > 0:
        episodes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        trained = [e for e in episodes if e.get("kind") == "train"]
        picks = (trained[-transcripts:] if trained else []) or episodes[-transcripts:]
        out.append(f"last {len(picks)} transcripts:")
        for row in picks:
            out.extend(_episode_text(row))
    return "\n".join(out)


__all__ = ["show_run"]
