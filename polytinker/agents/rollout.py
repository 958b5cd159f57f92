"""Rollouts: episodes through the coordinator, actions from the agents' sampling clients.

``Players`` holds what plays: each agent's renderer and sampling parameters, the sampling client
of each adapter version in use, and the env's scripted opponents. ``Players.policy(slots_by_seed)``
is the coordinator's policy for one batch of episodes: it looks up the role's ``Slot`` for the
episode's seed, renders the prompt, samples from that version's ``SamplingClient`` and returns the
action with what was sampled (``AgentAction.sample``, a ``ModelSample``: the agent and version, the
prompt and completion tokens, their logprobs). ``collect_samples`` turns the trajectories of
learning roles back into ``TurnSample``s.

Sampling is seeded: each model call's seed derives from the loop's seed, the episode's seed, the
episode's place among those of its batch that share that seed (the order their first calls
came in), the role, the turn and the retry. Runs with the same seeds sample the same tokens (up
to the engine's batch-dependent rounding), and two evaluations on the same seeds use the same
random draws, so they differ only where the weights do.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from polytinker.agents.protocols import SamplingClientLike
from polytinker.agents.render import Renderer
from polytinker.agents.spec import AgentSpec
from polytinker.agents.types import Slot, SlotKind, TurnSample
from polytinker.engine.types import SamplingParams
from polytinker.envs.types import AgentAction, EpisodeResult, ModelSample, PolicyInput
from polytinker.errors import ConfigError

SlotsBySeed = Mapping[int, Mapping[str, Slot]]


@dataclass
class Players:
    """Everything that can play a role: model agents (by version) and scripted opponents."""

    specs: dict[str, AgentSpec]
    renderers: dict[str, Renderer]
    scripted: dict[str, Callable[[str, PolicyInput], str]]
    # (agent, version) -> SamplingClient; frozen agents are at version 0.
    samplers: dict[tuple[str, int], SamplingClientLike] = field(default_factory=dict)
    # The version each agent samples from now.
    current: dict[str, int] = field(default_factory=dict)

    def policy(
        self, slots_by_seed: SlotsBySeed, *, evaluation: bool = False, sample_seed: int = 0
    ) -> Callable[[str, PolicyInput], Awaitable[str | AgentAction]]:
        """The coordinator's policy for episodes whose seeds are keys of ``slots_by_seed``.
        The versions are fixed when it is made (a snapshot), so one batch never mixes versions.
        ``sample_seed`` seeds its sampling (with each call's episode seed, place, role and turn)."""
        current = dict(self.current)
        samplers = dict(self.samplers)
        places: dict[str, int] = {}  # episode id -> its place among the episodes with its seed
        per_seed: dict[int, int] = {}

        def call_seed(role: str, inp: PolicyInput) -> int:
            assert inp.seed is not None
            if inp.episode_id not in places:
                places[inp.episode_id] = per_seed.get(inp.seed, 0)
                per_seed[inp.seed] = places[inp.episode_id] + 1
            key = [sample_seed, int(evaluation), inp.seed, places[inp.episode_id], zlib.crc32(role.encode())]
            key += [len(inp.history), inp.retry]
            return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> 1)

        async def policy(role: str, inp: PolicyInput) -> str | AgentAction:
            if inp.seed is None:
                raise ConfigError("training episodes need seeds (the policy mapping is keyed by them)")
            slot = slots_by_seed[inp.seed][role]
            if slot.kind is SlotKind.SCRIPTED:
                return self.scripted[slot.name](role, inp)
            version = slot.version if slot.version is not None else current.get(slot.name, 0)
            spec = self.specs[slot.name]
            prompt = self.renderers[slot.name].prompt_tokens(inp)
            sampling = spec.sampling
            params = SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.eval_temperature if evaluation else sampling.temperature,
                top_p=sampling.top_p,
                seed=call_seed(role, inp),
            )
            response = await samplers[(slot.name, version)].sample_async(prompt, 1, params)
            seq = response.sequences[0]
            sample = ModelSample(slot.name, version, tuple(prompt), tuple(seq.tokens), tuple(seq.logprobs))
            return AgentAction(seq.text, sample=sample)

        return policy


def is_win(result: EpisodeResult, role: str, rule: Literal["beats_others", "positive"]) -> bool:
    totals = result.total_rewards
    others = [v for r, v in totals.items() if r != role]
    if rule == "positive" or not others:
        return totals[role] > 0
    return totals[role] > max(others)


def collect_samples(results: Sequence[EpisodeResult], slots_by_seed: SlotsBySeed) -> dict[str, list[TurnSample]]:
    """The sampled turns of every learning role, by agent. Aborted episodes are left out."""
    out: dict[str, list[TurnSample]] = {}
    for result in results:
        if result.aborted or result.seed is None:
            continue
        for role, traj in result.trajectories.items():
            slot = slots_by_seed[result.seed][role]
            if not slot.trains:
                continue
            for index, turn in enumerate(traj.turns):
                sample = turn.sample
                if sample is None:  # a timed-out call: nothing was sampled
                    continue
                out.setdefault(slot.name, []).append(
                    TurnSample(
                        agent=slot.name,
                        role=role,
                        version=sample.version,
                        group=str(result.seed),
                        episode_id=result.episode_id,
                        turn_index=index,
                        prompt_tokens=sample.prompt_tokens,
                        completion_tokens=sample.completion_tokens,
                        logprobs_T=sample.logprobs_T,
                        reward=turn.reward,
                        episode_reward=traj.total_reward,
                        invalid=turn.invalid_reason is not None,
                    )
                )
    return out


def rollout_metrics(
    results: Sequence[EpisodeResult],
    slots_by_seed: SlotsBySeed,
    samples: Mapping[str, list[TurnSample]],
    rule: Literal["beats_others", "positive"],
) -> dict[str, float]:
    """Per learning agent: mean episode reward, win rate, invalid-action rate, sampled-token entropy."""
    rewards: dict[str, list[float]] = {}
    wins: dict[str, list[bool]] = {}
    for result in results:
        if result.aborted or result.seed is None:
            continue
        for role, traj in result.trajectories.items():
            slot = slots_by_seed[result.seed][role]
            if slot.trains:
                rewards.setdefault(slot.name, []).append(traj.total_reward)
                wins.setdefault(slot.name, []).append(is_win(result, role, rule))
    metrics: dict[str, float] = {"episodes": float(len(results))}
    for agent, values in rewards.items():
        metrics[f"reward/{agent}"] = sum(values) / len(values)
        metrics[f"win_rate/{agent}"] = sum(wins[agent]) / len(wins[agent])
    for agent, turns in samples.items():
        tokens = sum(len(s.completion_tokens) for s in turns)
        metrics[f"invalid_rate/{agent}"] = sum(s.invalid for s in turns) / max(1, len(turns))
        metrics[f"tokens/{agent}"] = float(tokens)
        # Mean negative log-probability of the sampled tokens: a Monte Carlo estimate of the
        # policy's per-token entropy (exact in expectation at temperature 1).
        metrics[f"entropy/{agent}"] = -sum(sum(s.logprobs_T) for s in turns) / max(1, tokens)
    return metrics


__all__ = ["Players", "SlotsBySeed", "collect_samples", "is_win", "rollout_metrics"]
