"""Per-row sampling for a batch whose rows each carry their own parameters.

Each row has a temperature, top-k, top-p and its own ``torch.Generator``, so a seeded request
draws the same tokens whatever else shares its batch. Sampling inverts each row's cumulative
distribution at one uniform draw from the row's generator: an exact draw from ``p`` with the
arithmetic batched and one random number per row and step. (A draw per vocabulary entry, as in
the exponential race ``argmax(log p - log E)``, costs a vocabulary's worth of generator calls a
row: on a CPU that was most of a 64-sequence batch's time.)

A row with ``choices`` (``SamplingParams.choices``) draws a whole choice (``pick_choice``) from
the summed logprobs the engine scores for each of them after its prompt.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from polytinker.engine.types import SamplingParams


@dataclass
class RowSampler:
    """The sampling state of one generated sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows (temperature 0)


def make_row_sampler(params: SamplingParams, index: int) -> RowSampler:
    """Sampler for sequence ``index`` (of ``params.n``) of a request. A seeded request's
    sequences get distinct, reproducible streams derived from (seed, index)."""
    if params.temperature == 0:
        return RowSampler(params, None)
    if params.seed is None:
        seed = secrets.randbits(63)
    else:
        seed = int(np.random.SeedSequence([params.seed, index]).generate_state(1, np.uint64)[0] >> 1)
    return RowSampler(params, torch.Generator().manual_seed(seed))


def pick_choice(logprobs_K: Sequence[float], sampler: RowSampler) -> int:
    """Which of a row's choices it takes, from each choice's summed logprob: the likeliest for a
    greedy row, else a draw from ``softmax(logprob / temperature)`` with the row's generator (the
    model's distribution conditioned on the answer being one of the choices, at temperature 1)."""
    scores_K = torch.tensor(list(logprobs_K), dtype=torch.float64)
    if sampler.generator is None:
        return int(scores_K.argmax())
    noise_K = torch.empty_like(scores_K).exponential_(generator=sampler.generator)
    return int((scores_K / sampler.params.temperature - noise_K.log()).argmax())


def choice_slices(prompt_len: int, choices: Sequence[Sequence[int]], budget: int, logits: int) -> list[range]:
    """A row's choices in slices of at most ``budget`` cached positions (each choice costs its
    prompt's and its own) and ``logits`` choice tokens (each a vocabulary-wide row of logits): one
    slice unless the choices are very many or the prompt long."""
    longest = max(map(len, choices))
    per = max(1, min(budget // (prompt_len + longest), logits // longest))
    return [range(i, min(i + per, len(choices))) for i in range(0, len(choices), per)]


def _filter_top_k_top_p(logits_RV: torch.Tensor, top_k_R: torch.Tensor, top_p_R: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p (nucleus) sets."""
    sorted_RV, order_RV = logits_RV.sort(dim=-1, descending=True)
    ranks_V = torch.arange(logits_RV.shape[-1])
    drop_RV = (top_k_R[:, None] > 0) & (ranks_V[None, :] >= top_k_R[:, None])
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    probs_RV = sorted_RV.softmax(dim=-1)
    # Keep a token while the probability mass before it is below top_p: the top token always stays.
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    sorted_RV = sorted_RV.masked_fill(mass_before_RV >= top_p_R[:, None], float("-inf"))
    return torch.full_like(logits_RV, float("-inf")).scatter(-1, order_RV, sorted_RV)


def choose_tokens(logits_BV: torch.Tensor, samplers: Sequence[RowSampler]) -> torch.Tensor:
    """One next token per row: greedy rows take the argmax, the others sample from their
    temperature-scaled, top-k/top-p filtered distribution with their own generator."""
    sampled = [i for i, s in enumerate(samplers) if s.generator is not None]
    if len(sampled) < len(samplers):
        tokens_B = logits_BV.argmax(dim=-1)
    else:
        tokens_B = torch.zeros(len(samplers), dtype=torch.long)
    if not sampled:
        return tokens_B
    index_R = torch.tensor(sampled)
    temperature_R = torch.tensor([samplers[i].params.temperature for i in sampled], dtype=logits_BV.dtype)
    logits_RV = logits_BV[index_R] / temperature_R[:, None]
    top_k_R = torch.tensor([samplers[i].params.top_k for i in sampled])
    top_p_R = torch.tensor([samplers[i].params.top_p for i in sampled], dtype=logits_BV.dtype)
    if bool((top_k_R > 0).any()) or bool((top_p_R < 1).any()):
        logits_RV = _filter_top_k_top_p(logits_RV, top_k_R, top_p_R)
    # A token is drawn where the row's cumulative mass first exceeds u * total, u ~ U[0, 1): a
    # token of zero mass (filtered out) adds nothing to the sum, so it is never the first.
    cumulative_RV = logits_RV.softmax(dim=-1).cumsum(dim=-1)
    u_R = torch.cat([torch.rand(1, generator=samplers[i].generator, dtype=cumulative_RV.dtype) for i in sampled])
    drawn_R = torch.searchsorted(cumulative_RV, (u_R * cumulative_RV[:, -1])[:, None], right=True)[:, 0]
    tokens_B[index_R] = drawn_R.clamp(max=logits_BV.shape[-1] - 1)
    return tokens_B


__all__ = ["RowSampler", "choice_slices", "choose_tokens", "make_row_sampler", "pick_choice"]
