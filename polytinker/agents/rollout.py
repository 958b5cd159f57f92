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

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from polytinker.agents.protocols import SamplingClientLike
from polytinker.agents.render import Renderer
from polytinker.agents.spec import AgentSpec
from polytinker.agents.types import Slot, SlotKind, TurnSample
from polytinker.envs.tools import Tool, ToolLimits, make_tool, run_tool_call, tool_format
from polytinker.envs.types import AgentAction, EpisodeResult, ModelSample, PolicyInput, Trajectory
from polytinker.errors import ConfigError
from polytinker.types import SamplingParams

SlotsBySeed = Mapping[int, Mapping[str, Slot]]
# What counts as a win: more reward than every other role, a positive reward, or a reward of at
# least 1 (a task solved, where partial progress earns less).
WinRule = Literal["beats_others", "positive", "solved"]


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
    # How often, how long and how much the env's tools may be called (and answer) in one turn.
    tool_limits: ToolLimits = field(default_factory=ToolLimits)
    _tools: dict[str, Tool] = field(default_factory=dict)

    def toolset(self, names: Sequence[str]) -> dict[str, Tool]:
        """The tools of these names (made once per run: the Python sandbox keeps no state)."""
        for name in names:
            if name not in self._tools:
                self._tools[name] = make_tool(name)
        return {name: self._tools[name] for name in names}

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
            turn = _ModelTurn(self, slot.name, version, samplers[(slot.name, version)], inp)
            return await turn.play(evaluation, call_seed(role, inp))

        return policy


class _ModelTurn:
    """One decision of a model agent: sample; while the completion ends in a call of one of the
    env's tools (and calls are left), run the tool, show its result, and sample on; the text
    after the last call is the action."""

    def __init__(self, players: Players, agent: str, version: int, sampler: SamplingClientLike, inp: PolicyInput):
        self.players, self.agent, self.version, self.sampler, self.inp = players, agent, version, sampler, inp
        self.spec = players.specs[agent]
        self.renderer = players.renderers[agent]
        self.tools = players.toolset(inp.tools)
        self.format = tool_format(self.spec.renderer.tool_format) if self.tools else None
        if self.tools and self.spec.renderer.constrain_moves:
            names = ", ".join(self.tools)
            raise ConfigError(f"agent {agent}: constrain_moves cannot be used in an env with tools ({names})")
        self.choices = players.renderers[agent].choices(inp)

    async def play(self, evaluation: bool, seed: int) -> AgentAction:
        tools_text = self.format.describe(list(self.tools.values()), self.players.tool_limits) if self.format else ""
        prompt = self.renderer.prompt_tokens(self.inp, tools_text)
        tokens: list[int] = []
        logprobs: list[float] = []
        sampled: list[bool] = []
        limits = self.players.tool_limits
        calls = errors = 0
        exchanges: list[dict[str, str]] = []  # each call and its result, for the transcript
        prefixes = self.spec.renderer
        while True:
            may_call = self.format is not None and calls < limits.max_calls_per_turn
            # The first sample keeps the seed it always had; each call after a tool result its own.
            params = self._params(evaluation, seed if calls == 0 else _derived_seed(seed, calls), may_call)
            response = await self.sampler.sample_async([*prompt, *tokens], 1, params)
            seq = response.sequences[0]
            tokens += seq.tokens
            logprobs += [float(x) for x in seq.logprobs]
            sampled += [True] * len(seq.tokens)
            text = self.renderer.tokenizer.decode(list(seq.tokens), skip_special_tokens=True)
            # The reply starts with the answer prefix (which may open a call), and what follows a
            # tool's result with the prefix written after it.
            text = (prefixes.answer_prefix if calls == 0 else prefixes.answer_prefix_after_tool) + text
            call = self.format.parse(text, self.tools) if may_call and self.format is not None else None
            if call is None:
                break
            result = await asyncio.to_thread(run_tool_call, call, self.tools, limits)
            calls, errors = calls + 1, errors + (not result.ok)
            exchanges.append({"tool": call.name, "arguments": call.arguments, "result": result.text})
            shown = self.renderer.tool_result_tokens([*prompt, *tokens], result.text)
            tokens += shown
            logprobs += [0.0] * len(shown)
            sampled += [False] * len(shown)
        sample = ModelSample(
            self.agent, self.version, tuple(prompt), tuple(tokens), tuple(logprobs), tuple(sampled) if calls else ()
        )
        meta: dict[str, Any] = {"tool_calls": calls, "tool_errors": errors} if self.tools else {}
        if exchanges:
            meta["tools"] = exchanges
        # The env reads the answer after the last tool result (all of it when there was no call),
        # or the listed move it names by number.
        action = self.renderer.chosen_move(self.inp, seq.text)
        if action != seq.text.strip():
            meta = {**meta, "answer": seq.text}
        return AgentAction(action, meta=meta, sample=sample)

    def _params(self, evaluation: bool, seed: int, may_call: bool) -> SamplingParams:
        sampling = self.spec.sampling
        stops = self.format.stop_strings(self.tools) if may_call and self.format is not None else ()
        return SamplingParams(
            # A constrained answer may be as long as its longest choice.
            max_tokens=max([sampling.max_tokens, *map(len, self.choices)]),
            temperature=sampling.eval_temperature if evaluation else sampling.temperature,
            top_p=sampling.top_p,
            seed=seed,
            stop=tuple(stops) or None,  # None: EOS alone ends the answer ([] would not stop even at EOS)
            choices=self.choices,
        )


def _derived_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def is_win(result: EpisodeResult, role: str, rule: WinRule) -> bool:
    totals = result.total_rewards
    if rule == "solved":  # the task's own reward of 1 reached (shaping rewards are smaller)
        return totals[role] >= 1.0
    others = [v for r, v in totals.items() if r != role]
    if rule == "positive" or not others:
        return totals[role] > 0
    return totals[role] > max(others)


def learning_trajectories(
    results: Sequence[EpisodeResult], slots_by_seed: SlotsBySeed
) -> Iterator[tuple[EpisodeResult, str, Slot, Trajectory]]:
    """(episode, role, slot, trajectory) of every role a learning agent played in an episode that
    was not aborted: what training and its metrics read."""
    for result in results:
        if result.aborted or result.seed is None:
            continue
        for role, traj in result.trajectories.items():
            slot = slots_by_seed[result.seed][role]
            if slot.trains:
                yield result, role, slot, traj


def collect_samples(results: Sequence[EpisodeResult], slots_by_seed: SlotsBySeed) -> dict[str, list[TurnSample]]:
    """The sampled turns of every learning role, by agent. Aborted episodes are left out."""
    out: dict[str, list[TurnSample]] = {}
    for result, role, slot, traj in learning_trajectories(results, slots_by_seed):
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
                    sampled_T=sample.sampled_T,
                )
            )
    return out


def rollout_metrics(
    results: Sequence[EpisodeResult],
    slots_by_seed: SlotsBySeed,
    samples: Mapping[str, list[TurnSample]],
    rule: WinRule,
) -> dict[str, float]:
    """Per learning agent: mean episode reward, win rate, invalid-action rate, sampled-token entropy."""
    rewards: dict[str, list[float]] = {}
    wins: dict[str, list[bool]] = {}
    for result, role, slot, traj in learning_trajectories(results, slots_by_seed):
        rewards.setdefault(slot.name, []).append(traj.total_reward)
        wins.setdefault(slot.name, []).append(is_win(result, role, rule))
    metrics: dict[str, float] = {"episodes": float(len(results))}
    metrics.update(_tool_metrics(results, slots_by_seed))
    for agent, values in rewards.items():
        metrics[f"reward/{agent}"] = sum(values) / len(values)
        metrics[f"win_rate/{agent}"] = sum(wins[agent]) / len(wins[agent])
    for agent, turns in samples.items():
        tokens = sum(s.sampled_tokens for s in turns)  # what the model wrote, not tool results
        metrics[f"invalid_rate/{agent}"] = sum(s.invalid for s in turns) / max(1, len(turns))
        metrics[f"tokens/{agent}"] = float(tokens)
        # Mean negative log-probability of the sampled tokens: a Monte Carlo estimate of the
        # policy's per-token entropy (exact in expectation at temperature 1).
        metrics[f"entropy/{agent}"] = -sum(sum(s.logprobs_T) for s in turns) / max(1, tokens)
    return metrics


def _tool_metrics(results: Sequence[EpisodeResult], slots_by_seed: SlotsBySeed) -> dict[str, float]:
    """Per learning agent that had tools: tool calls per turn, and the share of calls that failed."""
    calls: dict[str, list[int]] = {}
    errors: dict[str, int] = {}
    for _, _, slot, traj in learning_trajectories(results, slots_by_seed):
        for turn in traj.turns:
            if "tool_calls" in turn.meta:
                calls.setdefault(slot.name, []).append(int(turn.meta["tool_calls"]))
                errors[slot.name] = errors.get(slot.name, 0) + int(turn.meta.get("tool_errors", 0))
    out: dict[str, float] = {}
    for agent, per_turn in calls.items():
        out[f"tool_calls/{agent}"] = sum(per_turn) / len(per_turn)
        out[f"tool_error_rate/{agent}"] = errors[agent] / max(1, sum(per_turn))
    return out


__all__ = ["Players", "SlotsBySeed", "collect_samples", "is_win", "rollout_metrics"]
