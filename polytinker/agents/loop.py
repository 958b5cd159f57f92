"""The training loop: rollouts through the coordinator, one update per agent per step.

Each step: ``groups`` seeds x ``group_size`` episodes are played (the policy mapping decides who
plays each role, per seed); the turns of each learning agent become its batch; each trainable
agent's algorithm turns the batch into advantages and datums; ``forward_backward`` and
``optim_step`` run through that agent's ``TrainingClient`` (the agents' updates are issued
together and share the learner); the new adapter versions become the sampling clients of the next
rollouts.

``sync`` mode samples, then trains. ``async`` mode starts the rollouts of step k+1 while step k
trains, as long as the adapters they sample from are at most ``max_staleness`` versions behind;
the ``importance_sampling`` and ``ppo`` losses correct for the stale sampler with the sampling
logprobs each datum carries.

Aborted episodes (an env that raised, a dead env server) are left out, counted (``aborted``,
``aborted_share``) and shown; past ``train.max_aborted_share`` of a step's episodes, or of an
evaluation's, the run stops with the first reasons (``polytinker.agents.aborts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence

from polytinker.agents.aborts import aborted_metrics, check_aborted
from polytinker.agents.algorithms import Algorithm
from polytinker.agents.config import ExperimentConfig
from polytinker.agents.crossplay import CrossPlay, cross_play
from polytinker.agents.evaluate import evaluate
from polytinker.agents.mapping import PolicyMapping
from polytinker.agents.metrics import transcript
from polytinker.agents.protocols import RunHooks, TrainingClientLike
from polytinker.agents.rollout import Players, SlotsBySeed, collect_samples, rollout_metrics
from polytinker.agents.types import LoopMode, TurnSample
from polytinker.envs import Coordinator, CoordinatorConfig
from polytinker.envs.coordinator import EnvFactory
from polytinker.envs.types import EpisodeResult
from polytinker.types import AdamParams, Datum

log = logging.getLogger("polytinker.agents")


def step_seeds(config: ExperimentConfig, step: int) -> tuple[list[int], list[int]]:
    """(group seeds, episode seeds): each group seed repeated ``group_size`` times."""
    train = config.train
    groups = [train.seed * 1_000_003 + step * train.groups + g for g in range(train.groups)]
    return groups, [s for s in groups for _ in range(train.group_size)]


class Learners:
    """The trainable agents' training clients and algorithms, and the updates they make."""

    def __init__(
        self, clients: dict[str, TrainingClientLike], algorithms: dict[str, Algorithm], config: ExperimentConfig
    ) -> None:
        self.clients = clients
        self.algorithms = algorithms
        self.config = config
        self.lr = {a.name: a.algorithm.learning_rate for a in config.agents}
        self.kl = {a.name: a.algorithm.kl_coef > 0 for a in config.agents}

    async def update(self, agent: str, samples: Sequence[TurnSample], step: int) -> tuple[int | None, dict[str, float]]:
        """One step of ``agent`` on its samples: (new version or None if nothing to learn, metrics)."""
        algo, client = self.algorithms[agent], self.clients[agent]
        advantages_N = algo.advantages(samples)
        batches = algo.minibatches(samples, advantages_N, seed=self.config.train.seed + step)
        metrics: dict[str, float] = {f"train/datums/{agent}": float(sum(len(b) for b in batches))}
        if not batches:
            metrics[f"train/skipped/{agent}"] = 1.0  # every advantage was 0: nothing to learn
            return None, metrics
        losses, kls, version = [], [], None
        fb_s = optim_s = 0.0
        for batch in batches:
            t0 = time.perf_counter()
            loss, fb_metrics = await self._forward_backward(agent, batch)
            t1 = time.perf_counter()
            opt = await client.optim_step(AdamParams(learning_rate=self.lr[agent]))
            fb_s, optim_s = fb_s + t1 - t0, optim_s + time.perf_counter() - t1
            losses.append(loss)
            kls.append(fb_metrics.get("kl", 0.0))
            version = opt.version
            if "ppo/clip_fraction" in fb_metrics:
                metrics[f"ppo/clip_fraction/{agent}"] = fb_metrics["ppo/clip_fraction"]
            if "optim/grad_norm" in opt.metrics:
                metrics[f"optim/grad_norm/{agent}"] = float(opt.metrics["optim/grad_norm"])
        metrics[f"loss/{agent}"] = sum(losses) / len(losses)
        # Wall time from the call to its answer: the agents' updates share the learner, so these
        # overlap, and they include any wait for the other agent's call.
        metrics[f"time/forward_backward_s/{agent}"] = fb_s
        metrics[f"time/optim_s/{agent}"] = optim_s
        if self.kl[agent]:
            metrics[f"kl/{agent}"] = sum(kls) / len(kls)
        return version, metrics

    async def _forward_backward(self, agent: str, batch: Sequence[Datum]) -> tuple[float, dict[str, float]]:
        """One minibatch's gradient, in calls of at most ``train.max_datums_per_call`` datums (the
        learner adds up the gradients of calls before an ``optim_step``, so the update is the
        same; a call on a slow machine stays within the runtime's request time limit). The summed
        loss, the mean KL and the token-weighted PPO clip fraction of the whole minibatch."""
        algo, client = self.algorithms[agent], self.clients[agent]
        size = self.config.train.max_datums_per_call
        loss = kl = clipped = tokens = 0.0
        clip_seen = False
        for start in range(0, len(batch), size):
            fb = await client.forward_backward(list(batch[start : start + size]), algo.loss_fn, algo.loss_fn_config())
            n = fb.metrics.get("loss/tokens", 0.0)
            loss, tokens = loss + fb.loss, tokens + n
            # The weights of a minibatch sum to 1, so kl/base x weighted tokens adds up to the mean KL.
            kl += fb.metrics.get("kl/base", 0.0) * n
            if "ppo/clip_fraction" in fb.metrics:
                clip_seen, clipped = True, clipped + fb.metrics["ppo/clip_fraction"] * n
        out = {"kl": kl}
        if clip_seen:
            out["ppo/clip_fraction"] = clipped / max(tokens, 1.0)
        return loss, out


class Trainer:
    """Runs an experiment's steps against a runtime; see ``Experiment`` for the entry point."""

    def __init__(
        self,
        config: ExperimentConfig,
        players: Players,
        mapping: PolicyMapping,
        learners: Learners,
        make_env: EnvFactory,
        hooks: RunHooks,
    ) -> None:
        self.config = config
        self.players = players
        self.mapping = mapping
        self.learners = learners
        self.make_env = make_env
        self.hooks = hooks  # the Experiment: logging, transcripts, checkpoints, progress
        self.coordinator = Coordinator(
            CoordinatorConfig(max_concurrent_episodes=config.train.max_concurrent_episodes, policy_timeout_s=900.0)
        )
        self.trainable = [a.name for a in config.agents if a.trainable]

    async def rollouts(self, step: int) -> tuple[list[EpisodeResult], SlotsBySeed]:
        groups, seeds = step_seeds(self.config, step)
        slots = {seed: self.mapping.assign(seed, step=step, group=g) for g, seed in enumerate(groups)}
        policy = self.players.policy(slots, sample_seed=self.config.train.seed)
        results = await self.coordinator.run(self.make_env, policy, seeds)
        check_aborted(results, self.config.train.max_aborted_share, f"step {step}", env=self.config.env)
        return results, slots

    async def evaluate(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics, transcripts = await evaluate(
            self.players,
            self.mapping,
            self.trainable,
            self.make_env,
            self.coordinator,
            self.config.eval,
            step,
            max_aborted_share=self.config.train.max_aborted_share,
            env=self.config.env,
        )
        self.hooks.transcripts(transcripts)
        return {**metrics, "time/eval_s": time.perf_counter() - start}

    async def cross_play(self) -> CrossPlay:
        """The final agents against the frozen ones and each other (``eval.cross_play_episodes``)."""
        config = self.config
        table, transcripts = await cross_play(
            self.players,
            self.mapping,
            self.make_env,
            self.coordinator,
            episodes=config.eval.cross_play_episodes,
            seed=config.eval.seed,
            step=config.train.steps,
            max_aborted_share=config.train.max_aborted_share,
        )
        self.hooks.transcripts(transcripts)
        return table

    async def train_step(
        self, step: int, results: list[EpisodeResult], slots: SlotsBySeed, rollout_s: float
    ) -> dict[str, float]:
        start = time.perf_counter()
        samples = collect_samples(results, slots)
        metrics = rollout_metrics(results, slots, samples, self.config.eval.win)
        metrics.update(aborted_metrics(results))
        updates = await asyncio.gather(*(self.learners.update(a, samples.get(a, []), step) for a in self.trainable))
        for agent, (version, agent_metrics) in zip(self.trainable, updates, strict=True):
            metrics.update(agent_metrics)
            if version is not None:
                client = self.learners.clients[agent]
                t0 = time.perf_counter()
                self.players.samplers[(agent, version)] = await client.save_weights_and_get_sampling_client_async()
                metrics[f"time/sync_s/{agent}"] = time.perf_counter() - t0
                previous, self.players.current[agent] = self.players.current[agent], version
                # Only the current version and the league's pool are sampled from again (a batch in
                # flight holds its own snapshot): the sampler table does not grow by one a step.
                if previous != version and previous not in self.mapping.pool.get(agent, []):
                    self.players.samplers.pop((agent, previous), None)
            metrics[f"version/{agent}"] = float(self.players.current[agent])
        await self.hooks.after_update(step)
        metrics.update({"time/rollout_s": rollout_s, "time/train_s": time.perf_counter() - start})
        self.hooks.transcripts(
            [
                transcript(r, step, "train", {role: s.name for role, s in slots[r.seed].items()})
                for r in results[: self.config.output.transcripts_per_step]
                if r.seed is not None
            ]
        )
        return metrics

    async def run(self, start_step: int) -> None:
        config = self.config
        if config.eval.at_start and start_step == 0:
            self.hooks.log_eval(0, await self.evaluate(0))
        pending: deque[asyncio.Task[None]] = deque()
        staleness = config.train.max_staleness if config.train.mode is LoopMode.ASYNC else 0
        for step in range(start_step, config.train.steps):
            while len(pending) > staleness:
                await pending.popleft()
            t0 = time.perf_counter()
            results, slots = await self.rollouts(step)
            rollout_s = time.perf_counter() - t0
            # Updates of one agent run in order: the next waits for the one before it.
            previous = pending[-1] if pending else None
            pending.append(asyncio.create_task(self._finish_step(step, results, slots, rollout_s, previous)))
        while pending:
            await pending.popleft()
        last = config.train.steps
        if config.train.steps > start_step or not config.eval.at_start:
            self.hooks.log_eval(last, await self.evaluate(last))

    async def _finish_step(
        self,
        step: int,
        results: list[EpisodeResult],
        slots: SlotsBySeed,
        rollout_s: float,
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None:
            await previous
        metrics = await self.train_step(step, results, slots, rollout_s)
        every = self.config.eval.every
        if every and (step + 1) % every == 0 and step + 1 < self.config.train.steps:
            metrics.update(await self.evaluate(step + 1))
        await self.hooks.end_step(step, metrics)


def league_update(mapping: PolicyMapping, players: Players, agent: str, step: int) -> bool:
    """Put the agent's current version in the league pool when due; True if it was added."""
    if (step + 1) % mapping.config.pool_every:
        return False
    version = players.current[agent]
    for dropped in mapping.add_to_pool(agent, version):
        if dropped != version:
            players.samplers.pop((agent, dropped), None)
    return True


__all__ = ["Learners", "Trainer", "league_update", "step_seeds"]
