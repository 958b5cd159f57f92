"""The settings of an experiment, one frozen dataclass per part.

- ``EnvSetup``: the env id, where it runs (here, or an env server's address), its keyword
  arguments and how it treats invalid actions.
- ``TrainConfig``: steps, episodes per step (groups x group size), sync or async, seeds.
- ``EvalConfig``: evaluation against the env's scripted opponents during training, and the
  cross-play of the final agents after it.
- ``OutputConfig``: the run directory and what goes in it (metrics, transcripts, checkpoints).
- ``RuntimeSetup``: where inference and training run (a local runtime by default).
- ``ExperimentConfig``: all of them, the agents and the policy mapping; ``from_toml``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from polytinker.agents.mapping import MappingConfig
from polytinker.agents.spec import AgentSpec
from polytinker.agents.types import LoopMode
from polytinker.envs import EnvConfig, EnvSource
from polytinker.envs.tools import ToolLimits
from polytinker.errors import ConfigError
from polytinker.tables import from_table


@dataclass(frozen=True)
class EnvSetup:
    id: str = "prisoners_dilemma-v0"
    # A registered env id (`polytinker env list`) or "package.module:Class"; with an address, an
    # id that the env server there serves.
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Keyword arguments of the env (e.g. rounds = 1); scalars only for a remote env.
    max_retries: int = 1
    # Invalid actions an agent may make in a row before on_retries_exhausted applies.
    invalid_action_penalty: float = -0.5
    # Reward of each invalid action (it teaches the answer format).
    address: str = ""
    # An env server (`polytinker env serve ID --bind tcp://HOST:PORT`) to play the episodes on;
    # empty: the env runs in this process. Its scripted opponents then run on the server.
    on_retries_exhausted: Literal["fallback", "forfeit"] = "fallback"
    # "fallback": the env plays a fallback move for the agent; "forfeit": the episode ends and the
    # agent gets forfeit_reward.
    forfeit_reward: float = -1.0
    # Reward of an agent that forfeits (on_retries_exhausted = "forfeit").
    tools: ToolLimits = field(default_factory=ToolLimits)
    # [env.tools]: limits of the tools the env gives its agents (calls per turn, result size,
    # time and memory of one call); see docs/tools.md.

    def __post_init__(self) -> None:
        if not self.id:
            raise ConfigError("env.id must name a registered env, e.g. 'tictactoe-v0' (see `polytinker env list`)")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        self.source()  # the env config's checks, and the address's

    def env_config(self) -> EnvConfig:
        """The ``EnvConfig`` the env gets (as ``config=`` here, in the open request when remote)."""
        return EnvConfig(
            invalid_action_penalty=self.invalid_action_penalty,
            max_retries=self.max_retries,
            on_retries_exhausted=self.on_retries_exhausted,
            forfeit_reward=self.forfeit_reward,
        )

    def source(self) -> EnvSource:
        """Where the episodes come from: ``make()`` opens one env, ``factory()`` is the coordinator's."""
        return EnvSource(self.id, address=self.address, kwargs=self.kwargs, config=self.env_config())


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    # Training steps; each samples a batch of episodes and updates every trainable agent once
    # (or epochs x minibatches times with PPO).
    groups: int = 4
    # Distinct starts (seeds) per step.
    group_size: int = 8
    # Episodes per start: GRPO compares them.
    mode: LoopMode = LoopMode.SYNC
    # "sync": sample, then train; "async": sample step k+1 while step k trains.
    max_staleness: int = 1
    # async: rollouts may come from adapters at most this many versions old.
    seed: int = 0
    # Seeds of the episodes (and of everything else random in the loop).
    max_concurrent_episodes: int = 64
    # Episodes in flight at once (their model calls meet in the engine's batches).
    max_datums_per_call: int = 32
    # A minibatch goes to the learner in forward_backward calls of at most this many datums (their
    # gradients add up before the optimizer step: the same update), so that one call stays well
    # within the runtime's request time limit on a slow machine.
    max_aborted_share: float = 0.5
    # The run fails when more than this share of a step's episodes (or of an evaluation's) were
    # aborted: the env raised, its server died, the step limit was hit. Fewer are left out of the
    # batch and counted (metrics "aborted", "aborted_share"). 1.0: never fail.

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_aborted_share <= 1.0:
            raise ConfigError(f"train.max_aborted_share must be in [0, 1], got {self.max_aborted_share}")
        try:
            object.__setattr__(self, "mode", LoopMode(self.mode))
        except ValueError:
            raise ConfigError(f"train.mode {self.mode!r}: choose 'sync' or 'async'") from None
        if self.steps < 0 or self.groups < 1 or self.group_size < 1:
            raise ConfigError("train: steps must be >= 0, groups and group_size >= 1")
        if self.max_datums_per_call < 1:
            raise ConfigError(f"train.max_datums_per_call must be >= 1, got {self.max_datums_per_call}")
        if self.max_staleness < 0 or self.max_concurrent_episodes < 1:
            raise ConfigError("train: max_staleness must be >= 0 and max_concurrent_episodes >= 1")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    # Evaluate every this many steps (0: only before and after training).
    episodes: int = 32
    # Episodes per agent, role and opponent.
    opponents: tuple[str, ...] = ("random",)
    # Scripted opponents of the env to evaluate against ("random", "heuristic"), and "team": the
    # experiment's own agents together, every role filled as training fills it.
    win: Literal["beats_others", "positive", "solved"] = "beats_others"
    # What counts as a win: more reward than every other role, a positive reward (cooperative and
    # single-agent games), or "solved": a reward of at least 1 (a task done, in envs whose partial
    # progress earns less, such as textworld's subgoal_reward).
    seed: int = 10_000
    # Seeds of evaluation episodes (the same every evaluation, so they compare).
    at_start: bool = True
    # Evaluate before the first step (the baseline the improvement is measured from).
    cross_play_episodes: int = 0
    # After training, each trainable agent plays this many episodes against each frozen agent,
    # each past version in a league's pool and each other trainable agent (seats alternating);
    # the table and an Elo per player go to crossplay.json (polytinker.agents.crossplay). 0: none.

    def __post_init__(self) -> None:
        if self.every < 0 or self.episodes < 1:
            raise ConfigError("eval: every must be >= 0 and episodes >= 1")
        if self.cross_play_episodes < 0:
            raise ConfigError(f"eval.cross_play_episodes must be >= 0, got {self.cross_play_episodes}")
        if self.win not in ("beats_others", "positive", "solved"):
            raise ConfigError(f"eval.win must be 'beats_others', 'positive' or 'solved', got {self.win!r}")
        object.__setattr__(self, "opponents", tuple(self.opponents))


@dataclass(frozen=True)
class OutputConfig:
    root: str = "runs"
    # Runs go to <root>/<experiment name>/.
    transcripts_per_step: int = 2
    # Episodes per step written to transcripts.jsonl (evaluation episodes: the first of each).
    checkpoint_every: int = 10
    # Save every trainable agent's adapter and optimizer state every this many steps (and at the end).
    tensorboard: bool = True
    # Also write TensorBoard event files (when tensorboard is installed).
    wandb: bool = False
    # Also log to Weights & Biases (when wandb is installed and logged in).
    progress: bool = True
    # A progress bar with the live reward and win rate.

    def __post_init__(self) -> None:
        if self.transcripts_per_step < 0 or self.checkpoint_every < 1:
            raise ConfigError("output: transcripts_per_step must be >= 0 and checkpoint_every >= 1")


@dataclass(frozen=True)
class RuntimeSetup:
    address: str = ""
    # A running scheduler (`polytinker serve`), with api_key; empty: start a local runtime.
    api_key: str = ""
    # The tenant's key for `address` (or set POLYTINKER_API_KEY).
    backend: Literal["hf", "vllm"] = "hf"
    # Engine backend of a local runtime.
    micro_batch_size: int = 32
    # Datums per forward/backward pass of a local runtime's learner.
    mode: Literal["processes", "inproc"] = "processes"
    # How a local runtime runs: "processes" (scheduler, engine and learners as supervised child
    # processes) or "inproc" (the same objects in this process, no sockets: one process to debug).

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ConfigError(f"runtime.backend must be 'hf' or 'vllm', got {self.backend!r}")
        if self.mode not in ("processes", "inproc"):
            raise ConfigError(f"runtime.mode must be 'processes' or 'inproc', got {self.mode!r}")
        if self.mode == "inproc" and self.address:
            raise ConfigError("runtime.mode = 'inproc' runs a runtime in this process: leave runtime.address empty")
        if self.micro_batch_size < 1:
            raise ConfigError("runtime.micro_batch_size must be >= 1")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str
    # The run's name: its directory is <output.root>/<name>.
    env: EnvSetup = field(default_factory=EnvSetup)
    agents: tuple[AgentSpec, ...] = ()
    # The agents; trainable ones get a LoRA adapter each on the one shared base model.
    mapping: MappingConfig = field(default_factory=MappingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeSetup = field(default_factory=RuntimeSetup)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"experiment name {self.name!r}: use a plain directory name")
        object.__setattr__(self, "agents", tuple(self.agents))
        if not self.agents:
            raise ConfigError("an experiment needs at least one agent ([[agents]] in TOML)")
        names = [a.name for a in self.agents]
        if len(set(names)) != len(names):
            raise ConfigError(f"agent names must be unique, got {names}")
        models = {a.base_model for a in self.agents}
        if len(models) > 1:
            raise ConfigError(f"every agent shares one base model (one runtime serves one); got {sorted(models)}")
        constrained = [a.name for a in self.agents if a.renderer.constrain_moves]
        if constrained and self.runtime.backend == "vllm":
            raise ConfigError(
                f"agents {constrained} set renderer.constrain_moves, which the hf engine backend serves; "
                "runtime.backend = 'vllm' does not"
            )

    @property
    def base_model(self) -> str:
        return self.agents[0].base_model

    @property
    def run_dir(self) -> Path:
        return Path(self.output.root) / self.name

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExperimentConfig:
        """Build from the TOML's tables; an unknown key or a value of the wrong type is a
        ConfigError that names it (``train.steps: expected int, got str 'ten'``).

        An ``agent_defaults`` table holds the settings every agent shares (adapter, algorithm,
        sampling, renderer, ...); each ``[[agents]]`` entry overrides them key by key, so sixteen
        agents of one kind are sixteen names, not sixteen copies of the prompt."""
        raw = dict(raw)
        defaults = raw.pop("agent_defaults", None)
        if defaults is not None:
            if not isinstance(defaults, dict):
                raise ConfigError(f"agent_defaults: expected a table, got {type(defaults).__name__}")
            agents = raw.get("agents", [])
            if not isinstance(agents, list) or not all(isinstance(a, dict) for a in agents):
                raise ConfigError("agents: expected an array of tables ([[agents]] in TOML)")
            raw["agents"] = [_merged(defaults, agent) for agent in agents]
        return from_table(cls, raw, "")

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
        """Read a TOML file; ``overrides`` (``{"train.steps": 3}``) replace single settings."""
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read experiment config {path}: {exc}") from exc
        for dotted, value in (overrides or {}).items():
            table = raw
            *parents, leaf = dotted.split(".")
            for part in parents:
                table = table.setdefault(part, {})
            table[leaf] = value
        return cls.from_dict(raw)


def _merged(defaults: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``table``'s keys on top, nested tables merged the same way."""
    out = dict(defaults)
    for key, value in table.items():
        base = out.get(key)
        out[key] = _merged(base, value) if isinstance(base, dict) and isinstance(value, dict) else value
    return out


__all__ = ["EnvSetup", "EvalConfig", "ExperimentConfig", "OutputConfig", "RuntimeSetup", "TrainConfig"]
