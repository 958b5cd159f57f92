"""REINFORCE with a baseline: an exponential moving average of each (agent, role)'s scores.

The baseline is updated after the advantages of a batch are taken (so a batch never baselines
itself) and is saved with the checkpoints. Advantages are optionally divided by the batch's std.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from polytinker.agents.algorithms.base import Algorithm, turn_scores
from polytinker.agents.types import TurnSample


class Reinforce(Algorithm):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.baselines: dict[str, float] = {}

    def advantages(self, samples: Sequence[TurnSample]) -> np.ndarray:
        scores_N = turn_scores(samples, self.config)
        keys_N = np.array([f"{s.agent}/{s.role}" for s in samples])
        advantages_N = np.zeros(len(samples))
        for key in set(keys_N.tolist()):
            members = keys_N == key
            mean = float(scores_N[members].mean())
            old = self.baselines.get(key)
            # The first batch of a key has no baseline yet: its own mean starts one.
            advantages_N[members] = scores_N[members] - (mean if old is None else old)
            decay = self.config.baseline_decay
            self.baselines[key] = mean if old is None else decay * old + (1 - decay) * mean
        if self.config.normalize_advantages and advantages_N.std() > 1e-9:
            advantages_N = advantages_N / advantages_N.std()
        return advantages_N

    def state_dict(self) -> dict[str, Any]:
        return {"baselines": dict(self.baselines)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baselines = {str(k): float(v) for k, v in state.get("baselines", {}).items()}


__all__ = ["Reinforce"]
