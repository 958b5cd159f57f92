"""Many LoRA adapters on one model, applied per row segment of a batch.

peft's mixed-batch path (``adapter_names=[...]``) registers hooks on every LoRA layer for each
forward call and gathers each adapter's rows with advanced indexing in every layer; on a small
model on a CPU that cost ~25% of a decode step. Here the backend sorts a batch's rows by
adapter, so each adapter owns one contiguous slice of rows, and sets those segments once per
forward call; each wrapped linear layer then adds ``scale * B(A(x[rows]))`` on a view of its
output. A batch with one adapter costs what a single-adapter peft model costs.

A batch of several adapters is computed as one batched product instead of a loop over them
(``_Grouped``): each adapter's rows, padded to the longest run, gathered into an
``[adapters, rows, in]`` block and multiplied by the stacked A and B of those adapters with two
``bmm``s, then added back to their rows. Five ops per layer whatever the number of adapters,
where the loop issued five per adapter: on a GPU each op is a kernel launch (8 adapters decoded
at 0.7x one adapter's speed with the loop), on a CPU each is dispatch overhead. A forward of 16
rows of the default model on 2 shared cores: over 16 adapters 270 ms batched, 343 ms with the
loop, 256 ms on one adapter; over 4 adapters 236, 234 and 231 ms (the same). The stacks are
built once per set of adapters and layer, and kept while that set keeps decoding. Stacks of
earlier sets are kept too (a batch's set and that of the requests joining it alternate), the
oldest dropped first, so that all of them together hold no more than the loaded adapters do: a
stack is a copy, and with many agents the sets change at every join, so kept by count (8) they
held three copies of every adapter (894 MB over 16 agents of the default model at rank 16).

Each update is accumulated into the base layer's output in place (``addmm_``/``baddbmm_``, the
scale folded into the product): two ops per layer on one adapter, where ``y + B(A(x)) * scale``
takes four and two temporaries of the output's size. When the runs are equal and sit one after
another from the first row (the usual mixed decode batch: the engine sorts its rows by adapter),
the rows are already in their padded places, so the gathers and the scatter back are skipped
(``_Grouped.dense``): two ``bmm``s on views of the input and the output.

Tensors arrive in peft's layout (``base_model.model.<module>.lora_A.weight``) and use peft's
scaling (``alpha / rank``), so an adapter trained with peft behaves the same here; a test checks
the two against each other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from polytinker.engine.adapter_weights import AdapterWeights, TensorLayout
from polytinker.errors import ModelError

_PREFIX = "base_model.model."
_MAX_PLANS = 64  # layouts remembered as checked: one per adapter shape in use
_MAX_SPARES = 4  # unloaded adapters' buffers kept for reuse: new versions copy into warm memory
# Padding one adapter's rows to the longest run costs LoRA flops on rows that are thrown away;
# past this many padded places per real row the loop over adapters is cheaper.
_MAX_PADDING = 2.0


_Pair = tuple[torch.Tensor, torch.Tensor]
# One slot's adapter as the wrapped layers read it: (A, B) views per layer index, and its scale.
_Table = tuple[dict[int, _Pair], float]


@dataclass
class _Held:
    """One slot's adapter on the model's device: its flat buffer, which its table's views are of.
    ``owned``: the engine made the buffer, so it may write it again (as a spare); a version served
    from the buffer it came in is read-only."""

    flat: torch.Tensor
    table: _Table
    owned: bool


@dataclass(frozen=True)
class _Grouped:
    """The adapter runs of one forward call laid out for batched products: run ``i``'s rows sit at
    padded places ``i * width ..``; ``gather`` names the row at each place (padding repeats the
    run's first row, whose products are dropped), ``places`` the places that hold real rows and
    ``rows`` the row each of those is."""

    slots: tuple[str, ...]
    width: int
    gather: torch.Tensor
    places: torch.Tensor
    rows: torch.Tensor
    # Run i is rows i * width .. (i + 1) * width: every place is its own row, no gather needed.
    dense: bool


@dataclass
class Router:
    """Which adapter serves which rows in the current forward call: (slot, start, stop) runs, and
    each loaded slot's table. One object all wrapped layers share, so loading or unloading a
    version is one entry here, not one per layer."""

    segments: list[tuple[str, int, int]] = field(default_factory=list)
    tables: dict[str, _Table] = field(default_factory=dict)
    grouped: _Grouped | None = None
    # Stacked (A^T, scale * B^T) per layer index, per set of slots, oldest set first; None where
    # none has the layer. Their bytes in all, and the most they may hold (the loaded adapters'
    # bytes; None: to be summed again, the tables changed).
    _stacks: dict[tuple[str, ...], dict[int, _Pair | None]] = field(default_factory=dict)
    _stacked_bytes: int = 0
    _budget: int | None = None

    def set_rows(self, slots: list[str], device: torch.device | None = None) -> None:
        """Run-length encode one slot name per row (rows sorted by slot give one run each)."""
        runs: list[tuple[str, int, int]] = []
        for i, slot in enumerate(slots):
            if runs and runs[-1][0] == slot:
                runs[-1] = (slot, runs[-1][1], i + 1)
            else:
                runs.append((slot, i, i + 1))
        self.segments = runs
        self.grouped = _group([r for r in runs if r[0] in self.tables], device)

    def forget(self) -> None:
        """Drop the stacked weights: a slot's tables changed."""
        self._stacks.clear()
        self._stacked_bytes, self._budget = 0, None

    def stacked(self, index: int) -> _Pair | None:
        """Layer ``index``'s weights of the grouped slots, stacked for ``bmm`` (built on first use;
        older sets' stacks are dropped, oldest first, while all of them hold more than the loaded
        adapters do; the grouped set's own never are)."""
        assert self.grouped is not None
        slots = self.grouped.slots
        layers = self._stacks.get(slots)
        if layers is None or next(reversed(self._stacks)) != slots:  # (re-)inserted last: oldest first
            layers = self._stacks[slots] = self._stacks.pop(slots, {})
        if index not in layers:
            pair = layers[index] = _stack([(self.tables[s][0].get(index), self.tables[s][1]) for s in slots])
            self._stacked_bytes += _nbytes(pair)
            self._drop_stacks_over_budget()
        return layers[index]

    def _drop_stacks_over_budget(self) -> None:
        if self._budget is None:
            self._budget = sum(_nbytes(pair) for layers, _ in self.tables.values() for pair in layers.values())
        while self._stacked_bytes > self._budget and len(self._stacks) > 1:
            dropped = self._stacks.pop(next(iter(self._stacks)))
            self._stacked_bytes -= sum(_nbytes(pair) for pair in dropped.values())


def _nbytes(pair: _Pair | None) -> int:
    return 0 if pair is None else pair[0].nbytes + pair[1].nbytes


def _group(runs: list[tuple[str, int, int]], device: torch.device | None) -> _Grouped | None:
    """The batched layout of two or more adapter runs, or None where the loop is the better way
    (one run, or runs so uneven that padding would cost more than it saves)."""
    if len(runs) < 2:
        return None
    width = max(stop - start for _, start, stop in runs)
    real = sum(stop - start for _, start, stop in runs)
    if len(runs) * width > _MAX_PADDING * real:
        return None
    gather: list[int] = []
    places: list[int] = []
    for i, (_, start, stop) in enumerate(runs):
        gather += list(range(start, stop)) + [start] * (width - (stop - start))
        places += range(i * width, i * width + stop - start)
    rows = [gather[p] for p in places]
    dense = all(start == i * width and stop == start + width for i, (_, start, stop) in enumerate(runs))
    index = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return _Grouped(tuple(r[0] for r in runs), width, index(gather), index(places), index(rows), dense)


def _stack(
    loras: list[tuple[tuple[torch.Tensor, torch.Tensor] | None, float]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A^T stacked: [n, in, r], scale * B^T stacked: [n, r, out]), ranks padded with zeros to the
    largest (a zero row of A and column of B add nothing); an adapter without the layer adds zeros."""
    present = [pair for pair, _ in loras if pair is not None]
    if not present:
        return None
    # The usual case, every adapter of one shape: three ops, not two per adapter.
    if len(present) == len(loras) and len({a.shape for a, _ in present}) == 1:
        scales = present[0][1].new_tensor([scale for _, scale in loras])[:, None, None]
        return torch.stack([a.t() for a, _ in present]), torch.stack([b.t() for _, b in present]) * scales
    a0, b0 = present[0]
    rank = max(a.shape[0] for a, _ in present)
    a_t = a0.new_zeros(len(loras), a0.shape[1], rank)
    b_t = b0.new_zeros(len(loras), rank, b0.shape[0])
    for i, (pair, scale) in enumerate(loras):
        if pair is not None:
            a, b = pair
            a_t[i, :, : a.shape[0]] = a.t()
            b_t[i, : b.shape[1]] = b.t() * scale
    return a_t, b_t


def _add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """``y += scale * B(A(x))`` in place, ``y`` being the base layer's output for ``x`` (rows
    first, contiguous: a slice of rows of it is too): one product into ``y``'s own memory."""
    xa = F.linear(x, a)
    y.view(-1, y.shape[-1]).addmm_(xa.reshape(-1, xa.shape[-1]), b.t(), alpha=scale)


class MultiLoraLinear(nn.Module):
    """A frozen linear layer plus any number of LoRA updates, each applied to its rows only.
    ``index`` is the layer's key in every slot's table."""

    def __init__(self, base: nn.Linear, router: Router, index: int) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.router.grouped is not None:
            return self._grouped(x, y, self.router.grouped)
        rows = x.shape[0]
        for slot, start, stop in self.router.segments:
            table = self.router.tables.get(slot)
            if table is None:  # the base model's rows
                continue
            lora = table[0].get(self.index)
            if lora is None:  # an adapter that leaves this layer alone
                continue
            (a, b), scale = lora, table[1]
            part = (x, y) if start == 0 and stop == rows else (x[start:stop], y[start:stop])
            _add_lora(*part, a, b, scale)
        return y

    def _grouped(self, x: torch.Tensor, y: torch.Tensor, grouped: _Grouped) -> torch.Tensor:
        """Every adapter run's update in two ``bmm``s over its padded rows (see _Grouped)."""
        stacks = self.router.stacked(self.index)
        if stacks is None:  # no adapter of this batch touches the layer
            return y
        a_t, b_t = stacks
        n, features = len(grouped.slots), x.shape[-1]
        if grouped.dense:  # y's rows are the blocks' places: accumulate into views of them
            rows = n * grouped.width
            blocks = x[:rows].reshape(n, -1, features)
            y[:rows].view(n, -1, y.shape[-1]).baddbmm_(torch.bmm(blocks, a_t), b_t)
            return y
        blocks = x.index_select(0, grouped.gather).reshape(n, -1, features)
        update = torch.bmm(torch.bmm(blocks, a_t), b_t)
        update = update.reshape(n * grouped.width, *y.shape[1:]).index_select(0, grouped.places)
        return y.index_add_(0, grouped.rows, update)


class MultiLora:
    """Installs :class:`MultiLoraLinear` wrappers into a model and manages adapter slots."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.router = Router()
        self._layers: dict[str, MultiLoraLinear] = {}  # module path -> wrapper
        self._held: dict[str, tuple[Any, _Held]] = {}  # slot -> (layout, dtype, device), its buffer
        self._spares: list[tuple[Any, _Held]] = []  # unloaded slots' buffers, oldest first
        self._wrapped: set[str] = set()  # target module names already wrapped everywhere
        self._plans: dict[TensorLayout, list[tuple[int, int, int]]] = {}  # checked layouts (_plan)

    def _wrap(self, targets: tuple[str, ...]) -> None:
        if self._wrapped.issuperset(targets):  # the walk over every module, once per target set
            return
        self._wrapped.update(targets)
        for path, module in list(self.model.named_modules()):
            if path in self._layers or not isinstance(module, nn.Linear):
                continue
            if path.rsplit(".", 1)[-1] not in targets or isinstance(module, MultiLoraLinear):
                continue
            parent_path, _, child = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            wrapper = MultiLoraLinear(module, self.router, index=len(self._layers))
            setattr(parent, child, wrapper)
            self._layers[path] = wrapper

    def load(self, slot: str, weights: AdapterWeights, dtype: torch.dtype, device: torch.device | None = None) -> None:
        """Put ``weights`` in ``slot`` (replacing what was there); checks every tensor fits.

        A version already in the engine's dtype and on its device is served from its own buffer
        (an ``AdapterWeights`` is a snapshot nothing writes: the learner's export, or the frame it
        arrived in): no copy, only views. Any other is copied in one op (dtype and device
        conversion included) into a buffer of the engine's own: a spare of the same layout that an
        unloaded version left, else a new one. No per-tensor work but making the views."""
        self._wrap(weights.config.target_modules)
        plan = self._plan(weights)
        on = device or next(iter(self._layers.values())).base.weight.device
        key = (weights.layout, dtype, on)
        scale = weights.config.alpha / weights.config.rank
        spare = next((i for i, (k, _) in enumerate(self._spares) if k == key), None)
        if weights.flat.dtype == dtype and weights.flat.device == on:
            held = _Held(weights.flat.detach(), _table(weights.flat, weights.layout, plan, scale), owned=False)
        elif spare is not None:
            held = self._spares.pop(spare)[1]
            with torch.no_grad():
                held.flat.copy_(weights.flat)
            held.table = (held.table[0], scale)
        else:
            flat = weights.flat.detach().to(on, dtype, copy=True)
            held = _Held(flat, _table(flat, weights.layout, plan, scale), owned=True)
        self.unload(slot)
        self._held[slot] = (key, held)
        self.router.tables[slot] = held.table
        self.router.forget()

    def _plan(self, weights: AdapterWeights) -> list[tuple[int, int, int]]:
        """(layer index, index of A, index of B) per layer, checked against the model; one check
        per layout (an adapter's versions share theirs)."""
        plan = self._plans.get(weights.layout)
        if plan is not None:
            return plan
        pairs: dict[str, dict[str, int]] = {}
        for i, key in enumerate(weights.layout.names):
            if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise ModelError(f"adapter {weights.ref}: unexpected tensor {key!r}; keys follow peft's layout")
            path, kind = key[len(_PREFIX) :].rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            pairs.setdefault(path, {})[kind] = i
        shapes = weights.layout.shapes
        plan = []
        for path, pair in pairs.items():
            layer = self._layers.get(path)
            if layer is None or set(pair) != {"lora_A", "lora_B"}:
                raise ModelError(f"adapter {weights.ref}: {path!r} is not a target linear layer with lora_A and lora_B")
            a, b = shapes[pair["lora_A"]], shapes[pair["lora_B"]]
            fits = len(a) == len(b) == 2 and a[1] == layer.base.in_features and b[0] == layer.base.out_features
            if not fits or a[0] != b[1]:
                raise ModelError(
                    f"adapter {weights.ref}: {path} has A {a}, B {b}; the layer is "
                    f"{layer.base.in_features} -> {layer.base.out_features}"
                )
            plan.append((layer.index, pair["lora_A"], pair["lora_B"]))
        if len(self._plans) >= _MAX_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[weights.layout] = plan
        return plan

    def unload(self, slot: str) -> None:
        """Free ``slot``; its buffer becomes a spare for the next version of the same layout
        (the engine unloads a version only once no request uses it)."""
        entry = self._held.pop(slot, None)
        if entry is None:
            return
        key, held = entry
        self.router.tables.pop(slot, None)
        self.router.forget()
        if held.owned:
            self._spares.append((key, held))
            del self._spares[:-_MAX_SPARES]


def _table(flat: torch.Tensor, layout: TensorLayout, plan: list[tuple[int, int, int]], scale: float) -> _Table:
    views = list(layout.split(flat).values())
    return {layer: (views[i_a], views[i_b]) for layer, i_a, i_b in plan}, scale


__all__ = ["MultiLora", "MultiLoraLinear", "Router"]
