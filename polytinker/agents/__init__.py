"""polytinker.agents: agent specs, policy mapping, prompt rendering, algorithms, the training loop.

- ``AgentSpec`` (with ``AdapterSpec``, ``AlgorithmConfig``, ``SamplingConfig``, ``RendererConfig``).
- ``MappingConfig`` / ``PolicyMapping``: independent agents, self-play, frozen and scripted
  opponents, a league of past versions.
- ``Renderer``: chat-template prompts with per-agent multi-turn history; observation tokens get
  weight 0 in the datums.
- Algorithms: ``GRPO``, ``PPO``, ``Reinforce``; SFT from JSONL conversations (``train_sft``).
- ``Experiment`` / ``ExperimentConfig`` (TOML): the training loop, sync or async, with evaluation
  against scripted opponents, metrics, transcripts, curves and checkpoints (``resume``).
- ``CrossPlay``: after training, the final agents against the frozen ones and each other
  (wins, draws, losses) and an Elo per player (``elo_ratings``), in the run's ``crossplay.json``.
- ``ServiceClientLike``, ``TrainingClientLike``, ``SamplingClientLike``: the client calls the loop
  makes (``polytinker.agents.protocols``), which ``polytinker.client``'s clients satisfy.

See docs/training.md.
"""

from polytinker.agents.algorithms import GRPO, PPO, Algorithm, Reinforce, make_algorithm
from polytinker.agents.config import (
    EnvSetup,
    EvalConfig,
    ExperimentConfig,
    OutputConfig,
    RuntimeSetup,
    TrainConfig,
)
from polytinker.agents.crossplay import CrossPlay, Record, elo_ratings
from polytinker.agents.experiment import Experiment, RunSummary
from polytinker.agents.mapping import MappingConfig, PolicyMapping
from polytinker.agents.protocols import SamplingClientLike, ServiceClientLike, TrainingClientLike
from polytinker.agents.render import Renderer, turn_datum
from polytinker.agents.sft_run import train_sft
from polytinker.agents.spec import AdapterSpec, AgentSpec, AlgorithmConfig, RendererConfig, SamplingConfig
from polytinker.agents.types import (
    AgentName,
    AlgorithmName,
    LoopMode,
    MappingKind,
    Slot,
    SlotKind,
    StepRecord,
    TurnSample,
)

__all__ = [
    "GRPO",
    "PPO",
    "AdapterSpec",
    "AgentName",
    "AgentSpec",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmName",
    "CrossPlay",
    "EnvSetup",
    "EvalConfig",
    "Experiment",
    "ExperimentConfig",
    "LoopMode",
    "MappingConfig",
    "MappingKind",
    "OutputConfig",
    "PolicyMapping",
    "Record",
    "Reinforce",
    "Renderer",
    "RendererConfig",
    "RunSummary",
    "RuntimeSetup",
    "SamplingClientLike",
    "SamplingConfig",
    "ServiceClientLike",
    "Slot",
    "SlotKind",
    "StepRecord",
    "TrainConfig",
    "TrainingClientLike",
    "TurnSample",
    "elo_ratings",
    "make_algorithm",
    "train_sft",
    "turn_datum",
]
