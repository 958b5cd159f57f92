"""The hf backend's per-row sampler (``_sampling.sample_tokens``): every row draws exactly from its
own temperature-scaled, top-k/top-p filtered distribution, reports the model's logprob of the
token, and a seeded row draws the same tokens whatever shares its batch. No model: fixed logits."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from polytinker.engine.inference._sampling import _BLOCK, _inverse_cdf, make_row_sampler, sample_tokens
from polytinker.engine.types import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Small tensors: one thread (threads on shared cores wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# 300 entries: one whole block and a shorter last one, so both levels and the tail are exercised.
VOCAB = 300


def _logits() -> torch.Tensor:
    """A fixed distribution with a long tail, two entries that can never be drawn, and a likely
    entry in the shorter last block."""
    g = torch.Generator().manual_seed(0)
    logits_V = torch.randn(VOCAB, generator=g) * 1.5
    logits_V[VOCAB - 10] = 3.0
    logits_V[[3, 200]] = float("-inf")
    return logits_V


def _expected(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities ``params`` asks for, computed plainly over the whole vocabulary in float64:
    the top-k entries, then those within top-p of what is left, likeliest first."""
    probs_V = (logits_V.double() / params.temperature).softmax(-1)
    order = probs_V.argsort(descending=True)
    if params.top_k:
        probs_V[order[params.top_k :]] = 0.0
        probs_V /= probs_V.sum()
    kept_V = torch.zeros(VOCAB, dtype=torch.double)
    mass = 0.0
    for t in order.tolist():
        if params.top_p < 1 and mass >= params.top_p:
            break
        kept_V[t] = probs_V[t]
        mass += float(probs_V[t])
    return kept_V / kept_V.sum()


def _draw(logits_V: torch.Tensor, params: SamplingParams, rows: int, steps: int) -> Counter[int]:
    """Tokens of ``rows`` seeded rows over ``steps`` draws each, counted."""
    samplers = [make_row_sampler(params, k) for k in range(rows)]
    counts: Counter[int] = Counter()
    for _ in range(steps):
        tokens_B, _ = sample_tokens(logits_V.expand(rows, VOCAB).contiguous(), samplers)
        counts.update(tokens_B.tolist())
    return counts


def _chi_square(counts: Counter[int], probs_V: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, bins of fewer than 5 expected merged."""
    n = sum(counts.values())
    stat, dof, small_expected, small_seen = 0.0, -1, 0.0, 0
    for t in range(VOCAB):
        expected = n * float(probs_V[t])
        if expected == 0:
            continue
        if expected < 5:
            small_expected, small_seen = small_expected + expected, small_seen + counts[t]
            continue
        stat, dof = stat + (counts[t] - expected) ** 2 / expected, dof + 1
    if small_expected:
        stat, dof = stat + (small_seen - small_expected) ** 2 / small_expected, dof + 1
    return stat, dof


def _critical(dof: int, z: float = 3.72) -> float:
    """The chi-square quantile at the normal quantile ``z`` (3.72: p = 1e-4), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.5, seed=2),
        SamplingParams(temperature=1.3, top_k=20, seed=3),
        SamplingParams(temperature=0.8, top_p=0.7, seed=4),
    ],
    ids=["plain", "temperature", "top_k", "top_p"],
)
def test_draws_follow_the_rows_distribution(params: SamplingParams) -> None:
    """30000 seeded draws pass a chi-square test against the distribution computed plainly (and
    fail it against the distribution at another temperature: the test can tell them apart); a
    token of no probability (filtered out, or of logit -inf) is never drawn."""
    logits_V = _logits()
    counts = _draw(logits_V, params, rows=200, steps=150)
    probs_V = _expected(logits_V, params)
    stat, dof = _chi_square(counts, probs_V)
    assert stat < _critical(dof), f"chi-square {stat:.1f} over {dof} degrees of freedom"
    assert all(probs_V[t] > 0 for t in counts), "a token of no probability was drawn"
    other = _expected(
        logits_V, SamplingParams(temperature=params.temperature * 1.25, top_k=params.top_k, top_p=params.top_p)
    )
    assert _chi_square(counts, other)[0] > 3 * _critical(dof)


def test_the_two_level_inversion_finds_the_entry_a_whole_cumulative_sum_finds() -> None:
    """Per row and uniform draw, the entry where the float64 cumulative sum over the whole row
    first exceeds u x total: across whole and partial blocks, leading zeros, a block of zeros, and
    u = 0 and u close to 1; never an entry of no weight."""
    g = torch.Generator().manual_seed(5)
    for vocab in (3 * _BLOCK, 3 * _BLOCK + 37):
        weights_RV = torch.rand(64, vocab, generator=g) ** 4
        weights_RV[:, :3] = 0.0
        weights_RV[:8, _BLOCK : 2 * _BLOCK] = 0.0
        weights_RV[8:16, -1] = 0.0
        u_R = torch.rand(64, generator=g)
        u_R[0], u_R[1] = 0.0, 1.0 - 2**-24
        sums_RN = torch.stack([part.sum(-1) for part in weights_RV.split(_BLOCK, dim=1)], dim=1)
        drawn_R = _inverse_cdf(weights_RV, sums_RN, u_R)
        cumulative_RV = weights_RV.double().cumsum(-1)
        target_R = u_R.double() * cumulative_RV[:, -1]
        reference_R = torch.searchsorted(cumulative_RV, target_R[:, None], right=True)[:, 0]
        # Where the target lies within rounding of an entry's edge either neighbour is right.
        edge_R = (cumulative_RV - target_R[:, None]).abs().amin(-1) < 1e-9 * cumulative_RV[:, -1]
        assert torch.equal(drawn_R[~edge_R], reference_R[~edge_R])
        assert bool((weights_RV.gather(1, drawn_R[:, None]) > 0).all())


def test_logprobs_are_the_models_and_greedy_rows_take_the_first_maximum() -> None:
    """Rows of every kind in one batch: each token's logprob is log_softmax of the logits as they
    are (not scaled or filtered), and a greedy row takes what ``argmax`` takes, the first of tied
    maxima, in a whole block or in the shorter last one."""
    logits_V = _logits()
    logits_BV = logits_V.expand(6, VOCAB).clone()
    logits_BV[0, VOCAB - 10] = 9.0
    logits_BV[1, [7, VOCAB - 3]] = 9.0  # tied: the first one wins
    logits_BV[2, VOCAB - 3] = 9.0  # the maximum alone, in the last block
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=1),
    ]
    tokens_B, logprobs_B = sample_tokens(logits_BV, [make_row_sampler(p, 0) for p in kinds])
    assert tokens_B[:3].tolist() == logits_BV[:3].argmax(-1).tolist() == [VOCAB - 10, 7, VOCAB - 3]
    expected_B = logits_BV.log_softmax(-1).gather(1, tokens_B[:, None])[:, 0]
    assert logprobs_B.tolist() == pytest.approx(expected_B.tolist(), abs=1e-5)


def test_seeded_rows_repeat_and_ignore_their_batch_mates() -> None:
    """The same seeded request draws the same tokens again, alone or among rows of other kinds;
    its samples (one stream each) differ from each other."""
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(8, 4 * _BLOCK + 5, generator=g) * 2 for _ in range(12)]
    params = SamplingParams(temperature=0.9, seed=42)
    others = [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(temperature=1.0)]

    def run(mates: bool) -> list[list[int]]:
        mine = [make_row_sampler(params, k) for k in range(3)]
        samplers = [*mine, *[make_row_sampler(p, 0) for p in others]] if mates else mine
        return [sample_tokens(s[: len(samplers)], samplers)[0][:3].tolist() for s in steps]

    alone = run(mates=False)
    assert alone == run(mates=False) == run(mates=True)
    assert len({tuple(step[k] for step in alone) for k in range(3)}) == 3
