"""A league in Python: one learning agent against its own past versions and a frozen agent, then a
cross-play table of the final agent against each frozen opponent, and an Elo per player.

    python examples/league.py                              # SmolLM2-135M-Instruct, 10 steps
    python examples/league.py --model tiny-random --steps 2 --root /tmp/runs   # a smoke run
    polytinker show runs/pd-league                         # the same table, from the run directory

The game is the one-shot prisoner's dilemma of the main job (examples/configs/prisoners_dilemma.toml).
`duelist` trains with GRPO; in every episode it plays one seat (alternating with the seed) and
the other seat goes to an opponent drawn from the league: its past versions (one joins the pool
every few steps, the newest four kept) and the frozen agent `base` (the untrained
base model with the same prompt). After the last step the final `duelist` plays each of them for
`--cross-play` episodes, half in each seat, and the run writes the table to crossplay.json.
"""

from __future__ import annotations

import argparse

from polytinker import (
    AdapterSpec,
    AgentSpec,
    AlgorithmConfig,
    CrossPlay,
    EnvSetup,
    EvalConfig,
    Experiment,
    ExperimentConfig,
    MappingConfig,
    OutputConfig,
    PolytinkerError,
    RendererConfig,
    SamplingConfig,
    TrainConfig,
)

PROMPT = (
    "One round of the prisoner's dilemma. Both cooperate: 3 points each. Both defect: 1 each. If you defect "
    "and the other cooperates, you get 5 and they get 0. Reply with one word, for example: cooperate"
)


def agent(name: str, model: str | None, *, trainable: bool) -> AgentSpec:
    """A prisoner's-dilemma player; ``model`` None: AgentSpec's default base model."""
    return AgentSpec(
        name,
        **({"base_model": model} if model else {}),
        trainable=trainable,
        adapter=AdapterSpec(rank=8, alpha=16),
        algorithm=AlgorithmConfig(name="grpo", learning_rate=5e-4),
        sampling=SamplingConfig(max_tokens=4, temperature=1.0, eval_temperature=0.7),
        renderer=RendererConfig(history="none", system_prompt=PROMPT, answer_prefix="My move (cooperate or defect):"),
    )


def config(args: argparse.Namespace) -> ExperimentConfig:
    return ExperimentConfig(
        name=args.name,
        env=EnvSetup("prisoners_dilemma-v0", {"rounds": 1}, max_retries=1, invalid_action_penalty=-0.5),
        agents=(agent("duelist", args.model, trainable=True), agent("base", args.model, trainable=False)),
        # The learner's current version joins the pool every steps / 5 steps (every other step of
        # 10, every step of a short run), and the four newest stay.
        mapping=MappingConfig(kind="league", pool_size=4, pool_every=max(1, args.steps // 5)),
        train=TrainConfig(steps=args.steps, groups=2, group_size=8, seed=0),
        eval=EvalConfig(episodes=args.eval_episodes, opponents=("random",), cross_play_episodes=args.cross_play),
        output=OutputConfig(root=args.root, checkpoint_every=max(1, args.steps), progress=not args.no_progress),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="every agent's base model, e.g. tiny-random (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--cross-play", type=int, default=32, help="cross-play episodes a pair (default 32)")
    parser.add_argument("--eval-episodes", type=int, default=32, help="episodes of each evaluation vs random")
    parser.add_argument("--root", default="runs", help="where run directories go (default runs/)")
    parser.add_argument("--name", default="pd-league", help="the run's name: its directory is ROOT/NAME")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run of the same name")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    try:
        summary = Experiment(config(args)).train(overwrite=args.overwrite)
    except PolytinkerError as exc:  # a bad setting, a run of that name already there: the reason, no traceback
        parser.exit(1, f"league.py: {type(exc).__name__}: {exc}\n")
    print(summary.report())
    table = CrossPlay.load(summary.run_dir)  # None with --cross-play 0
    if table is not None:
        print(table.render())


if __name__ == "__main__":
    main()
