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
from polytinker.agents.config import EnvSetup, EvalConfig
from polytinker.agents.mapping import SCRIPTED_PREFIX, TEAM, PolicyMapping
from polytinker.agents.metrics import transcript
from polytinker.agents.rollout import Players, is_win
from polytinker.agents.types import Slot, SlotKind
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
    env: EnvSetup | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics and one transcript per (agent, role, opponent); ``EnvError`` when more than
    ``max_aborted_share`` of the episodes aborted (its fix names ``env``, the run's env)."""
    seeds = [config.seed + i for i in range(config.episodes)]
    # Each batch: the slots its episodes are played with, and the (agent, role, opponent) it scores.
    batches: list[tuple[dict[str, Slot], list[tuple[str, str, str]]]] = [
        (mapping.evaluation(agent, role, opponent), [(agent, role, opponent)])
        for agent in agents
        for role in mapping.trained_roles(agent)
        for opponent in config.opponents
        if opponent != TEAM
    ]
    if TEAM in config.opponents:
        team = mapping.team()
        batches.append((team, [(s.name, role, TEAM) for role, s in team.items() if s.trains and s.name in agents]))

    async def play(slots: dict[str, Slot]) -> list[EpisodeResult]:
        policy = players.policy(dict.fromkeys(seeds, slots), evaluation=True, sample_seed=config.seed)
        return await coordinator.run(make_env, policy, seeds)

    outcomes = await asyncio.gather(*(play(slots) for slots, _ in batches))
    played = [r for results in outcomes for r in results]
    check_aborted(played, max_aborted_share, f"evaluation at step {step}", env=env)
    wins: dict[tuple[str, str], list[float]] = {}
    rewards: dict[tuple[str, str], list[float]] = {}
    transcripts = []
    for (slots, scored), results in zip(batches, outcomes, strict=True):
        done = [r for r in results if not r.aborted]
        for agent, role, opponent in scored:
            wins.setdefault((agent, opponent), []).extend(float(is_win(r, role, config.win)) for r in done)
            rewards.setdefault((agent, opponent), []).extend(r.total_rewards[role] for r in done)
        if done:
            transcripts.append(transcript(done[0], step, "eval", {r: _player(s) for r, s in slots.items()}))
    metrics: dict[str, float] = aborted_metrics(played, "eval/")
    for (agent, opponent), values in wins.items():
        metrics[f"eval/{agent}/{opponent}/win_rate"] = sum(values) / max(1, len(values))
        got = rewards[(agent, opponent)]
        metrics[f"eval/{agent}/{opponent}/reward"] = sum(got) / max(1, len(got))
    return metrics, transcripts


def _player(slot: Slot) -> str:
    """Who played a role, as a transcript names it."""
    return f"{SCRIPTED_PREFIX}{slot.name}" if slot.kind is SlotKind.SCRIPTED else slot.name


__all__ = ["evaluate"]
