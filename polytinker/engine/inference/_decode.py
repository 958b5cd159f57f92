"""A batch in progress on the ``hf`` backend: requests join it between two decode steps and leave
it as soon as they end (continuous batching).

The batch keeps one KV cache for its live rows. A new group of requests is prefilled in a cache
of its own, its first tokens drawn, and then joined to the batch: the shorter of the two caches is
left-padded (masked positions) to the other's length and the two are concatenated along the rows,
which are kept sorted by adapter (each adapter one run of rows, see ``_multilora``). Positions are
per row, so a row's logits do not depend on the padding or on its neighbours. Rows that end leave
the cache at once, and columns that no live row uses any more are cut from its left, so a long
request that has left costs its successors nothing.

Every row draws the same tokens wherever it runs (its own generator, its own positions), which is
what lets the engine run a request again alone when a step fails.

A model with sliding-window layers keeps a cache whose rows cannot be padded and joined, so there
the backend says it cannot join (``HFBackend.joins``): a batch runs from its start to its end.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from polytinker.engine.inference._sampling import RowSampler, sample_tokens
from polytinker.engine.inference.base import render_prompt
from polytinker.engine.types import FinishReason, SampleRequest, SampleResult
from polytinker.errors import ModelError

if TYPE_CHECKING:
    from polytinker.engine.inference.hf import HFBackend


@dataclass
class Row:
    """One sequence being generated (a request of several samples has one row each)."""

    key: Hashable  # the request it belongs to
    prompt: list[int]
    adapter: str  # the adapter's slot name, or hf.BASE
    sampler: RowSampler
    stop_ids: frozenset[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None


@dataclass
class _Entry:
    """A request in the batch: its rows (live or ended) and the prompt it was rendered to."""

    request: SampleRequest
    prompt: list[int]
    rows: list[Row]


@dataclass
class _State:
    """Live rows and what the next decode step feeds them: the KV cache (rows x heads x positions x
    dims per layer), the attention mask over its positions, each row's next position and the token
    it drew last (not yet in the cache)."""

    rows: list[Row]
    cache: Any
    device: torch.device  # the cache's
    mask_BL: torch.Tensor
    next_pos_B: torch.Tensor
    tokens_B: torch.Tensor

    def select(self, index: list[int]) -> None:
        """Keep only the rows at ``index``, in that order."""
        at = torch.tensor(index)
        self.cache.batch_select_indices(at.to(self.device))
        self.rows = [self.rows[i] for i in index]
        self.mask_BL, self.next_pos_B, self.tokens_B = self.mask_BL[at], self.next_pos_B[at], self.tokens_B[at]


class DecodeBatch:
    """Requests decoded together; :meth:`add` joins more between steps, :meth:`step` draws one
    token for every live row. Both return the requests that have ended, as ``(key, result)``.
    Not thread-safe: one caller drives it (the engine's worker thread)."""

    def __init__(self, backend: HFBackend) -> None:
        self._backend = backend
        self._entries: dict[Hashable, _Entry] = {}
        self._state: _State | None = None

    @property
    def rows(self) -> int:
        """Sequences still being generated."""
        return 0 if self._state is None else len(self._state.rows)

    @property
    def tokens_left(self) -> int:
        """The most tokens its live rows may still draw."""
        return 0 if self._state is None else sum(row.max_tokens - len(row.tokens) for row in self._state.rows)

    def __len__(self) -> int:
        """Requests in the batch, ended ones not yet returned included."""
        return len(self._entries)

    def add(self, requests: Sequence[tuple[Hashable, SampleRequest]]) -> list[tuple[Hashable, SampleResult]]:
        """Prefill ``requests`` together and join them to the batch (rows with ``choices`` are
        scored and answered here). All or none: if this raises, the batch is as it was."""
        b = self._backend
        if any(key in self._entries for key, _ in requests):
            raise ModelError("DecodeBatch.add: a key already in the batch")
        with b._lock, torch.inference_mode():
            b._check_open()
            entries: dict[Hashable, _Entry] = {}
            for key, request in requests:
                prompt = render_prompt(b.tokenizer, request)
                entries[key] = _Entry(request, prompt, b._rows_for(key, request, prompt))
            rows = [row for e in entries.values() for row in e.rows]
            chosen = [row for row in rows if row.sampler.params.choices]
            if chosen:
                b._choose(chosen)
            free = sorted((row for row in rows if not row.sampler.params.choices), key=lambda r: r.adapter)
            new = self._prefilled(free) if free else None
            if new is not None and self._state is not None and not b.joins:
                raise ModelError("this model's cache cannot take rows into a batch in progress")
            self._entries.update(entries)
            self._join(new)
            return self._ended()

    def step(self) -> list[tuple[Hashable, SampleResult]]:
        """One decode step for every live row."""
        b, state = self._backend, self._state
        if state is None:
            return self._ended()
        with b._lock, torch.inference_mode():
            b._check_open()
            state.mask_BL = torch.cat([state.mask_BL, state.mask_BL.new_ones((len(state.rows), 1))], dim=1)
            adapters = [row.adapter for row in state.rows]
            logits = b._forward(
                state.tokens_B[:, None], state.mask_BL, state.next_pos_B[:, None], adapters, state.cache, 1
            )
            state.next_pos_B = state.next_pos_B + 1
            self._draw(state, logits[:, -1].float().cpu())
            return self._ended()

    def _prefilled(self, rows: list[Row]) -> _State | None:
        """``rows`` prefilled in a cache of their own and their first tokens drawn; None when
        every one ended at once."""
        cache = _dynamic_cache(config=self._backend.model.config)
        logits_BV, mask_BL, next_pos_B = self._backend._prefill(rows, cache)
        state = _State(rows, cache, self._backend.device, mask_BL, next_pos_B, torch.zeros(len(rows), dtype=torch.long))
        self._draw(state, logits_BV)
        return state if state.rows else None

    def _draw(self, state: _State, logits_BV: torch.Tensor) -> None:
        """Draw each live row's next token from its logits; rows that end leave the state."""
        tokens_B, logprobs_B = sample_tokens(logits_BV, [row.sampler for row in state.rows])
        tokens, logprobs = tokens_B.tolist(), logprobs_B.tolist()  # one conversion, not one a row
        state.tokens_B = tokens_B
        keep = [j for j, row in enumerate(state.rows) if not self._backend._append(row, tokens[j], logprobs[j])]
        if not keep:
            state.rows = []
        elif len(keep) < len(state.rows):
            state.select(keep)
            _trim_left(state)

    def _join(self, new: _State | None) -> None:
        old = self._state
        if old is not None and not old.rows:
            old = None
        if new is None or old is None:
            self._state = new or old
            return
        width = max(old.mask_BL.shape[1], new.mask_BL.shape[1])
        layers = [
            tuple(torch.cat([_pad_left(x1, width), _pad_left(x2, width)]) for x1, x2 in ((k1, k2), (v1, v2)))
            for (k1, v1, *_), (k2, v2, *_) in zip(old.cache, new.cache, strict=True)
        ]
        masks = [torch.cat([m.new_zeros((len(m), width - m.shape[1])), m], dim=1) for m in (old.mask_BL, new.mask_BL)]
        joined = _State(
            old.rows + new.rows,
            _dynamic_cache(ddp_cache_data=layers),
            old.device,
            torch.cat(masks),
            torch.cat([old.next_pos_B, new.next_pos_B]),
            torch.cat([old.tokens_B, new.tokens_B]),
        )
        order = sorted(range(len(joined.rows)), key=lambda i: joined.rows[i].adapter)  # stable: old rows first
        if order != list(range(len(order))):
            joined.select(order)
        self._state = joined

    def _ended(self) -> list[tuple[Hashable, SampleResult]]:
        done = [key for key, e in self._entries.items() if all(row.finish is not None for row in e.rows)]
        out = []
        for key in done:
            e = self._entries.pop(key)
            out.append((key, self._backend._result(e.request, e.prompt, e.rows)))
        if self._state is not None and not self._state.rows:
            self._state = None
        return out


def _dynamic_cache(**kwargs: Any) -> Any:
    """transformers' ``DynamicCache`` (imported here: transformers loads only where a model runs)."""
    from transformers import DynamicCache

    return DynamicCache(**kwargs)


def _pad_left(x_BHLD: torch.Tensor, width: int) -> torch.Tensor:
    """Cached keys or values padded on the left (the positions' axis) to ``width`` positions."""
    short = width - x_BHLD.shape[-2]
    if short == 0:
        return x_BHLD
    pad = x_BHLD.new_zeros((*x_BHLD.shape[:-2], short, x_BHLD.shape[-1]))
    return torch.cat([pad, x_BHLD], dim=-2)


def _trim_left(state: _State) -> None:
    """Cut the leading positions no live row attends to (padding left by rows that ended)."""
    used_L = state.mask_BL.bool().any(dim=0)
    first = int(used_L.to(torch.uint8).argmax())
    if first == 0:
        return
    state.cache = _dynamic_cache(ddp_cache_data=[(k[..., first:, :], v[..., first:, :]) for k, v, *_ in state.cache])
    state.mask_BL = state.mask_BL[:, first:]


__all__ = ["DecodeBatch", "Row"]
