"""The shared part of the RL algorithms: scores, datums, minibatches, loss settings.

An algorithm turns one agent's ``TurnSample``s into advantages (``advantages``, the part each
algorithm defines) and then into minibatches of datums for ``forward_backward``. Token weights
are ``1 / (action tokens in the minibatch)``, so the summed loss the learner computes is the
per-token mean, and the learning rate means the same whatever the batch size.

Multi-turn episodes: when each turn's prompt extends the previous turn's prompt and completion
(the renderer continues the history token by token), the turns form a *chain* and become one
datum: the last turn's tokens, with weight on every turn's sampled tokens and each turn's own
advantage on them. The learner scores the trajectory once instead of once per turn with the
whole history again; the loss is the same, since each position sees the same prefix either way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from polytinker.agents.render import DatumBuilder
from polytinker.agents.spec import AlgorithmConfig
from polytinker.agents.types import TurnSample
from polytinker.types import Datum


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


def turn_chains(samples: Sequence[TurnSample], *, merge: bool = True) -> list[list[int]]:
    """The samples' indices as chains: the turns of one role in one episode, in order, cut where
    a turn's prompt does not extend the previous turn's prompt + completion. ``merge=False``:
    every turn alone. Chains come in the order of their first sample."""
    if not merge:
        return [[i] for i in range(len(samples))]
    by_role: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_role[(s.episode_id, s.role)].append(i)
    chains: list[list[int]] = []
    for indices in by_role.values():
        chain: list[int] = []
        for i in sorted(indices, key=lambda j: samples[j].turn_index):
            if chain and not _extends(samples[chain[-1]], samples[i]):
                chains.append(chain)
                chain = []
            chain.append(i)
        chains.append(chain)
    return sorted(chains, key=lambda c: min(c))


def _extends(before: TurnSample, after: TurnSample) -> bool:
    n, m = len(before.prompt_tokens), len(before.completion_tokens)
    prompt = after.prompt_tokens
    return len(prompt) >= n + m and prompt[:n] == before.prompt_tokens and prompt[n : n + m] == before.completion_tokens


def _trim(chain: list[int], useful: set[int]) -> list[int]:
    """The chain up to its last useful turn (the turns after it would add tokens, no gradient)."""
    last = max((k for k, i in enumerate(chain) if i in useful), default=-1)
    return chain[: last + 1]


def chain_datum(
    samples: Sequence[TurnSample], chain: Sequence[int], advantages_N: np.ndarray, useful: set[int], weight: float
) -> Datum:
    """One datum for a chain of turns: the observations between turns shown (weight 0), each
    useful turn's sampled tokens with its advantage and ``weight``, the other turns' weight 0."""
    first = samples[chain[0]]
    builder = DatumBuilder(first.prompt_tokens)
    for i in chain:
        s = samples[i]
        builder.shown(s.prompt_tokens[len(builder.tokens) :])
        mine = i in useful
        builder.sampled(
            s.completion_tokens,
            s.logprobs_T,
            float(advantages_N[i]) if mine else 0.0,
            weight if mine else 0.0,
            s.sampled_T,
        )
    return builder.datum()


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
        Samples whose advantage is 0 teach nothing and are left out (they still cost compute);
        in a chain they keep their place (the later turns read them) with weight 0."""
        useful = {i for i in range(len(samples)) if advantages_N[i] != 0.0 and samples[i].sampled_tokens}
        chains = [_trim(chain, useful) for chain in turn_chains(samples, merge=self.config.merge_turns)]
        chains = [chain for chain in chains if chain]
        if not chains:
            return []
        rng = np.random.default_rng(seed)
        batches: list[list[Datum]] = []
        for _ in range(self.config.epochs):
            order = rng.permutation(len(chains)) if self.config.minibatches > 1 else np.arange(len(chains))
            for part in np.array_split(order, min(self.config.minibatches, len(chains))):
                tokens = sum(samples[i].sampled_tokens for c in part for i in chains[c] if i in useful)
                batches.append([chain_datum(samples, chains[c], advantages_N, useful, 1.0 / tokens) for c in part])
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


__all__ = ["Algorithm", "chain_datum", "turn_chains", "turn_scores"]
