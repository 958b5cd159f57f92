"""What a learner call's datums must hold before they reach the model, and the error a learner
raises on a loss or gradient that is not finite.

A learner takes its data from a message, and a message's sizes and values are the sender's
word, even behind the scheduler's door: a token id past the vocabulary fails an embedding lookup
(on a GPU, a device assert that takes the process and every tenant's state on it along), and one
non-finite weight, advantage or logprob turns a loss into NaN. :func:`check_data` refuses such a
call with a ``ConfigError`` that names the datum and its field (``data[3].advantages_T holds a
non-finite value ...``) before any compute. It is pure Python, so the worker runs it on a message
before touching its model, and every learner runs it again on what it is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polytinker.engine.types import LOSS_FNS, Datum
from polytinker.errors import ConfigError

_LOSS_INPUTS = ("advantages_T", "sampling_logprobs_T")


class NonFinite(ConfigError):
    """A non-finite loss or gradient was refused; the message says which, and what was kept.
    A ``ConfigError``: the data sent, or the state they train, caused it (``guard``)."""


def check_data(data: Sequence[Datum], vocab_size: int, loss_fn: str | None = None, *, where: str = "") -> None:
    """Raise ``ConfigError`` on the first datum the model cannot take: a token id outside
    ``[0, vocab_size)``, a non-finite float, fields of different lengths, or (a ``loss_fn`` other
    than ``cross_entropy``) a missing ``advantages_T`` / ``sampling_logprobs_T``.
    ``loss_fn=None``: a forward call, which reads no loss input. ``where`` prefixes the message
    (a batched call names the adapter)."""
    at = f"{where}: " if where else ""
    if loss_fn is not None and loss_fn not in LOSS_FNS:
        raise ConfigError(f"{at}unknown loss_fn {loss_fn!r}; choose one of {list(LOSS_FNS)}")
    if not data:
        raise ConfigError(f"{at}a learner call needs at least one Datum")
    needs_inputs = loss_fn is not None and loss_fn != "cross_entropy"
    for i, d in enumerate(data):
        n = len(d.target_tokens_T)
        # Datum checks its lengths when made; a datum changed since must not index out of its rows.
        if n == 0 or len(d.input_tokens) != n:
            raise ConfigError(f"{at}data[{i}] has {len(d.input_tokens)} input tokens and {n} target tokens")
        _tokens(d.input_tokens, vocab_size, f"{at}data[{i}].input_tokens")
        _tokens(d.target_tokens_T, vocab_size, f"{at}data[{i}].target_tokens_T")
        _floats(d.weights_T, n, f"{at}data[{i}].weights_T")
        for name in _LOSS_INPUTS:
            values = getattr(d, name)
            if values is not None:
                _floats(values, n, f"{at}data[{i}].{name}")
            elif needs_inputs:
                raise ConfigError(
                    f"{at}loss_fn {loss_fn!r} reads data[{i}].{name}, which is missing: it needs advantages_T"
                    " and sampling_logprobs_T on every Datum"
                )


def _tokens(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        j, token = next((j, t) for j, t in enumerate(tokens) if not 0 <= t < vocab_size)
        raise ConfigError(f"{field}[{j}] is {token}, outside the model's vocabulary [0, {vocab_size})")


def _floats(values: Sequence[float], n: int, field: str) -> None:
    if len(values) != n:
        raise ConfigError(f"{field} has {len(values)} entries, expected {n} (one per target token)")
    # One C-level sum first: a NaN or an infinity anywhere makes it non-finite, so the per-value
    # scan runs only when something may be wrong (or when finite values overflowed the sum).
    if math.isfinite(sum(values)):
        return
    bad = next(((j, v) for j, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise ConfigError(f"{field} holds a non-finite value ({bad[1]} at position {bad[0]})")


__all__ = ["NonFinite", "check_data"]
