"""Per-row sampling for a batch whose rows each carry their own parameters.

Each row has a temperature, top-k, top-p and its own ``torch.Generator``, so a seeded request
draws the same tokens whatever else shares its batch. Sampling inverts each row's cumulative
distribution at one uniform draw from the row's generator: an exact draw from ``p`` with the
arithmetic batched and one random number per row and step. (A draw per vocabulary entry, as in
the exponential race ``argmax(log p - log E)``, costs a vocabulary's worth of generator calls a
row: on a CPU that was most of a 64-sequence batch's time.)

The inversion runs in two levels (``_inverse_cdf``): block sums of each row's weights find the
block where the drawn mass lies, and a cumulative sum of that block alone finds the token, the
token a cumulative sum over the whole vocabulary finds. With the weights ``exp(logit - max)``
shared by the draw and the token's logprob (``sample_tokens``), a step reads the vocabulary's
logits a few times instead of a dozen (64 rows of 49,152 logits on one thread: 25 -> 3.6 ms).

A row with ``choices`` (``SamplingParams.choices``) draws a whole choice (``pick_choice``) from
the summed logprobs the engine scores for each of them after its prompt.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
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
    """Sampler for sequence ``index`` (of the request's ``num_samples``). A seeded request's
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


# Vocabulary entries per block of the two-level inverse CDF: about the square root of a
# vocabulary of 50-150 thousand, so the block sums and one block's cumulative sum are both small.
_BLOCK = 256


def _by_block(x_RV: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Each row's entries reduced (``torch.sum``, ``torch.amax``) by blocks of ``_BLOCK`` (the last block
    may be shorter)."""
    rows, vocab = x_RV.shape
    whole = vocab // _BLOCK
    out_RN = reduce(x_RV[:, : whole * _BLOCK].reshape(rows, whole, _BLOCK), dim=-1)
    if vocab > whole * _BLOCK:
        out_RN = torch.cat([out_RN, reduce(x_RV[:, whole * _BLOCK :], dim=-1, keepdim=True)], dim=1)
    return out_RN


def _block(x_RV: torch.Tensor, block_R: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block ``block_R`` (``fill`` past the vocabulary) and the vocabulary index of its first entry."""
    vocab = x_RV.shape[-1]
    index_RK = block_R[:, None] * _BLOCK + torch.arange(_BLOCK)
    return x_RV.gather(1, index_RK.clamp(max=vocab - 1)).masked_fill(index_RK >= vocab, fill), block_R * _BLOCK


def _argmax(logits_RV: torch.Tensor, max_R1: torch.Tensor) -> torch.Tensor:
    """Each row's first entry equal to its maximum ``max_R1``, as ``argmax`` finds it, by blocks:
    the first block whose maximum it is, then the first such entry in that block."""
    block_R = (_by_block(logits_RV, torch.amax) == max_R1).to(torch.uint8).argmax(dim=-1)
    inside_RK, start_R = _block(logits_RV, block_R, float("-inf"))
    return start_R + (inside_RK == max_R1).to(torch.uint8).argmax(dim=-1)


def _first_above(cumulative_RN: torch.Tensor, target_R: torch.Tensor, positive_RN: torch.Tensor) -> torch.Tensor:
    """Each row's first index whose cumulative weight exceeds its target, never past its last
    entry of positive weight: rounding may leave a target at the row's total, and an entry of no
    weight must never be drawn."""
    first_R = torch.searchsorted(cumulative_RN, target_R[:, None], right=True)[:, 0]
    index_N = torch.arange(cumulative_RN.shape[-1])
    last_R = torch.where(positive_RN, index_N, 0).amax(-1)
    return torch.minimum(first_R, last_R)


def _inverse_cdf(weights_RV: torch.Tensor, sums_RN: torch.Tensor, u_R: torch.Tensor) -> torch.Tensor:
    """Per row, the first entry where the cumulative weight exceeds ``u * total`` (``u`` in [0, 1),
    the weights non-negative, ``sums_RN`` their sums by block): entry ``t`` with probability
    ``weights[t] / total``. The cumulated block sums (in float64) locate the block that holds the
    mass ``u * total``, then that block's own cumulative sum the entry: the same entry a
    cumulative sum over the whole row locates, for one pass over the weights instead of two."""
    cumulative_RN = sums_RN.double().cumsum(dim=-1)
    target_R = u_R.double() * cumulative_RN[:, -1]
    block_R = _first_above(cumulative_RN, target_R, sums_RN > 0)
    before_R = cumulative_RN.gather(1, (block_R - 1).clamp(min=0)[:, None])[:, 0].masked_fill(block_R == 0, 0.0)
    inside_RK, start_R = _block(weights_RV, block_R, 0.0)
    return start_R + _first_above(inside_RK.double().cumsum(dim=-1), target_R - before_R, inside_RK > 0)


def _uniforms(samplers: Sequence[RowSampler], rows: list[int]) -> torch.Tensor:
    """One uniform draw in [0, 1) from each row's own generator."""
    return torch.cat([torch.rand(1, generator=samplers[i].generator) for i in rows])


def sample_tokens(logits_BV: torch.Tensor, samplers: Sequence[RowSampler]) -> tuple[torch.Tensor, torch.Tensor]:
    """One next token per row and its logprob under the model (the logits as they are, as a
    learner scores the token): greedy rows take the argmax, the others draw from their
    temperature-scaled, top-k/top-p filtered distribution with their own generator."""
    # In-place passes over one new tensor where possible: each new vocabulary-sized tensor costs
    # fresh pages, about as much as a pass of arithmetic over it.
    max_B1 = logits_BV.amax(dim=-1, keepdim=True)
    exp_BV = logits_BV.sub(max_B1).exp_()
    sums_BN = _by_block(exp_BV, torch.sum)
    logsumexp_B = max_B1[:, 0] + sums_BN.double().sum(dim=-1).log().to(logits_BV.dtype)
    tokens_B = torch.zeros(len(samplers), dtype=torch.long)
    greedy = [i for i, s in enumerate(samplers) if s.generator is None]
    if greedy:
        tokens_B[greedy] = _argmax(_view(logits_BV, greedy), max_B1[greedy])
    plain = [i for i, s in enumerate(samplers) if s.generator is not None and not _filters(s.params)]
    if plain:
        temperature_R1 = _temperatures(samplers, plain)
        if bool((temperature_R1 == 1).all()):  # the weights are exp_BV's rows: nothing to recompute
            weights_RV, sums_RN = _view(exp_BV, plain), sums_BN[plain]
        else:  # exp((logit - max) / T): the row's largest weight stays 1
            weights_RV = _rows(logits_BV, plain).sub_(max_B1[plain]).div_(temperature_R1).exp_()
            sums_RN = _by_block(weights_RV, torch.sum)
        tokens_B[plain] = _inverse_cdf(weights_RV, sums_RN, _uniforms(samplers, plain))
    filtered = [i for i, s in enumerate(samplers) if s.generator is not None and _filters(s.params)]
    if filtered:
        tokens_B[filtered] = _draw_filtered(logits_BV, samplers, filtered)
    logprobs_B = logits_BV.gather(1, tokens_B[:, None])[:, 0] - logsumexp_B
    return tokens_B, logprobs_B


def _draw_filtered(logits_BV: torch.Tensor, samplers: Sequence[RowSampler], rows: list[int]) -> torch.Tensor:
    """Tokens for ``rows``, each drawn from its temperature-scaled logits within its top-k and
    top-p sets (a token outside them weighs 0)."""
    top_k_R = torch.tensor([samplers[i].params.top_k for i in rows])
    top_p_R = torch.tensor([samplers[i].params.top_p for i in rows], dtype=logits_BV.dtype)
    scaled_RV = _rows(logits_BV, rows).div_(_temperatures(samplers, rows))
    kept_RV = _filter_top_k_top_p(scaled_RV, top_k_R, top_p_R)
    weights_RV = kept_RV.sub_(kept_RV.amax(dim=-1, keepdim=True)).exp_()
    return _inverse_cdf(weights_RV, _by_block(weights_RV, torch.sum), _uniforms(samplers, rows))


def _temperatures(samplers: Sequence[RowSampler], rows: list[int]) -> torch.Tensor:
    return torch.tensor([[samplers[i].params.temperature] for i in rows])


def _view(x_BV: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``rows`` of ``x_BV``, to be read: ``x_BV`` itself when they are all its rows."""
    return x_BV if len(rows) == len(x_BV) else x_BV[rows]


def _rows(x_BV: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of ``rows`` of ``x_BV``, to be changed in place."""
    return x_BV.clone() if len(rows) == len(x_BV) else x_BV[rows]


def _filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1


__all__ = ["RowSampler", "choice_slices", "make_row_sampler", "pick_choice", "sample_tokens"]
