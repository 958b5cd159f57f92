"""``polytinker train`` and ``polytinker show``."""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

from polytinker.agents.checkpoint import STATE_FILE
from polytinker.agents.crossplay import CrossPlay
from polytinker.agents.experiment import Experiment
from polytinker.agents.show import show_run
from polytinker.errors import ConfigError, PolytinkerError

DEFAULT_CONFIG = "examples/configs/prisoners_dilemma.toml"


def _override(text: str) -> tuple[str, Any]:
    """``train.steps=3`` -> ("train.steps", 3): the value is read as TOML (strings may be bare)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: write KEY=VALUE, e.g. --set train.steps=3")
    try:
        return key.strip(), tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value


def _train(args: argparse.Namespace) -> int:
    overrides = dict(_override(s) for s in args.set or ())
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.name:
        overrides["name"] = args.name
    if args.root:
        overrides["output.root"] = args.root
    if args.no_progress:
        overrides["output.progress"] = False
    if args.env_address:
        overrides["env.address"] = args.env_address
    experiment = Experiment.from_toml(args.config, overrides)
    try:
        summary = experiment.train(resume=args.resume, overwrite=args.overwrite)
    except (PolytinkerError, KeyboardInterrupt):
        if (experiment.run_dir / STATE_FILE).exists():  # stopped after a checkpoint: say how to go on
            print(
                f"polytinker train: the run's last checkpoint is in {experiment.run_dir}; to continue from it,"
                f" run the same command with --resume: polytinker train {shlex.quote(str(args.config))} ... --resume",
                file=sys.stderr,
            )
        raise
    print(summary.report())
    # The cross-play table (eval.cross_play_episodes) as `polytinker show` prints it for the run.
    table = CrossPlay.load(Path(summary.run_dir))
    if table is not None:
        print(table.render())
    return 0


def _show(args: argparse.Namespace) -> int:
    print(show_run(Path(args.run_dir), transcripts=args.transcripts))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="train agents in an env (a TOML experiment config)")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"experiment TOML (default: {DEFAULT_CONFIG})")
    p.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run of the same name")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--name", help="override the experiment's name (its run directory)")
    p.add_argument("--root", help="override output.root (where run directories go)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any setting, e.g. train.groups=4")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--env-address",
        metavar="ADDRESS",
        help="play the episodes on the env server there (tcp://HOST:PORT, see `env serve`): overrides env.address",
    )
    p.set_defaults(func=_train)

    s = sub.add_parser("show", help="summarise a training run: metrics, evaluation, a few transcripts")
    s.add_argument("run_dir", help="a run directory (runs/<name>)")
    s.add_argument("-n", "--transcripts", type=int, default=3, help="transcripts to print (default 3)")
    s.set_defaults(func=_show)


__all__ = ["register"]
