"""Token logprobs of a batch without full-vocabulary logits at every position.

:func:`score` runs the model's decoder for hidden states, then applies ``lm_head`` only where a
log-probability is wanted, in chunks of positions, and takes ``logit[target] - logsumexp(logits)``
in float32. No ``B x T x V`` tensor exists at any time: the largest is one chunk's logits
(``LOGIT_CHUNK x V``).

- **Where gradients flow.** ``grad_BT`` marks the positions whose logprob must be differentiable
  (``forward_backward``: the nonzero-weight positions). Every other real position is scored under
  ``no_grad`` from the detached hidden state: the caller still gets its value (``forward_backward``
  returns one logprob per target token) but autograd keeps no logits for it and backward never
  touches ``lm_head`` there. With more than one chunk of differentiable positions, each chunk is
  recomputed in backward instead of keeping its logits (activation checkpointing of the head only).
- **Shared prefix.** When every row of the batch starts with the same ``P >= MIN_SHARED_PREFIX``
  tokens (GRPO: one prompt, many completions), the prefix runs once per distinct adapter of the
  batch and only the rows' own suffixes run on its key/value cache: with one adapter, unpadded and
  packed in one row under a 4-D mask (``_packed_suffixes``); with several, padded, the cache
  indexed out to every row. Positions, attention and gradients are those of the full pass (the
  cache's backward sums the rows' gradients into the prefix); only the float summation order
  differs. Models whose cache is not a plain full-attention ``DynamicCache`` (sliding windows,
  linear attention) take the full pass.
- **Checkpointing** (``checkpoint_layers``). Decoder layers keep only their inputs and recompute
  in backward; the prefix pass writes its cache through ``update``s that set rather than append
  (``_recording_cache``) and the suffixes read it through a read-only view (``_frozen``), so a
  recomputed layer sees and writes what its first run did.
- **Fallback.** A model without ``get_decoder``/``get_output_embeddings``, or with logits
  post-processing (soft-capping, logit scaling), is scored with its own forward and full logits.

Shapes in names: ``_B`` batch, ``_T`` position, ``_S`` suffix position, ``_D`` hidden, ``_V`` vocabulary,
``_K`` selected (row, position) pairs, ``_U`` distinct hidden rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polytinker.engine.learner.losses import token_logprobs

LOGIT_CHUNK = 256  # positions per lm_head call: 256 x 49152 fp32 logits are 48 MiB
MIN_SHARED_PREFIX = 8  # shorter common prefixes are not worth a second decoder call
PACK_MASK_LIMIT = 1 << 22  # packed suffixes' mask elements (16 MiB fp32); past it the suffixes run padded

RowContext = Callable[[Sequence[str] | None], contextlib.AbstractContextManager[Any]]


def _no_context(_names: Sequence[str] | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def shared_prefix_len(input_ids_BT: torch.Tensor, lengths_B: Sequence[int]) -> int:
    """Length of the token prefix every row shares, leaving each row at least one token of its own."""
    if input_ids_BT.shape[0] < 2:
        return 0
    limit = min(lengths_B) - 1
    if limit <= 0:
        return 0
    same_T = (input_ids_BT[:, :limit] == input_ids_BT[:1, :limit]).all(dim=0)
    return int(same_T.to(torch.int64).cumprod(0).sum())


def _fast_path_parts(lm: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The decoder (hidden states after the final norm) and the output head, when logits are just ``head(h)``."""
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_decoder") or not hasattr(lm, "get_output_embeddings"):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1.0):
        return None
    try:
        decoder, head = lm.get_decoder(), lm.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module) or decoder is lm:
        return None
    return decoder, head


def _full_attention(decoder: nn.Module) -> bool:
    """Whether the model's own cache would be plain full-attention layers (no sliding window, no linear attention)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    config = getattr(decoder, "config", None)
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: take the full pass
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _recording_cache() -> Any:
    """A cache for the prefix pass whose ``update`` sets (not appends) each layer's keys and values:
    a layer recomputed in backward (checkpointing) writes equal values again and changes nothing."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class RecordingCache(DynamicCache):
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            while len(self.layers) <= layer_idx:
                self.layers.append(DynamicLayer())
            layer: Any = self.layers[layer_idx]
            if not layer.is_initialized:
                layer.lazy_initialization(key_states, value_states)
            layer.keys, layer.values = key_states, value_states
            return key_states, value_states

    return RecordingCache()


def _frozen(cache: Any) -> Any:
    """``cache`` as a read-only prefix: each layer's ``update`` returns prefix + new keys and stores
    nothing, so a layer recomputed in backward (checkpointing) sees what its first run saw."""
    from transformers.cache_utils import DynamicCache

    class FrozenPrefixCache(DynamicCache):
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
        ) -> Any:
            layer: Any = self.layers[layer_idx]  # a DynamicLayer: _full_attention checked
            return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)

    frozen = FrozenPrefixCache()
    frozen.layers = cache.layers
    return frozen


@contextlib.contextmanager
def _checkpointed_layers(decoder: nn.Module, enabled: bool) -> Iterator[None]:
    """Within: each decoder layer keeps only its input for backward and recomputes the rest there."""
    layers = getattr(decoder, "layers", None) if enabled and torch.is_grad_enabled() else None
    if not isinstance(layers, nn.ModuleList):
        yield
        return
    for layer in layers:
        # The bound forward is captured: the recomputation in backward runs after this context ends.
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward


def pass_cost(prefix_len: int, lengths_B: Sequence[int], owners: int) -> int:
    """Token positions the decoder runs for one micro-batch (what :func:`_hidden` does with it):
    a shared prefix once per distinct adapter and the suffixes (unpadded with one adapter, padded
    with several), else every row padded to the longest."""
    if prefix_len < MIN_SHARED_PREFIX:
        return len(lengths_B) * max(lengths_B)
    if owners == 1:
        return prefix_len + sum(lengths_B) - len(lengths_B) * prefix_len
    return owners * prefix_len + len(lengths_B) * (max(lengths_B) - prefix_len)


def token_micro_batches(inputs: Sequence[Sequence[int]], size: int, max_tokens: int) -> list[list[int]]:
    """Positions in ``inputs`` (one adapter's rows' input tokens, in the order to keep) cut into
    micro-batches of at most ``size`` rows whose pass runs at most ``max_tokens`` decoder positions
    (:func:`pass_cost`: a shared prefix once): a pass's activations grow with its positions, so a
    call of long datums splits into several passes rather than one that takes the machine's
    memory. A row longer than ``max_tokens`` runs alone."""
    batches: list[list[int]] = []
    prefix: Sequence[int] = ()
    lengths: list[int] = []
    for i, tokens in enumerate(inputs):
        if batches and len(batches[-1]) < size:
            common = _common_prefix_len(prefix, tokens)
            new_lengths = [*lengths, len(tokens)]
            if pass_cost(min(common, min(new_lengths) - 1), new_lengths, 1) <= max_tokens:
                batches[-1].append(i)
                prefix, lengths = tokens[:common], new_lengths
                continue
        batches.append([i])
        prefix, lengths = tokens, [len(tokens)]
    return batches


def plan_micro_batches(rows: Sequence[tuple[str, Sequence[int]]], size: int, max_tokens: int) -> list[list[int]]:
    """Micro-batches (lists of indices into ``rows``, each ``(adapter, input tokens)``) of at most
    ``size`` rows and ``max_tokens`` decoder positions, for scoring with :func:`score`.

    Rows of one adapter that share a prompt prefix (a GRPO group) run together and alone, as that
    adapter's own call would run them (:func:`token_micro_batches`): the prefix once, the rows'
    own tokens packed in one row. Rows that share no prefix with their adapter's others fill
    micro-batches whichever adapter they belong to (:func:`_mixed_micro_batches`), so the base
    model's matmuls see many rows.

    Mixing a group with another adapter's rows of the same prompt costs more than it saves: the
    prefix runs once per adapter anyway, the suffixes are padded instead of packed, and every layer
    adds one LoRA product per adapter's run of rows, forward and backward. With 16 agents' groups
    of one prompt (8 rows of 47 + 16 tokens each, SmolLM2-135M, one thread), planning them together
    in token order put one row of each of 8 agents in every micro-batch: 3.3 s of learner time per
    agent, against 1.43 s with each group alone (1.5 s as one call per agent). Mixing an agent's
    short prompts with another's long ones had cost 4x (a solver's and a verifier's groups).
    """
    owned: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(rows):
        owned.setdefault(name, []).append(i)
    groups: list[list[int]] = []
    loose: list[int] = []
    for index in owned.values():
        order = sorted(index, key=lambda i: list(rows[i][1]))
        for cut in token_micro_batches([rows[i][1] for i in order], size, max_tokens):
            batch = [order[j] for j in cut]
            # In token order the prefix every row shares is the first and last rows' common one.
            first, last = rows[batch[0]][1], rows[batch[-1]][1]
            shared = min(_common_prefix_len(first, last), min(len(rows[i][1]) for i in batch) - 1)
            if len(batch) > 1 and shared >= MIN_SHARED_PREFIX:
                groups.append(batch)
            else:
                loose += batch
    return groups + [
        [loose[j] for j in cut] for cut in _mixed_micro_batches([rows[i] for i in loose], size, max_tokens)
    ]


def _mixed_micro_batches(rows: Sequence[tuple[str, Sequence[int]]], size: int, max_tokens: int) -> list[list[int]]:
    """Rows of any adapters in token order, each joining the micro-batch being built unless that
    costs more decoder positions (:func:`pass_cost`, a prefix once per adapter) than the row alone
    would, or more than ``max_tokens``."""
    order = sorted(range(len(rows)), key=lambda i: list(rows[i][1]))
    batches: list[list[int]] = []
    prefix: Sequence[int] = ()
    lengths: list[int] = []
    owners: set[str] = set()
    for i in order:
        name, tokens = rows[i]
        if batches and len(batches[-1]) < size:
            common = _common_prefix_len(prefix, tokens)
            new_lengths = [*lengths, len(tokens)]
            joined = min(common, min(new_lengths) - 1)
            old = pass_cost(min(len(prefix), min(lengths) - 1), lengths, len(owners))
            cost = pass_cost(joined, new_lengths, len(owners | {name}))
            if cost - old <= len(tokens) and cost <= max_tokens:
                batches[-1].append(i)
                prefix, lengths = tokens[:common], new_lengths
                owners.add(name)
                continue
        batches.append([i])
        prefix, lengths, owners = tokens, [len(tokens)], {name}
    return batches


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _hidden(
    decoder: nn.Module,
    input_ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    lengths_B: Sequence[int],
    adapter_names: Sequence[str] | None,
    row_context: RowContext,
    share_prefix: bool,
    checkpoint_layers: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states as ``(H_ND, src_BT)``: position ``(b, t)`` reads row ``src_BT[b, t]`` of ``H_ND``."""
    B, T = input_ids_BT.shape
    device = input_ids_BT.device
    P = shared_prefix_len(input_ids_BT, lengths_B) if share_prefix else 0
    if P >= MIN_SHARED_PREFIX and _full_attention(decoder):
        # One prefix row per distinct adapter; row b reads prefix row owner_B[b].
        owners = list(dict.fromkeys(adapter_names)) if adapter_names is not None else []
        owner_B = torch.tensor(
            [owners.index(n) for n in adapter_names] if adapter_names is not None else [0] * B,
            dtype=torch.int64,
            device=device,
        )
        R = max(len(owners), 1)
        prefix_RP = input_ids_BT[:1, :P].expand(R, P)
        cache = _recording_cache()
        prefix_mask = mask_BT[:1, :P].expand(R, P)
        with (
            row_context(owners if adapter_names is not None else None),
            _checkpointed_layers(decoder, checkpoint_layers),
        ):
            out = decoder(input_ids=prefix_RP, attention_mask=prefix_mask, past_key_values=cache, use_cache=True)
        suffix_tokens = sum(lengths_B) - B * P
        if R == 1 and _packable(decoder, suffix_tokens * (P + suffix_tokens)):
            prefix_h = out.last_hidden_state.reshape(P, -1)
            return _packed_suffixes(
                decoder, input_ids_BT, lengths_B, P, cache, prefix_h, adapter_names, row_context, checkpoint_layers
            )
        cache.reorder_cache(owner_B)  # index_select: its backward sums the rows' gradients into the prefix
        with row_context(adapter_names), _checkpointed_layers(decoder, checkpoint_layers):
            suffix = decoder(input_ids=input_ids_BT[:, P:], attention_mask=mask_BT, past_key_values=_frozen(cache))
        S = T - P
        H_ND = torch.cat([out.last_hidden_state.reshape(R * P, -1), suffix.last_hidden_state.reshape(B * S, -1)])
        t_T = torch.arange(T, device=device)
        prefix_src_BT = owner_B[:, None] * P + t_T[None, :]
        suffix_src_BT = R * P + torch.arange(B, device=device)[:, None] * S + (t_T[None, :] - P)
        return H_ND, torch.where(t_T[None, :] < P, prefix_src_BT, suffix_src_BT)
    with row_context(adapter_names), _checkpointed_layers(decoder, checkpoint_layers):
        out = decoder(input_ids=input_ids_BT, attention_mask=mask_BT, use_cache=False)
    H_ND = out.last_hidden_state.reshape(B * T, -1)
    return H_ND, torch.arange(B * T, device=device).reshape(B, T)


def _packable(decoder: nn.Module, mask_elements: int) -> bool:
    """Whether the suffixes can run packed in one row: attention that takes an additive 4-D mask, and a small mask."""
    implementation = getattr(getattr(decoder, "config", None), "_attn_implementation", None)
    return implementation in ("sdpa", "eager") and mask_elements <= PACK_MASK_LIMIT


def _packed_suffixes(
    decoder: nn.Module,
    input_ids_BT: torch.Tensor,
    lengths_B: Sequence[int],
    P: int,
    cache: Any,
    prefix_PD: torch.Tensor,
    adapter_names: Sequence[str] | None,
    row_context: RowContext,
    checkpoint_layers: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's own tokens, unpadded, one after another in a single row on the prefix's cache.

    A 4-D additive mask lets a token see the prefix and the earlier tokens of its own row only, and
    position ids restart at ``P`` for each row: the same attention and positions as the padded pass,
    without the padding and without a per-row copy of the prefix's keys and values.
    """
    B, T = input_ids_BT.shape
    device = input_ids_BT.device
    S_B = [n - P for n in lengths_B]
    N = sum(S_B)
    ids_N = torch.cat([input_ids_BT[b, P : lengths_B[b]] for b in range(B)])
    row_N = torch.repeat_interleave(torch.arange(B, device=device), torch.tensor(S_B, device=device))
    start_B = torch.tensor([0, *S_B[:-1]], device=device).cumsum(0)
    offset_N = torch.arange(N, device=device) - start_B[row_N]
    visible_NN = (row_N[:, None] == row_N[None, :]) & (offset_N[None, :] <= offset_N[:, None])
    mask_11NK = torch.zeros((1, 1, N, P + N), dtype=prefix_PD.dtype, device=device)
    mask_11NK[0, 0, :, P:].masked_fill_(~visible_NN, torch.finfo(prefix_PD.dtype).min)
    names = list(adapter_names[:1]) if adapter_names is not None else None
    with row_context(names), _checkpointed_layers(decoder, checkpoint_layers):
        suffix = decoder(
            input_ids=ids_N[None, :],
            attention_mask=mask_11NK,
            position_ids=(P + offset_N)[None, :],
            past_key_values=_frozen(cache),
        )
    H_ND = torch.cat([prefix_PD, suffix.last_hidden_state.reshape(N, -1)])
    t_T = torch.arange(T, device=device)
    real_BT = t_T[None, :] < torch.tensor(lengths_B, device=device)[:, None]
    suffix_src_BT = torch.where(real_BT, P + start_B[:, None] + (t_T[None, :] - P), 0)
    return H_ND, torch.where(t_T[None, :] < P, t_T[None, :].expand(B, T), suffix_src_BT)


def _chunk_logprobs(head: nn.Module, h_UD: torch.Tensor, inv_K: torch.Tensor, tgt_K: torch.Tensor) -> torch.Tensor:
    logits_UV = head(h_UD).float()
    return logits_UV[inv_K, tgt_K] - torch.logsumexp(logits_UV, dim=-1)[inv_K]


def _select_logprobs(head: nn.Module, H_ND: torch.Tensor, src_K: torch.Tensor, tgt_K: torch.Tensor) -> torch.Tensor:
    """``log_softmax(head(H[src]))[tgt]`` per pair; each distinct hidden row's logits are computed once."""
    out_K = H_ND.new_zeros(src_K.shape[0], dtype=torch.float32)
    if src_K.numel() == 0:
        return out_K
    uniq_U, inv_K = torch.unique(src_K, return_inverse=True)
    chunks = range(0, uniq_U.shape[0], LOGIT_CHUNK)
    recompute = torch.is_grad_enabled() and H_ND.requires_grad and len(chunks) > 1
    parts = []
    for c0 in chunks:
        sel_K = (inv_K >= c0) & (inv_K < c0 + LOGIT_CHUNK)
        h_UD = H_ND.index_select(0, uniq_U[c0 : c0 + LOGIT_CHUNK])
        args = (head, h_UD, inv_K[sel_K] - c0, tgt_K[sel_K])
        vals = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
        parts.append((sel_K.nonzero().squeeze(1), vals))
    for idx, vals in parts:
        out_K = out_K.index_put((idx,), vals)
    return out_K


def score(
    lm: nn.Module,
    input_ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    lengths_B: Sequence[int],
    grad_BT: torch.Tensor | None = None,
    *,
    adapter_names: Sequence[str] | None = None,
    row_context: RowContext = _no_context,
    share_prefix: bool = True,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """Float32 ``log p(target_t | tokens <= t)`` per position; 0 beyond each row's length.

    ``grad_BT`` (bool): positions whose values must carry gradients; None: none (or, under a grad
    context on the fallback path, all). ``adapter_names``: peft's per-row adapters, applied inside
    ``row_context(names)``. ``checkpoint_layers``: decoder layers recompute their activations in
    backward (not with ``adapter_names``: the per-row context is gone by then; not in the prefix pass,
    which writes the cache).
    """
    B, T = input_ids_BT.shape
    parts = _fast_path_parts(lm)
    if parts is None:
        with row_context(adapter_names):
            logits_BTV = lm(input_ids=input_ids_BT, attention_mask=mask_BT, use_cache=False).logits
        return token_logprobs(logits_BTV, targets_BT)
    decoder, head = parts
    checkpoint_layers = checkpoint_layers and adapter_names is None
    H_ND, src_BT = _hidden(
        decoder, input_ids_BT, mask_BT, lengths_B, adapter_names, row_context, share_prefix, checkpoint_layers
    )
    device = input_ids_BT.device
    real_BT = torch.arange(T, device=device)[None, :] < torch.tensor(lengths_B, device=device)[:, None]
    if grad_BT is None or not torch.is_grad_enabled():
        grad_BT = torch.zeros_like(real_BT)
    grad_BT = grad_BT & real_BT
    rest_BT = real_BT & ~grad_BT
    flat_src, flat_tgt = src_BT.reshape(-1), targets_BT.reshape(-1)
    out = H_ND.new_zeros(B * T, dtype=torch.float32)
    with torch.no_grad():
        idx = rest_BT.reshape(-1).nonzero().squeeze(1)
        out[idx] = _select_logprobs(head, H_ND.detach(), flat_src[idx], flat_tgt[idx])
    idx = grad_BT.reshape(-1).nonzero().squeeze(1)
    if idx.numel():
        out = out.index_put((idx,), _select_logprobs(head, H_ND, flat_src[idx], flat_tgt[idx]))
    return out.reshape(B, T)


__all__ = [
    "LOGIT_CHUNK",
    "MIN_SHARED_PREFIX",
    "pass_cost",
    "plan_micro_batches",
    "score",
    "shared_prefix_len",
    "token_micro_batches",
]
