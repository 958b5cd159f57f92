"""Evaluation against the env's scripted opponents, during training and at its ends.

Each trainable agent plays each role it trains in against each scripted opponent kind in the
other roles, on the same episode and sampling seeds every time (so evaluations compare: they
differ only where the weights do), at the agent's ``eval_temperature``. All these batches run at
once, so their model calls share the engine's batches. Metrics: ``eval/<agent>/<opponent>/win_rate``
and ``.../reward``, averaged over roles, of the episodes that ended; ``eval/aborted`` and
``eval/aborted_share`` count the others (past ``max_aborted_share`` the evaluation raises).

The opponent ``team`` is the experiment's agents themselves, every role filled as training fills
it (``PolicyMapping.team``): the two agents of a cooperative game together, or both of a
competitive one, against each other, on the same seeds. Its metrics are
``eval/<agent>/team/...``, for each learning agent over the roles it plays there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from polytinker.agents.aborts import aborted_metrics, check_aborted
from polytinker.agents.config import EvalConfig
from polytinker.agents.mapping import TEAM, PolicyMapping
from polytinker.agents.metrics import transcript
from polytinker.agents.rollout import Players, is_win
from polytinker.agents.types import Slot
from polytinker.envs import Coordinator
from polytinker.envs.coordinator import EnvFactory
from polytinker.envs.types import EpisodeResult


async def evaluate(
    players: Players,
    mapping: PolicyMapping,
    agents: Sequence[str],
    make_env: EnvFactory,
    coordinator: Coordinator,
    config: EvalConfig,
    step: int,
    *,
    max_aborted_share: float = 1.0,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics and one transcript per (agent, role, opponent); ``EnvError`` when more than
    ``max_aborted_share`` of the episodes aborted."""
    seeds = [config.seed + i for i in range(config.episodes)]
    jobs: list[tuple[str, str, str]] = [
        (agent, role, opponent)
        for agent in agents
        for role in mapping.trained_roles(agent)
        for opponent in config.opponents
        if opponent != TEAM
    ]
    team = mapping.team() if TEAM in config.opponents else None

    async def play(slots: dict[str, Slot]) -> list[EpisodeResult]:
        policy = players.policy(dict.fromkeys(seeds, slots), evaluation=True, sample_seed=config.seed)
        return await coordinator.run(make_env, policy, seeds)

    batches = [play(mapping.evaluation(*job)) for job in jobs]
    if team is not None:
        batches.append(play(team))
    outcomes = await asyncio.gather(*batches)
    played = [r for results in outcomes for r in results]
    check_aborted(played, max_aborted_share, f"evaluation at step {step}")
    wins: dict[tuple[str, str], list[float]] = {}
    rewards: dict[tuple[str, str], list[float]] = {}
    transcripts = []

    def score(agent: str, role: str, opponent: str, done: list[EpisodeResult]) -> None:
        wins.setdefault((agent, opponent), []).extend(float(is_win(r, role, config.win)) for r in done)
        rewards.setdefault((agent, opponent), []).extend(r.total_rewards[role] for r in done)

    for (agent, role, opponent), results in zip(jobs, outcomes[: len(jobs)], strict=True):
        done = [r for r in results if not r.aborted]
        score(agent, role, opponent, done)
        if done:
            names = {r: (agent if r == role else f"scripted:{opponent}") for r in done[0].trajectories}
            transcripts.append(transcript(done[0], step, "eval", names))
    if team is not None:
        done = [r for r in outcomes[-1] if not r.aborted]
        for role, slot in team.items():
            if slot.trains and slot.name in agents:
                score(slot.name, role, TEAM, done)
        if done:
            transcripts.append(transcript(done[0], step, "eval", {r: s.name for r, s in team.items()}))
    metrics: dict[str, float] = aborted_metrics(played, "eval/")
    for (agent, opponent), values in wins.items():
        metrics[f"eval/{agent}/{opponent}/win_rate"] = sum(values) / max(1, len(values))
        got = rewards[(agent, opponent)]
        metrics[f"eval/{agent}/{opponent}/reward"] = sum(got) / max(1, len(got))
    return metrics, transcripts


__all__ = ["evaluate"]
