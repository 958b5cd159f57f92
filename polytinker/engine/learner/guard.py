"""Gradients a call adds only when they are whole and finite (``GradientGuard``).

One non-finite number in an adapter's accumulated gradient makes its next step write NaN into
every weight, and the run is lost from then on. So a ``forward_backward`` computes its gradient
apart from what the slot already holds: the held gradient is set aside (a reference, not a copy),
the call's passes accumulate into fresh tensors, and only when the call's losses and fresh
gradients are finite (on every rank of a group) are the two added; otherwise the fresh ones are
dropped and the held ones put back as they were. A first call of a step holds nothing, so it costs
nothing; a later one holds a second gradient for the call's length. ``optim_step`` refuses a
non-finite gradient norm itself (``Learner.optim_step``).
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils import get_total_norm

from polytinker.engine.learner.checks import NonFinite
from polytinker.engine.learner.sharding import is_sharded

KEPT_ONE = "this call's gradient was not accumulated"


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of ``tensors`` (this rank's part of a sharded one) is finite."""
    parts = [t.to_local() if is_sharded(t) else t for t in tensors]  # type: ignore[attr-defined]
    parts = [t for t in parts if t.numel()]
    # The max-abs norm is inf or NaN exactly where an entry is; one fused kernel per device and dtype.
    return not parts or bool(torch.isfinite(get_total_norm(parts, math.inf)))


class GradientGuard:
    """The accumulated gradients of the slots a call trains, held aside while it computes its own."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[list[torch.nn.Parameter], list[torch.Tensor | None]]] = {}

    def hold(self, name: str, params: list[torch.nn.Parameter]) -> None:
        """Set slot ``name``'s gradient aside: the call's passes write fresh ones."""
        if name in self._held:
            return
        self._held[name] = (params, [p.grad for p in params])
        for p in params:
            p.grad = None

    def finish(self, losses: dict[str, tuple[str, float]], kept: str = KEPT_ONE) -> None:
        """Raise ``NonFinite`` naming every held slot whose loss or fresh gradient is not finite.
        ``losses[name]``: what the call was (for the message) and slot ``name``'s summed loss;
        ``kept``: what the message says happened to the gradients."""
        problems = []
        for name, (params, _) in self._held.items():
            what, loss = losses[name]
            if not math.isfinite(loss):
                problems.append(f"{what}: the loss is not finite ({loss})")
            elif not all_finite([p.grad for p in params if p.grad is not None]):
                problems.append(f"{what}: the gradient is not finite (the loss is {loss})")
        if problems:
            raise NonFinite(
                "; ".join(problems) + ": check the data's weights_T, advantages_T and sampling_logprobs_T, and"
                f" whether an earlier step left the trained weights non-finite; {kept}"
            )

    def commit(self) -> None:
        """Add the fresh gradients to the held ones."""
        for params, held in self._held.values():
            for p, old in zip(params, held, strict=True):
                if old is None:
                    continue
                if p.grad is not None:
                    old.add_(p.grad)
                p.grad = old
        self._held.clear()

    def drop(self) -> None:
        """Forget the fresh gradients: every held slot's gradient is what it was before."""
        for params, held in self._held.values():
            for p, old in zip(params, held, strict=True):
                p.grad = old
        self._held.clear()


__all__ = ["GradientGuard", "all_finite"]
