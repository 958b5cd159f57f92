"""The ``hf`` backend: transformers (on the CPU, or a GPU: ``HFBackendConfig.device``), many LoRA
adapters in one mixed batch.

Every resident adapter version sits in its own slot on one shared base model (tensors in peft's
layout and with peft's scaling); a batch's rows are sorted by adapter, so rows for different
adapters share every base-model matmul and differ only in their low-rank updates
(``_multilora.py`` says why this replaces peft's ``adapter_names`` path).

Decoding is a hand-written loop over a KV cache rather than ``generate`` (``_decode.DecodeBatch``):
each row keeps its own sampling parameters, generator, stop conditions and the log-probabilities
of the tokens it drew; finished rows leave the batch (and the cache) at once, so they cost nothing
afterwards, and new requests join it between two steps (``open_batch``: the engine's continuous
batching).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.device import resolve_device
from polytinker.engine.inference._decode import DecodeBatch, Row
from polytinker.engine.inference._multilora import MultiLora
from polytinker.engine.inference._sampling import choice_slices, make_row_sampler, pick_choice
from polytinker.engine.inference.adapter_io import read_adapter_dir
from polytinker.engine.inference.base import cut_at_stop, sample_to_end
from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.models import load_model
from polytinker.engine.types import (
    AdapterRef,
    FinishReason,
    SampledSequence,
    SampleRequest,
    SampleResult,
    ScoredTopK,
    TopTokens,
)
from polytinker.errors import ConfigError, ModelError

BASE = "__base__"  # the rows of a batch that use no adapter


# KV positions (prompt and choice, over all choices) one pass of choice scoring may cache at once.
_CHOICE_POSITIONS = 8192


def _chunked(jobs: list[tuple[Row, range]], logits: int) -> list[list[tuple[Row, range]]]:
    """Consecutive (row, slice of its choices) jobs grouped under ``_CHOICE_POSITIONS`` cached
    positions and ``logits`` choice tokens a pass."""
    chunks: list[list[tuple[Row, range]]] = [[]]
    positions = tokens = 0
    for row, part in jobs:
        longest = max(len(row.sampler.params.choices[k]) for k in part)
        cost, width = len(part) * (len(row.prompt) + longest), len(part) * longest
        if chunks[-1] and (positions + cost > _CHOICE_POSITIONS or tokens + width > logits):
            chunks.append([])
            positions = tokens = 0
        chunks[-1].append((row, part))
        positions, tokens = positions + cost, tokens + width
    return [c for c in chunks if c]


class HFBackend:
    """transformers with multi-LoRA slots. Pass ``model`` and ``tokenizer`` to serve weights already in memory."""

    name = "hf"

    def __init__(self, config: HFBackendConfig | None = None, *, model: Any = None, tokenizer: Any = None) -> None:
        self.config = config or HFBackendConfig()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        if model is None:
            model, tokenizer = load_model(self.config.model, self.config.model_config)
        elif tokenizer is None:
            raise ConfigError("HFBackend: pass the tokenizer together with the model")
        if self.config.device != "cpu":
            model = model.to(resolve_device(self.config.device))  # ConfigError where there is no such GPU
        self.device = next(model.parameters()).device
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._lora = MultiLora(self.model)
        self._dtype = next(model.parameters()).dtype
        self._names: dict[AdapterRef, str] = {}
        self._next_slot = 0
        self._eos_ids = self._find_eos_ids()
        self._max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.max_model_len = self._max_positions
        # The embedding's rows, not the tokenizer's length: an id past them is what fails a batch.
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        # Callers are expected to use one thread; the lock makes a stray concurrent call safe.
        self._lock = threading.RLock()
        from transformers import DynamicCache

        # Rows join a batch in progress by padding caches to one length: not for sliding windows.
        self.joins = not any(DynamicCache(config=model.config).is_sliding)
        self._closed = False

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    # ----- adapters -----

    def load_adapter(self, weights: AdapterWeights) -> None:
        with self._lock:
            self._check_open()
            name = self._names.get(weights.ref)
            if name is None:
                name = f"slot{self._next_slot}"
                self._next_slot += 1
            self._lora.load(name, weights, self._dtype, self.device)  # validates every tensor before it replaces any
            self._names[weights.ref] = name

    def load_adapter_dir(self, ref: AdapterRef, path: Path) -> None:
        self.load_adapter(read_adapter_dir(ref, path))

    def unload_adapter(self, ref: AdapterRef) -> None:
        with self._lock:
            name = self._names.pop(ref, None)
            if name is None:
                raise ConfigError(f"adapter {ref} is not loaded; loaded: {sorted(map(str, self._names))}")
            self._lora.unload(name)

    def loaded_adapters(self) -> list[AdapterRef]:
        return list(self._names)

    def _adapter_name(self, ref: AdapterRef | None) -> str:
        if ref is None:
            return BASE
        name = self._names.get(ref)
        if name is None:
            raise ConfigError(f"adapter {ref} is not loaded; loaded: {sorted(map(str, self._names))}")
        return name

    # ----- forward -----

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        adapters: list[str],
        cache: Any = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        on = self.device
        kwargs: dict[str, Any] = {
            "input_ids": input_ids.to(on),
            "attention_mask": attention_mask.to(on),
            "position_ids": None if position_ids is None else position_ids.to(on),
            "past_key_values": cache,
            "use_cache": cache is not None,
            "logits_to_keep": logits_to_keep,
        }
        self._lora.router.set_rows(adapters, on)
        return self.model(**kwargs).logits

    # ----- sampling -----

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        return sample_to_end(self.open_batch(), requests)

    def open_batch(self) -> DecodeBatch:
        """A batch to decode step by step, which requests may join between steps (if ``joins``)."""
        return DecodeBatch(self)

    def _rows_for(self, key: Hashable, request: SampleRequest, prompt: list[int]) -> list[Row]:
        if not prompt:
            raise ConfigError("SampleRequest: the prompt is empty; give at least one token")
        params = request.params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        room = self._max_positions - len(prompt)
        if room <= 0:
            raise ConfigError(f"prompt of {len(prompt)} tokens leaves no room in the model's {self._max_positions}")
        adapter = self._adapter_name(request.adapter)
        return [
            Row(key, prompt, adapter, make_row_sampler(params, k), stop_ids, min(params.max_tokens, room))
            for k in range(request.num_samples)
        ]

    def _prefill(self, rows: list[Row], cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts through the model; returns last logits, the mask and next positions.

        Rows with the same prompt and adapter (a request's samples) are prefilled once; the cache,
        logits and mask are then indexed out to every row, so ``num_samples`` samples cost one prompt.
        """
        index_of: dict[tuple[str, tuple[int, ...]], int] = {}  # (adapter, prompt) -> its row in unique
        unique: list[Row] = []
        owner_B: list[int] = []
        for r in rows:
            u = index_of.setdefault((r.adapter, tuple(r.prompt)), len(unique))
            if u == len(unique):
                unique.append(r)
            owner_B.append(u)
        width = max(len(r.prompt) for r in unique)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids_UL = torch.full((len(unique), width), pad, dtype=torch.long)
        mask_UL = torch.zeros((len(unique), width), dtype=torch.long)
        for u, row in enumerate(unique):
            ids_UL[u, width - len(row.prompt) :] = torch.tensor(row.prompt)
            mask_UL[u, width - len(row.prompt) :] = 1
        pos_UL = (mask_UL.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids_UL, mask_UL, pos_UL, [r.adapter for r in unique], cache, logits_to_keep=1)
        logits_UV, next_pos_U = logits[:, -1].float().cpu(), pos_UL[:, -1] + 1
        if len(unique) == len(rows):
            return logits_UV, mask_UL, next_pos_U
        index = torch.tensor(owner_B)
        cache.reorder_cache(index.to(self.device))
        return logits_UV[index], mask_UL[index], next_pos_U[index]

    def _choose(self, rows: list[Row]) -> None:
        """Rows with ``choices``: every choice is scored after its row's prompt (the prompt
        prefilled once, its cache repeated for each choice), and the row takes one whole
        (``pick_choice``) with the model's own logprob of each of its tokens."""
        for row in rows:
            longest = max(map(len, row.sampler.params.choices))
            if longest > row.max_tokens:  # the model's positions left after the prompt
                raise ConfigError(f"a choice of {longest} tokens does not fit after a prompt of {len(row.prompt)}")
        scores: dict[int, list[list[float]]] = {id(row): [] for row in rows}
        rows = sorted(rows, key=lambda r: r.adapter)  # one run of rows per adapter (see _multilora)
        budget = self.config.logprobs_chunk_tokens  # the logits one pass materialises, as in scoring
        jobs = [
            (row, part)
            for row in rows
            for part in choice_slices(len(row.prompt), row.sampler.params.choices, _CHOICE_POSITIONS, budget)
        ]
        for chunk in _chunked(jobs, budget):
            for (row, _), values in zip(chunk, self._score_choices(chunk), strict=True):
                scores[id(row)].extend(values)
        for row in rows:
            choices = row.sampler.params.choices
            per_token = scores[id(row)]
            k = pick_choice([sum(v) for v in per_token], row.sampler)
            row.tokens, row.logprobs, row.finish = list(choices[k]), per_token[k], FinishReason.STOP

    def _score_choices(self, jobs: list[tuple[Row, range]]) -> list[list[list[float]]]:
        """Per job, per choice of its slice: the logprob of each of the choice's tokens."""
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=self.model.config)
        logits_JV, mask_JL, next_pos_J = self._prefill([row for row, _ in jobs], cache)
        pairs = [(j, row.sampler.params.choices[k]) for j, (row, part) in enumerate(jobs) for k in part]
        width = max(len(c) for _, c in pairs)
        owner = torch.tensor([j for j, _ in pairs])
        cache.reorder_cache(owner.to(self.device))  # each job's cached prompt, once per choice
        ids_PL = torch.zeros((len(pairs), width), dtype=torch.long)
        tail_PL = torch.zeros((len(pairs), width), dtype=torch.long)
        for p, (_, choice) in enumerate(pairs):
            ids_PL[p, : len(choice)] = torch.tensor(choice)
            tail_PL[p, : len(choice)] = 1
        pos_PL = next_pos_J[owner][:, None] + torch.arange(width)[None, :]
        adapters = [jobs[j][0].adapter for j, _ in pairs]
        logits = self._forward(ids_PL, torch.cat([mask_JL[owner], tail_PL], dim=1), pos_PL, adapters, cache)
        # The first token is scored by the prompt's last logits, each next one by the choice's own.
        first_PV = logits_JV[owner].log_softmax(-1)
        rest_PLV = logits[:, :-1].float().cpu().log_softmax(-1)
        out: list[list[list[float]]] = [[] for _ in jobs]
        for p, (j, choice) in enumerate(pairs):
            values = [float(first_PV[p, choice[0]])]
            values += [float(rest_PLV[p, i - 1, t]) for i, t in enumerate(choice) if i > 0]
            out[j].append(values)
        return out

    def _append(self, row: Row, token: int, logprob: float) -> bool:
        """Record a drawn token; True when the row is finished."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        params = row.sampler.params
        if token in row.stop_ids or (params.stop and cut_at_stop(self._text(row.tokens), params.stop)[1]):
            row.finish = FinishReason.STOP
        elif len(row.tokens) >= row.max_tokens:
            row.finish = FinishReason.LENGTH
        return row.finish is not None

    def _text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _result(self, request: SampleRequest, prompt: list[int], rows: list[Row]) -> SampleResult:
        sequences = tuple(
            SampledSequence(
                token_ids=tuple(row.tokens),
                text=cut_at_stop(self._text(row.tokens), request.params.stop)[0],
                logprobs=tuple(row.logprobs),
                finish_reason=row.finish or FinishReason.ABORT,
            )
            for row in rows
        )
        return SampleResult(prompt_token_ids=tuple(prompt), sequences=sequences, adapter=request.adapter)

    # ----- scoring -----

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], adapter: AdapterRef | None = None
    ) -> list[list[float]]:
        return self.compute_logprobs_topk(sequences, 0, adapter)[0]

    def compute_logprobs_topk(
        self, sequences: Sequence[Sequence[int]], k: int, adapter: AdapterRef | None = None
    ) -> ScoredTopK:
        with self._lock, torch.inference_mode():
            self._check_open()
            if any(len(s) == 0 for s in sequences):
                raise ConfigError("compute_logprobs: every sequence needs at least one token")
            name = self._adapter_name(adapter)
            out: list[list[float]] = [[] for _ in sequences]
            top: list[list[TopTokens]] = [[] for _ in sequences]
            for chunk in self._chunks([len(s) for s in sequences]):
                scored = self._score([sequences[i] for i in chunk], name, k)
                for i, (values, best) in zip(chunk, scored, strict=True):
                    out[i], top[i] = values, best
            return out, top

    def _chunks(self, lengths: list[int]) -> list[list[int]]:
        """Sequence indices grouped (similar lengths together) under the logits token budget."""
        chunks: list[list[int]] = [[]]
        width = 0
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            width = max(width, lengths[i])
            if chunks[-1] and width * (len(chunks[-1]) + 1) > self.config.logprobs_chunk_tokens:
                chunks.append([])
                width = lengths[i]
            chunks[-1].append(i)
        return [c for c in chunks if c]

    def _score(self, sequences: list[Sequence[int]], adapter: str, k: int) -> list[tuple[list[float], list[TopTokens]]]:
        width = max(len(s) for s in sequences)
        ids_BT = torch.zeros((len(sequences), width), dtype=torch.long)
        mask_BT = torch.zeros((len(sequences), width), dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids_BT[b, : len(seq)] = torch.tensor(list(seq))
            mask_BT[b, : len(seq)] = 1
        logits_BTV = self._forward(ids_BT, mask_BT, None, [adapter] * len(sequences)).float()
        all_BTV = logits_BTV[:, :-1].log_softmax(-1)
        ids_BT = ids_BT.to(all_BTV.device)
        logprobs_BT = all_BTV.gather(2, ids_BT[:, 1:, None])[..., 0]
        best_lp_BTK, best_id_BTK = all_BTV.topk(k, dim=-1) if k else (None, None)
        out = []
        for b, seq in enumerate(sequences):
            n = len(seq) - 1
            best: list[TopTokens] = []
            if best_lp_BTK is not None and best_id_BTK is not None:
                ids, lps = best_id_BTK[b, :n].tolist(), best_lp_BTK[b, :n].tolist()
                best = [list(zip(i, lp, strict=True)) for i, lp in zip(ids, lps, strict=True)]
            out.append((logprobs_BT[b, :n].tolist(), best))
        return out

    # ----- lifecycle -----

    def _check_open(self) -> None:
        if self._closed:
            raise ModelError("this HFBackend is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for name in self._names.values():
                self._lora.unload(name)
            self._names.clear()


__all__ = ["BASE", "HFBackend"]
