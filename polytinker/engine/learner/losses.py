"""Batching of Tinker datums and the built-in losses.

Normalisation: every loss is a **sum over tokens** (as in Tinker), each token multiplied by its
``weights_T`` entry, so weight 0 keeps prompt and observation tokens out of the loss and its
gradient. The learner can divide the accumulated gradient by the weighted-token count at
``optim_step`` instead (``LearnerConfig.grad_normalization="per_token"``); the loss values reported
per call stay sums either way.

- ``cross_entropy``: ``-sum(w * logp)``.
- ``importance_sampling``: ``-sum(w * exp(logp - sampling_logp) * advantage)``; its gradient is the
  off-policy-corrected policy gradient.
- ``ppo``: ``-sum(w * min(r * A, clip(r, low, high) * A))`` with ``r = exp(logp - sampling_logp)``.
- ``cispo``: ``-sum(w * sg(clip(r, low, high)) * A * logp)``: the clipped ratio weighs the
  log-likelihood gradient and is not itself differentiated (``sg``), so clipped tokens still learn.
- ``dro``: ``-sum(w * (logp * A - beta / 2 * (logp - sampling_logp)^2))``: a quadratic penalty
  keeps the policy near the sampler's (``loss_fn_config={"beta": ...}``).
- KL against the base model (any loss, when ``kl_coef > 0``): ``kl_coef * sum(w * k3)`` with the
  non-negative estimator ``k3 = exp(ref - logp) - (ref - logp) - 1``.

Shapes in names: ``_B`` batch, ``_T`` token position, ``_V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polytinker.engine.learner.config import LossConfig
from polytinker.engine.types import LOSS_FNS, Datum, LossFnName
from polytinker.errors import ConfigError


@dataclass
class Batch:
    """Datums padded on the right to one length ``T``; padded positions carry weight 0."""

    input_ids_BT: torch.Tensor  # int64
    attention_mask_BT: torch.Tensor  # int64, 1 on real tokens
    targets_BT: torch.Tensor  # int64
    weights_BT: torch.Tensor  # float32
    advantages_BT: torch.Tensor  # float32, zeros where a datum has none
    sampling_logprobs_BT: torch.Tensor  # float32, zeros where a datum has none
    lengths_B: list[int]

    def rows(self, index_R: list[int]) -> Batch:
        """The sub-batch of rows ``index_R`` (same padded length)."""
        idx = torch.tensor(index_R, dtype=torch.int64, device=self.input_ids_BT.device)
        return Batch(
            input_ids_BT=self.input_ids_BT.index_select(0, idx),
            attention_mask_BT=self.attention_mask_BT.index_select(0, idx),
            targets_BT=self.targets_BT.index_select(0, idx),
            weights_BT=self.weights_BT.index_select(0, idx),
            advantages_BT=self.advantages_BT.index_select(0, idx),
            sampling_logprobs_BT=self.sampling_logprobs_BT.index_select(0, idx),
            lengths_B=[self.lengths_B[i] for i in index_R],
        )


def collate(data: list[Datum], *, pad_token_id: int = 0, device: torch.device | str = "cpu") -> Batch:
    """Pad datums into tensors on ``device``."""
    if not data:
        raise ConfigError("a learner call needs at least one Datum")
    lengths_B = [len(d.input_tokens) for d in data]
    if min(lengths_B) == 0:
        raise ConfigError("every Datum needs at least one input token")
    B, T = len(data), max(lengths_B)

    def pad(rows: Sequence[Sequence[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, T), fill, dtype=dtype)
        for b, row in enumerate(rows):
            out[b, : len(row)] = torch.tensor(row, dtype=dtype)
        return out.to(device)

    def optional(name: str) -> list[list[float]]:
        return [getattr(d, name) or [0.0] * len(d.input_tokens) for d in data]

    return Batch(
        input_ids_BT=pad([d.input_tokens for d in data], pad_token_id, torch.int64),
        attention_mask_BT=pad([[1] * n for n in lengths_B], 0, torch.int64),
        targets_BT=pad([d.target_tokens_T for d in data], 0, torch.int64),
        weights_BT=pad([d.weights_T for d in data], 0.0, torch.float32),
        advantages_BT=pad(optional("advantages_T"), 0.0, torch.float32),
        sampling_logprobs_BT=pad(optional("sampling_logprobs_T"), 0.0, torch.float32),
        lengths_B=lengths_B,
    )


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target_t | tokens <= t) for every position, in float32 (cross_entropy fuses the log-softmax)."""
    B, T, V = logits_BTV.shape
    nll = F.cross_entropy(logits_BTV.float().reshape(B * T, V), targets_BT.reshape(B * T), reduction="none")
    return -nll.reshape(B, T)


def _sampler_gap(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """How far the learner's logprobs are from the sampler's on the trained tokens (sums): the
    importance ratio, the absolute logprob gap, and k3 = r - 1 - log r, an estimate of
    KL(sampler || learner) from the sampler's tokens. A bfloat16 sampler and a float32 learner
    differ even at the same weights; these say by how much."""
    ratio_BT = torch.exp(log_ratio_BT)
    return {
        "ratio_sum": float((ratio_BT * mask_BT).sum()),
        "gap_abs_sum": float((log_ratio_BT.abs() * mask_BT).sum()),
        "sampler_kl_sum": float(((ratio_BT - 1.0 - log_ratio_BT) * mask_BT).sum()),
    }


def policy_loss(
    loss_fn: LossFnName, logprobs_BT: torch.Tensor, batch: Batch, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed loss of one micro-batch and its diagnostics (sums, so they add across calls)."""
    w_BT = batch.weights_BT
    if loss_fn == "cross_entropy":
        return -(w_BT * logprobs_BT).sum(), {}
    ratio_BT = torch.exp(logprobs_BT - batch.sampling_logprobs_BT)
    adv_BT = batch.advantages_BT
    mask_BT = (w_BT != 0).float()
    sums = _sampler_gap(logprobs_BT.detach() - batch.sampling_logprobs_BT, mask_BT)
    if loss_fn == "importance_sampling":
        return -(w_BT * ratio_BT * adv_BT).sum(), sums
    if loss_fn == "ppo":
        clipped_BT = ratio_BT.clamp(cfg.clip_low_threshold, cfg.clip_high_threshold)
        objective_BT = torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
        was_clipped = (objective_BT.detach() != (ratio_BT * adv_BT).detach()).float()
        return -(w_BT * objective_BT).sum(), {**sums, "clipped_tokens": float((was_clipped * mask_BT).sum())}
    if loss_fn == "cispo":
        weight_BT = ratio_BT.detach().clamp(cfg.clip_low_threshold, cfg.clip_high_threshold)
        was_clipped = (weight_BT != ratio_BT.detach()).float()
        loss = -(w_BT * weight_BT * adv_BT * logprobs_BT).sum()
        return loss, {**sums, "clipped_tokens": float((was_clipped * mask_BT).sum())}
    if loss_fn == "dro":
        penalty_BT = (logprobs_BT - batch.sampling_logprobs_BT) ** 2
        return -(w_BT * (logprobs_BT * adv_BT - 0.5 * cfg.beta * penalty_BT)).sum(), sums
    raise ConfigError(f"unknown loss_fn {loss_fn!r}; choose one of {list(LOSS_FNS)}")


def kl_to_reference(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, weights_BT: torch.Tensor) -> torch.Tensor:
    """Summed k3 estimate of KL(policy || reference) over weighted tokens; >= 0, differentiable in logprobs."""
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    k3_BT = torch.exp(log_ratio_BT) - log_ratio_BT - 1.0
    return (weights_BT * k3_BT).sum()


__all__ = ["LOSS_FNS", "Batch", "collate", "kl_to_reference", "policy_loss", "token_logprobs"]
