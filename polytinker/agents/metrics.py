"""What a run writes: metrics (JSONL, TensorBoard, W&B), transcripts, and the reward curves.

Files under the run directory:

- ``metrics.jsonl``: one JSON object per training step (``step``, ``wall_s``, namespaced keys:
  ``reward/<agent>``, ``win_rate/<agent>``, ``loss/<agent>``, ``eval/<agent>/<opponent>/win_rate``, ...).
- ``transcripts.jsonl``: episodes, one per line: every role's turns (observation, action, reward).
- ``curves.png``: per agent, the training reward and the evaluation win rate against each opponent.
- ``tb/``: TensorBoard event files (when tensorboard is installed and enabled).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polytinker.agents.types import StepRecord
from polytinker.envs.types import EpisodeResult

log = logging.getLogger("polytinker.agents")


class MetricsLogger:
    """Appends step records to metrics.jsonl and mirrors them to TensorBoard and W&B."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: bool = False, name: str = "") -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"))
            except Exception as exc:  # tensorboard is optional
                log.info("TensorBoard logging is off: %s", exc)
        if wandb:
            try:
                import wandb as wb  # type: ignore[import-not-found]

                self._wandb = wb.init(project="polytinker", name=name, dir=str(run_dir), resume="allow")
            except Exception as exc:  # W&B is optional
                log.warning("W&B logging is off: %s", exc)

    def log(self, record: StepRecord) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record.to_json()) + "\n")
        for key, value in record.metrics.items():
            if self._tb is not None and isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(key, value, record.step)
        if self._wandb is not None:
            self._wandb.log(record.metrics, step=record.step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def transcript(result: EpisodeResult, step: int, kind: str, slots: Mapping[str, str]) -> dict[str, Any]:
    """One episode as plain data: who played each role, and every turn."""
    return {
        "step": step,
        "kind": kind,
        "env": result.env_id,
        "seed": result.seed,
        "episode": result.episode_id,
        "players": dict(slots),
        "rewards": result.total_rewards,
        "aborted": result.aborted,
        "turns": {
            role: [
                {
                    "observation": t.observation.text,
                    "action": t.action,
                    "reward": t.reward,
                    **({"invalid": t.invalid_reason} if t.invalid_reason else {}),
                    # The policy's notes: its tool calls and their results, the answer behind a
                    # numbered move (free-form: append_jsonl writes what JSON lacks as text).
                    **({"meta": dict(t.meta)} if t.meta else {}),
                }
                for t in traj.turns
            ]
            for role, traj in result.trajectories.items()
        },
    }


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    if rows:
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")


def plot_curves(run_dir: Path, agents: list[str]) -> Path | None:
    """``curves.png``: one panel per agent: training reward, and evaluation reward (left axis) and
    win rate (right axis) against each scripted opponent, by step."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(agents), figsize=(5.2 * len(agents), 3.6), squeeze=False)
    for ax, agent in zip(axes[0], agents, strict=True):
        steps = [r["step"] for r in rows if f"reward/{agent}" in r]
        ax.plot(steps, [r[f"reward/{agent}"] for r in rows if f"reward/{agent}" in r], label="train reward", lw=1.5)
        reward_keys = sorted({k for r in rows for k in r if k.startswith(f"eval/{agent}/") and k.endswith("/reward")})
        for key in reward_keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*pts, strict=True), "s-", color="tab:green", label=f"eval reward vs {key.split('/')[-2]}")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_title(agent)
        eval_keys = sorted({k for r in rows for k in r if k.startswith(f"eval/{agent}/") and k.endswith("/win_rate")})
        if eval_keys:
            twin = ax.twinx()
            for key in eval_keys:
                pts = [(r["step"], r[key]) for r in rows if key in r]
                opponent = key.split("/")[-2]
                twin.plot(*zip(*pts, strict=True), "o--", color="tab:orange", label=f"win rate vs {opponent}")
            twin.set_ylim(-0.02, 1.02)
            twin.set_ylabel("win rate (eval)")
            twin.legend(loc="lower right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["MetricsLogger", "append_jsonl", "plot_curves", "read_metrics", "transcript"]
