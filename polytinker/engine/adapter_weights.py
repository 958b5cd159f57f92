"""An adapter version in memory: its tensors packed back to back in one flat buffer.

- ``TensorLayout``: the names and shapes of the tensors in such a buffer, in order (sent, checked
  and compared with every version, so kept compact);
- ``AdapterWeights``: one adapter version, its ``AdapterRef`` and ``LoraConfig`` with the flat
  buffer and its layout; the tensors, keyed as in peft's ``adapter_model.safetensors``, are views
  of the buffer.

Their own home, apart from the engine's vocabulary (``polytinker.engine.types``, which they
build on): this is how a version is packed, exported, moved and installed, and the only part of
that vocabulary that holds tensors. The layout is registered as a message
(``sched.tensor_layout``) where the message that carries it is defined,
``polytinker.engine.worker.replies``. Torch is imported only where a tensor is made, so a process
that merely decodes layouts needs none.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from polytinker.engine.types import AdapterRef, LoraConfig
from polytinker.errors import ConfigError

if TYPE_CHECKING:  # only a type here: processes that decode layouts need no torch
    import torch

MAX_LAYOUT_TENSORS = 1 << 16  # the most tensors one TensorLayout may name (a 70B LoRA on every linear has ~5600)
MAX_TENSOR_DIMS = 8
MAX_INTERNED_LAYOUTS = 64  # distinct adapter layouts remembered (TensorLayout.interned)


@dataclass(frozen=True)
class TensorLayout:
    """Names and shapes of tensors stored back to back, in this order, in one flat 1-D buffer.

    An adapter version moves and installs as that one buffer: on a CPU every tensor op costs
    ~8 us of dispatch, and a LoRA on every linear layer of a 30-layer model has 420 tensors, so
    per-tensor copies cost 4x one memcpy of the same bytes (benchmarks/_engine_learner.py). The
    layout itself is compact for the same reason (it is sent, checked and compared with every
    version): ``joined_names`` is the names joined by newlines, ``dims`` every shape's dims one
    after another, ``ndims`` how many dims each shape has (1 to 8). Build one with
    :meth:`of_shapes` or :meth:`of`; read it through ``names``, ``shapes``, ``sizes``."""

    joined_names: str
    dims: tuple[int, ...]
    ndims: tuple[int, ...]

    def __post_init__(self) -> None:
        # Whole-sequence checks at C speed: a layout has hundreds of entries.
        n = self.joined_names.count("\n") + 1 if isinstance(self.joined_names, str) and self.joined_names else 0
        ok = (
            isinstance(self.joined_names, str)
            and isinstance(self.dims, tuple)
            and isinstance(self.ndims, tuple)
            and n == len(self.ndims) <= MAX_LAYOUT_TENSORS
            and set(map(type, self.dims)) <= {int}
            and set(map(type, self.ndims)) <= {int}
            and min(self.dims, default=0) >= 0
            and min(self.ndims, default=1) >= 1
            and max(self.ndims, default=1) <= MAX_TENSOR_DIMS
            and sum(self.ndims) == len(self.dims)
        )
        if not ok:
            raise ConfigError(
                f"TensorLayout: as many newline-separated names as ndims (at most {MAX_LAYOUT_TENSORS}), "
                f"each shape 1 to {MAX_TENSOR_DIMS} dims >= 0, dims as many as the ndims add up to"
            )

    @classmethod
    def of_shapes(cls, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> TensorLayout:
        if len(names) != len(shapes) or any("\n" in n or not n for n in names):
            raise ConfigError("TensorLayout: one non-empty name without a newline per shape")
        dims = tuple(int(d) for shape in shapes for d in shape)
        return cls("\n".join(names), dims, tuple(len(shape) for shape in shapes))

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> TensorLayout:
        return cls.of_shapes(list(tensors), [tuple(t.shape) for t in tensors.values()])

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(self.joined_names.split("\n")) if self.joined_names else ()

    @functools.cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        bounds = itertools.accumulate(self.ndims, initial=0)
        return tuple(self.dims[a:b] for a, b in itertools.pairwise(bounds))

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(map(math.prod, self.shapes))

    @functools.cached_property
    def numel(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in the flat buffer, in elements."""
        return tuple(itertools.accumulate(self.sizes, initial=0))[:-1]

    def interned(self) -> TensorLayout:
        """The first-seen layout equal to this one (bounded memo): an engine receives the same
        layout with every version, and keys its checks on it; a known object hashes and
        compares at no cost, and keeps its cached names and sizes."""
        with _LAYOUTS_LOCK:  # decodes run on several threads
            known = _LAYOUTS.get(self)
            if known is None:
                if len(_LAYOUTS) >= MAX_INTERNED_LAYOUTS:
                    _LAYOUTS.pop(next(iter(_LAYOUTS)))
                known = _LAYOUTS[self] = self
            return known

    @functools.cached_property
    def runs(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(shape, count) per run of consecutive tensors of one shape."""
        return tuple((shape, len(list(group))) for shape, group in itertools.groupby(self.shapes))

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat``, one per tensor (no copy). A run of equal shapes is one
        ``view(count, *shape)`` unbound in C++: an adapter's 420 views cost what a copy of its
        buffer did when each was made in Python, and a learner orders its layout by shape."""
        import torch

        blocks = torch.split(flat, [math.prod(shape) * count for shape, count in self.runs])
        parts: list[torch.Tensor] = []
        for block, (shape, count) in zip(blocks, self.runs, strict=True):
            parts.extend(block.view(count, *shape).unbind(0))
        return dict(zip(self.names, parts, strict=True))

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``tensors`` (this layout's names) copied into one new flat buffer."""
        import torch

        first = tensors[self.names[0]]
        flat = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for view, name in zip(torch.split(flat, list(self.sizes)), self.names, strict=True):
                view.copy_(tensors[name].reshape(-1))
        return flat


_LAYOUTS: dict[TensorLayout, TensorLayout] = {}
_LAYOUTS_LOCK = threading.Lock()


@dataclass
class AdapterWeights:
    """One adapter version: its tensors keyed as peft saves them
    (``base_model.model.<module path>.lora_A.weight``), packed in ``flat`` as ``layout`` says.

    A snapshot: nothing writes ``flat`` after it is made (``export_adapter`` copies the
    learner's live buffer; an engine copies it into a buffer of its own)."""

    ref: AdapterRef
    config: LoraConfig
    flat: torch.Tensor
    layout: TensorLayout

    def __post_init__(self) -> None:
        if not self.layout.ndims:
            raise ConfigError(f"adapter {self.ref} has no tensors")
        if self.flat.dim() != 1 or self.flat.numel() != self.layout.numel:
            raise ConfigError(
                f"adapter {self.ref}: a flat buffer of shape {tuple(self.flat.shape)} does not hold "
                f"{len(self.layout.names)} tensors of {self.layout.numel} elements"
            )

    @classmethod
    def pack(cls, ref: AdapterRef, config: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> AdapterWeights:
        """From separate tensors (a safetensors file, a test): one copy into a flat buffer."""
        if not tensors:
            raise ConfigError(f"adapter {ref} has no tensors")
        layout = TensorLayout.of(tensors)
        return cls(ref, config, layout.pack(tensors), layout)

    @functools.cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by peft key: views of ``flat``."""
        return self.layout.split(self.flat)

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


__all__ = ["MAX_INTERNED_LAYOUTS", "MAX_LAYOUT_TENSORS", "MAX_TENSOR_DIMS", "AdapterWeights", "TensorLayout"]
