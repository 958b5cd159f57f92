"""``Experiment``: the Python entry point of training (``polytinker train`` calls it too).

    exp = Experiment.from_toml("examples/configs/pd_two_agents.toml")
    summary = exp.train()              # or exp.train(resume=True)
    print(summary.report())

It builds the agents (a LoRA training client each, on one shared base model), the policy
mapping, the algorithms and the rollout players, runs the ``Trainer``, and writes the run
directory: ``config.json``, ``metrics.jsonl``, ``transcripts.jsonl``, ``curves.png``,
``state.json`` (checkpoints), ``summary.json`` and, with ``eval.cross_play_episodes``,
``crossplay.json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytinker.agents.algorithms import Algorithm, make_algorithm
from polytinker.agents.checkpoint import RunState, tenant_key
from polytinker.agents.clients import training_client
from polytinker.agents.config import ExperimentConfig
from polytinker.agents.loop import Learners, Trainer, league_update
from polytinker.agents.mapping import TEAM, PolicyMapping
from polytinker.agents.metrics import MetricsLogger, append_jsonl, plot_curves
from polytinker.agents.protocols import ServiceClientLike, TrainingClientLike
from polytinker.agents.render import Renderer
from polytinker.agents.rollout import Players
from polytinker.agents.types import AlgorithmName, LoopMode, MappingKind, StepRecord
from polytinker.envs import scripted_policy
from polytinker.errors import ConfigError, NotBuiltError, PolytinkerError
from polytinker.model_path import ModelPath

log = logging.getLogger("polytinker.agents.experiment")


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int
    wall_s: float
    # eval metrics before the first step and after the last ("eval/<agent>/<opponent>/win_rate", ...).
    before: dict[str, float]
    after: dict[str, float]

    def report(self) -> str:
        lines = [f"run {self.run_dir}: {self.steps} steps in {self.wall_s:.0f} s"]
        for key in sorted(self.after):
            if key.endswith("/win_rate"):
                _, agent, opponent, _ = key.split("/")
                base = key.rsplit("/", 1)[0]
                b, a = self.before.get(key), self.after[key]
                rb, ra = self.before.get(f"{base}/reward"), self.after.get(f"{base}/reward", float("nan"))
                was = f"{b:.2f} -> " if b is not None else ""
                was_r = f"{rb:.2f} -> " if rb is not None else ""
                against = "with the other agents" if opponent == TEAM else f"vs {opponent}"
                lines.append(f"  {agent} {against}: win rate {was}{a:.2f}, reward {was_r}{ra:.2f}")
        aborted = self.after.get("eval/aborted", 0.0)
        if aborted:
            share = self.after.get("eval/aborted_share", 0.0)
            lines.append(f"  ({aborted:.0f} evaluation episodes aborted, {share:.0%}: left out of these numbers)")
        return "\n".join(lines)


def _make_env(config: ExperimentConfig) -> Any:
    """One env of the experiment (a probe: its agents, instructions and scripted opponents); the
    caller closes it (a remote env holds an episode open on its server)."""
    return config.env.source().make()


class Experiment:
    """One experiment: its config, and ``train()``."""

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self._logger: MetricsLogger | None = None
        self._progress: Any = None
        self._state = RunState()
        self._eval_before: dict[str, float] = {}
        self._eval_last: dict[str, float] = {}
        self._start = time.perf_counter()
        self._trainer: Trainer | None = None

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> Experiment:
        return cls(ExperimentConfig.from_toml(path, overrides))

    # --- setup ---------------------------------------------------------------------------------------
    def _prepare_dir(self, resume: bool, overwrite: bool) -> None:
        if (self.run_dir / "metrics.jsonl").exists() and not resume:
            if not overwrite:
                raise ConfigError(
                    f"{self.run_dir} holds a run already: pass --resume to continue it, --overwrite to replace it, "
                    "or choose another name"
                )
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(self.config), indent=1, default=str))

    def _service(self) -> ServiceClientLike:
        # The client and the runtime's config load when an experiment starts its runtime, not with
        # polytinker.agents (which env authors import too): 0.35 s of start-up on 2 CPU cores.
        from polytinker.client import (
            EngineWorkerConfig,
            LearnerWorkerConfig,
            RuntimeConfig,
            ServiceClient,
            TenantConfig,
        )

        rt = self.config.runtime
        if rt.address:
            return ServiceClient(rt.address, api_key=rt.api_key or None)
        runtime_dir = (self.run_dir / "runtime").resolve()
        learners = tuple(
            LearnerWorkerConfig(learner_id=f"learner-{i}", micro_batch_size=rt.micro_batch_size)
            for i in range(self._learner_groups_needed())
        )
        runtime = RuntimeConfig(
            model=self.config.base_model,
            state_dir=str(runtime_dir),
            # Each full-parameter agent's current version and the one before it (async sampling,
            # evaluation) stay resident.
            engines=(
                EngineWorkerConfig(
                    backend=rt.backend,
                    full_weight_slots=max(1, 2 * self._full_agents()),
                    adapter_slots=self._adapter_slots(),
                ),
            ),
            learners=learners,
            # Every LoRA agent's forward_backward of a step may meet the others' in one pass.
            learner_batch_max=max(8, self._lora_agents()),
            tenants=(TenantConfig("local", api_key=tenant_key(runtime_dir)),),
        )
        return ServiceClient(runtime_config=runtime, inproc=rt.mode == "inproc")

    def _lora_agents(self) -> int:
        return sum(1 for a in self.config.agents if not a.adapter.full)

    def _adapter_slots(self) -> int:
        """Engine slots for every LoRA agent's adapter at once: the scheduler pins one per running
        job, so fewer slots than agents refuse the rest (OverloadedError, retried until the
        request times out). Twice the agents (a new version arrives while the last one's batches
        finish) and a league's pool; at least the engine's default 8. On the hf engine a slot
        costs the adapter's own tensors only (served from the learner's export without a copy)."""
        pool = self.config.mapping.pool_size if self.config.mapping.kind is MappingKind.LEAGUE else 0
        return max(8, 2 * self._lora_agents() + pool)

    def _full_agents(self) -> int:
        return sum(1 for a in self.config.agents if a.trainable and a.adapter.full)

    def _learner_groups_needed(self) -> int:
        """Every step trains all agents: each full-parameter agent holds a learner group to
        itself, and the LoRA agents share one more."""
        lora = any(a.trainable and not a.adapter.full for a in self.config.agents)
        return max(1, self._full_agents() + lora)

    def _check_learner_groups(self, service: ServiceClientLike) -> None:
        """Refuse a runtime with too few learner groups: the agents' jobs would wait on each other
        for ever (a full-parameter job keeps its group until it finishes)."""
        need = self._learner_groups_needed()
        if need == 1:
            return
        workers = service.runtime_status()["workers"]
        have = sum(1 for w in workers if w["role"] == "learner")
        if have < need:
            raise ConfigError(
                f"this experiment trains its agents together on {need} learner groups (one per full-parameter "
                f"agent, one for the LoRA agents); the runtime has {have}: add learner groups to its config"
            )

    def _players(self, probe_env: Any) -> Players:
        # The client loads here, not with polytinker.agents (see _service).
        from polytinker.client import load_tokenizer

        tokenizer = load_tokenizer(self.config.base_model)
        specs = {a.name: a for a in self.config.agents}
        renderers = {
            a.name: Renderer(
                tokenizer,
                dataclasses.replace(a.renderer, name_role=True)
                if self.config.mapping.kind is not MappingKind.INDEPENDENT
                else a.renderer,
            )
            for a in self.config.agents
        }
        table = getattr(probe_env, "scripted", None) or {}
        scripted: dict[str, Any] = {
            kind: scripted_policy(probe_env, kind, seed=self.config.train.seed) for kind in table
        }
        return Players(specs, renderers, scripted, tool_limits=self.config.env.tools)

    def _check_opponents(self, players: Players) -> None:
        wanted = set(self.config.eval.opponents) - {TEAM}
        wanted |= {v.removeprefix("scripted:") for v in self.config.mapping.roles.values() if v.startswith("scripted:")}
        missing = sorted(wanted - set(players.scripted))
        if missing:
            raise ConfigError(
                f"env {self.config.env.id} has no scripted opponent {missing}; it has {sorted(players.scripted)}"
            )

    # --- hooks the Trainer calls -------------------------------------------------------------------
    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self._eval_before and step == 0:
            self._eval_before = dict(metrics)
            # Kept apart so that a resumed run still reports the improvement from the start.
            (self.run_dir / "summary_before.json").write_text(json.dumps(metrics))
        self._eval_last = dict(metrics)
        assert self._logger is not None
        self._logger.log(StepRecord(step, time.perf_counter() - self._start, metrics))

    def transcripts(self, rows: list[dict[str, Any]]) -> None:
        append_jsonl(self.run_dir / "transcripts.jsonl", rows)

    async def after_update(self, step: int) -> None:
        trainer = self._trainer
        assert trainer is not None
        if self.config.mapping.kind is MappingKind.LEAGUE:
            agent = trainer.mapping.learner
            if league_update(trainer.mapping, trainer.players, agent, step):
                version = trainer.players.current[agent]
                client = trainer.learners.clients[agent]
                # A named export survives the runtime's pruning of old versions.
                saved = await client.save_weights_for_sampler(f"pool-v{version}")
                self._state.pool_paths[f"{agent}@{version}"] = saved.path

    async def end_step(self, step: int, metrics: dict[str, float]) -> None:
        assert self._logger is not None and self._trainer is not None
        if any(k.startswith("eval/") for k in metrics):
            self._eval_last = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        self._logger.log(StepRecord(step + 1, time.perf_counter() - self._start, metrics))
        if (step + 1) % self.config.output.checkpoint_every == 0 or step + 1 == self.config.train.steps:
            await self._checkpoint(step + 1)
        if self._progress is not None:
            agents = self._trainer.trainable
            shown = {f"R[{a}]": f"{metrics.get(f'reward/{a}', float('nan')):.2f}" for a in agents}
            shown |= {f"win[{a}]": f"{metrics.get(f'win_rate/{a}', float('nan')):.2f}" for a in agents}
            self._progress.set_postfix(shown, refresh=False)
            self._progress.update(1)

    async def _checkpoint(self, next_step: int) -> None:
        trainer = self._trainer
        assert trainer is not None
        for agent in trainer.trainable:
            client = trainer.learners.clients[agent]
            self._state.checkpoints[agent] = (await client.save_state(f"step-{next_step}")).path
            self._state.versions[agent] = trainer.players.current[agent]
            self._state.algorithms[agent] = trainer.learners.algorithms[agent].state_dict()
        self._state.step = next_step
        self._state.pool = {a: list(v) for a, v in trainer.mapping.pool.items()}
        self._state.save(self.run_dir)

    # --- the run -------------------------------------------------------------------------------------
    def train(
        self, *, resume: bool = False, overwrite: bool = False, service: ServiceClientLike | None = None
    ) -> RunSummary:
        """Run the experiment (or continue it from its last checkpoint with ``resume``)."""
        if any(a.algorithm.name is AlgorithmName.SFT for a in self.config.agents):
            raise NotBuiltError("SFT agents inside an RL experiment; run SFT with polytinker.agents.train_sft")
        self._prepare_dir(resume, overwrite)
        self._start = time.perf_counter()
        own = service is None
        service = service or self._service()
        try:
            return asyncio.run(self._run(service, resume))
        finally:
            if own:
                service.close()
            if self._logger is not None:
                self._logger.close()
            if self._progress is not None:
                self._progress.close()

    def _clients(self, service: ServiceClientLike) -> dict[str, TrainingClientLike]:
        self._check_learner_groups(service)
        train = self.config.train
        staleness = train.max_staleness if train.mode is LoopMode.ASYNC else 0  # the policy plans with it
        specs = [spec for spec in self.config.agents if spec.trainable]
        return {spec.name: training_client(service, spec, train.steps, staleness) for spec in specs}

    async def _run(self, service: ServiceClientLike, resume: bool) -> RunSummary:
        config = self.config
        probe = _make_env(config)
        try:
            players = self._players(probe)
            self._check_opponents(players)
            mapping = PolicyMapping(config.mapping, probe.possible_agents, config.agents)
            if config.eval.cross_play_episodes and len(mapping.env_roles) < 2:
                raise ConfigError(f"eval.cross_play_episodes: env {config.env.id} has one role; cross-play needs two")
        finally:
            # Nothing later uses the probe: its scripted policies hold no env (a remote env's ask
            # the server of the episode being played).
            probe.close()
        clients = await asyncio.to_thread(self._clients, service)
        try:
            return await self._train(service, resume, players, mapping, clients)
        finally:
            # The jobs end with the run, whoever owns the service: on a shared runtime a job left
            # live would hold its learner share (a full-parameter job, a whole group) until it
            # idled out. Adapters, versions and checkpoints stay for samplers and --resume.
            await asyncio.to_thread(_finish_jobs, clients)

    async def _train(
        self,
        service: ServiceClientLike,
        resume: bool,
        players: Players,
        mapping: PolicyMapping,
        clients: dict[str, TrainingClientLike],
    ) -> RunSummary:
        config = self.config
        algorithms = {a.name: make_algorithm(a.algorithm) for a in config.agents if a.trainable}
        for spec in config.agents:
            if not spec.trainable:
                players.samplers[(spec.name, 0)] = await asyncio.to_thread(
                    service.create_sampling_client, spec.model_path or None, spec.base_model
                )
                players.current[spec.name] = 0
        start_step = await self._restore(resume, clients, algorithms, players, mapping, service)
        for agent, client in clients.items():
            if (agent, players.current.get(agent, 0)) not in players.samplers:
                sampler = await client.save_weights_and_get_sampling_client_async()
                players.current[agent] = ModelPath.parse(sampler.model_path).version
                players.samplers[(agent, players.current[agent])] = sampler
        self._logger = MetricsLogger(
            self.run_dir, tensorboard=config.output.tensorboard, wandb=config.output.wandb, name=config.name
        )
        self._trainer = Trainer(
            config, players, mapping, Learners(clients, algorithms, config), config.env.source().factory(), self
        )
        if config.output.progress:
            from tqdm import tqdm

            self._progress = tqdm(total=config.train.steps, initial=start_step, desc=config.name, unit="step")
        await self._trainer.run(start_step)
        if config.eval.cross_play_episodes:
            (await self._trainer.cross_play()).save(self.run_dir)
        plot_curves(self.run_dir, self._trainer.trainable)
        summary = RunSummary(
            str(self.run_dir), config.train.steps, time.perf_counter() - self._start, self._eval_before, self._eval_last
        )
        (self.run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1))
        return summary

    async def _restore(
        self,
        resume: bool,
        clients: dict[str, TrainingClientLike],
        algorithms: dict[str, Algorithm],
        players: Players,
        mapping: PolicyMapping,
        service: ServiceClientLike,
    ) -> int:
        if not resume or not (self.run_dir / "state.json").exists():
            return 0
        self._state = state = RunState.load(self.run_dir)
        for agent, client in clients.items():
            if agent in state.checkpoints:
                # A resumed run: the optimizer's state too, as it was at the checkpoint.
                players.current[agent] = (await client.load_state_with_optimizer(state.checkpoints[agent])).version
            algorithms[agent].load_state_dict(state.algorithms.get(agent, {}))
        mapping.pool = {a: list(v) for a, v in state.pool.items()}
        for key, path in state.pool_paths.items():
            agent, version = key.rsplit("@", 1)
            players.samplers[(agent, int(version))] = await asyncio.to_thread(
                service.create_sampling_client, path, self.config.base_model
            )
        before = self.run_dir / "summary_before.json"
        if before.exists():
            self._eval_before = json.loads(before.read_text())
        return state.step


def _finish_jobs(clients: dict[str, TrainingClientLike]) -> None:
    for agent, client in clients.items():
        try:
            client.finish()
        except PolytinkerError as exc:  # the run's own outcome matters more than one job's end
            log.warning("could not finish the job of agent %s: %s", agent, exc)


__all__ = ["Experiment", "RunSummary"]
