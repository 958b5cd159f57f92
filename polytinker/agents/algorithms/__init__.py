"""The learning algorithms: GRPO, PPO-clip, REINFORCE with a baseline, and SFT.

``make_algorithm(config)`` returns the RL algorithm a ``AlgorithmConfig`` names; SFT has no
advantages and is run by the loop from ``sft_batches``.
"""

from __future__ import annotations

from polytinker.agents.algorithms.base import Algorithm, turn_scores
from polytinker.agents.algorithms.grpo import GRPO
from polytinker.agents.algorithms.ppo import PPO
from polytinker.agents.algorithms.reinforce import Reinforce
from polytinker.agents.algorithms.sft import read_conversations, sft_batches
from polytinker.agents.spec import AlgorithmConfig
from polytinker.agents.types import AlgorithmName
from polytinker.errors import ConfigError

_RL = {AlgorithmName.GRPO: GRPO, AlgorithmName.PPO: PPO, AlgorithmName.REINFORCE: Reinforce}


def make_algorithm(config: AlgorithmConfig) -> Algorithm:
    cls = _RL.get(config.name)
    if cls is None:
        raise ConfigError(f"{config.name} is not an RL algorithm; choose one of {[a.value for a in _RL]}")
    return cls(config)


__all__ = [
    "GRPO",
    "PPO",
    "Algorithm",
    "Reinforce",
    "make_algorithm",
    "read_conversations",
    "sft_batches",
    "turn_scores",
]
