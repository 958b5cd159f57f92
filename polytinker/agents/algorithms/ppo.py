"""PPO-clip: the ``ppo`` loss, with importance ratios against the sampling logprobs.

There is no value network (a second LLM head would double the learner's work on a CPU): the
advantage is the score minus the mean of the same (agent, role, group), as in GRPO, or minus the
batch mean when a group holds a single episode (its turns cannot be compared with each other).
The batch is used for ``epochs`` passes of ``minibatches`` optimizer steps; after the first step
the ratios move away from 1 and the clip at ``1 +- clip_epsilon`` bounds how far one batch can
push the policy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from polytinker.agents.algorithms.base import Algorithm, turn_scores
from polytinker.agents.types import TurnSample


class PPO(Algorithm):
    loss_fn = "ppo"

    def advantages(self, samples: Sequence[TurnSample]) -> np.ndarray:
        scores_N = turn_scores(samples, self.config)
        groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            groups[(s.agent, s.role, s.group)].append(i)
        advantages_N = scores_N - scores_N.mean()
        for members in groups.values():
            if len({samples[i].episode_id for i in members}) > 1:
                advantages_N[members] = scores_N[members] - scores_N[members].mean()
        if self.config.normalize_advantages and advantages_N.std() > 1e-9:
            advantages_N = advantages_N / advantages_N.std()
        return advantages_N

    def loss_fn_config(self) -> dict[str, float]:
        return {"kl_coef": self.config.kl_coef, "clip_epsilon": self.config.clip_epsilon}


__all__ = ["PPO"]
