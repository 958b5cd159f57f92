"""GRPO: advantages relative to a group of episodes that started from the same state.

The loop plays ``group_size`` episodes per seed; each agent's turns are grouped by (agent, role,
seed), so advantages are normalised per agent and per role: ``(score - group mean) / (group std
+ eps)``. A group whose members all scored the same teaches nothing and drops out. The loss is
``importance_sampling`` (the policy gradient, corrected for any staleness of the sampler).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from polytinker.agents.algorithms.base import Algorithm, turn_scores
from polytinker.agents.types import TurnSample

EPS = 1e-6


class GRPO(Algorithm):
    def advantages(self, samples: Sequence[TurnSample]) -> np.ndarray:
        scores_N = turn_scores(samples, self.config)
        groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            groups[(s.agent, s.role, s.group)].append(i)
        advantages_N = np.zeros(len(samples))
        for members in groups.values():
            scores_G = scores_N[members]
            centred_G = scores_G - scores_G.mean()
            if self.config.normalize_advantages:
                centred_G = centred_G / (scores_G.std() + EPS)
            advantages_N[members] = np.where(np.abs(centred_G) < 1e-9, 0.0, centred_G)
        return advantages_N


__all__ = ["GRPO"]
