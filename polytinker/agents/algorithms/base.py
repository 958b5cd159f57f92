"""The shared part of the RL algorithms: scores, datums, minibatches, loss settings.

An algorithm turns one agent's ``TurnSample``s into advantages (``advantages``, the part each
algorithm defines) and then into minibatches of datums for ``forward_backward``. Token weights
are ``1 / (action tokens in the minibatch)``, so the summed loss the learner computes is the
per-token mean, and the learning rate means the same whatever the batch size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from polytinker.agents.render import turn_datum
from polytinker.agents.spec import AlgorithmConfig
from polytinker.agents.types import TurnSample
from polytinker.engine.types import Datum


def turn_scores(samples: Sequence[TurnSample], config: AlgorithmConfig) -> np.ndarray:
    """The score of each turn: the episode's total reward, or the discounted return from the turn."""
    if config.reward_mode == "episode":
        return np.array([s.episode_reward for s in samples], dtype=np.float64)
    by_role: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_role[(s.episode_id, s.role)].append(i)
    scores_N = np.zeros(len(samples))
    for indices in by_role.values():
        running = 0.0
        for i in sorted(indices, key=lambda j: samples[j].turn_index, reverse=True):
            running = samples[i].reward + config.gamma * running
            scores_N[i] = running
    return scores_N


class Algorithm:
    """Base of the RL algorithms; subclasses define ``advantages`` and may keep state."""

    loss_fn = "importance_sampling"

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    def advantages(self, samples: Sequence[TurnSample]) -> np.ndarray:
        raise NotImplementedError

    def loss_fn_config(self) -> dict[str, float]:
        return {"kl_coef": self.config.kl_coef}

    def minibatches(self, samples: Sequence[TurnSample], advantages_N: np.ndarray, seed: int) -> list[list[Datum]]:
        """``epochs`` passes of ``minibatches`` parts each; each part is one optimizer step.
        Samples whose advantage is 0 teach nothing and are left out (they still cost compute)."""
        useful = [i for i in range(len(samples)) if advantages_N[i] != 0.0 and samples[i].completion_tokens]
        if not useful:
            return []
        rng = np.random.default_rng(seed)
        batches: list[list[Datum]] = []
        for _ in range(self.config.epochs):
            order = rng.permutation(useful) if self.config.minibatches > 1 else np.array(useful)
            for part in np.array_split(order, min(self.config.minibatches, len(useful))):
                tokens = sum(len(samples[i].completion_tokens) for i in part)
                batches.append(
                    [
                        turn_datum(
                            samples[i].prompt_tokens,
                            samples[i].completion_tokens,
                            samples[i].logprobs_T,
                            float(advantages_N[i]),
                            1.0 / tokens,
                        )
                        for i in part
                    ]
                )
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


__all__ = ["Algorithm", "turn_scores"]
