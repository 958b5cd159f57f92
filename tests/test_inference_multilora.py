"""The hf backend's adapters in one mixed batch: the batched products (every adapter's rows in two
``bmm``s) against the loop over adapters, on the tiny model, with adapters of different ranks and
layers, base-model rows among them, prefill and decode shapes, and a new version of an adapter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from polytinker.engine.inference import _multilora, random_adapter
from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.inference.hf import BASE, HFBackend
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import AdapterRef, LoraConfig

WIDE = AdapterRef("wide")  # rank 16 on every default target
NARROW = AdapterRef("narrow")  # rank 4 on q_proj and v_proj only
OTHER = AdapterRef("other")


@pytest.fixture(scope="module")
def backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)
    b = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    b.load_adapter(random_adapter(b.model, WIDE, seed=1, scale=0.2))
    b.load_adapter(random_adapter(b.model, NARROW, LoraConfig(rank=4, target_modules=("q_proj", "v_proj")), seed=2))
    b.load_adapter(random_adapter(b.model, OTHER, seed=3, scale=0.2))
    yield b
    b.close()


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.arange(rows * length).reshape(rows, length) % 500 + 7


def _logits(backend: HFBackend, slots: list[str], length: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    ids = _ids(len(slots), length) if ids is None else ids
    with torch.inference_mode():
        return backend._forward(ids, torch.ones_like(ids), None, slots)


@pytest.mark.parametrize("length", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "runs",
    [
        [(WIDE, 2), (NARROW, 2), (OTHER, 2)],  # equal runs, ranks 16 and 4, a layer only some have
        [(None, 1), (WIDE, 3), (NARROW, 2)],  # base-model rows first, uneven runs
        [(NARROW, 1), (OTHER, 2), (None, 2), (WIDE, 1)],
    ],
    ids=["equal", "base-and-uneven", "mixed"],
)
def test_batched_adapters_equal_the_loop_over_them(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch, runs: list[tuple[AdapterRef | None, int]], length: int
) -> None:
    slots = [backend._adapter_name(ref) for ref, count in runs for _ in range(count)]
    batched = _logits(backend, slots, length)
    assert backend._lora.router.grouped is not None, "this batch should take the batched path"
    monkeypatch.setattr(_multilora, "_MAX_PADDING", 0.0)  # no layout qualifies: the loop
    looped = _logits(backend, slots, length)
    assert backend._lora.router.grouped is None
    torch.testing.assert_close(batched, looped, rtol=1e-4, atol=1e-4)
    # and each row as it comes out alone, on its adapter only
    for row, slot in enumerate(slots):
        alone = _logits(backend, [slot], length, _ids(len(slots), length)[row : row + 1])[0]
        torch.testing.assert_close(batched[row], alone, rtol=1e-4, atol=1e-4)


def test_uneven_runs_fall_back_to_the_loop(backend: HFBackend) -> None:
    """One long run and short ones: padding every run to the longest would cost more than it saves."""
    slots = [backend._adapter_name(WIDE)] * 12 + [backend._adapter_name(NARROW), backend._adapter_name(OTHER)]
    _logits(backend, slots, 1)
    assert backend._lora.router.grouped is None
    slots = [BASE] * 3 + [backend._adapter_name(WIDE)]  # one adapter among base rows: the loop
    _logits(backend, slots, 1)
    assert backend._lora.router.grouped is None


def test_a_new_version_replaces_the_stacked_weights(backend: HFBackend) -> None:
    """Loading a version into a slot the stacks hold: the next batch uses the new weights."""
    ref = AdapterRef("swapped")
    backend.load_adapter(random_adapter(backend.model, ref, seed=10, scale=0.2))
    slots = [backend._adapter_name(ref), backend._adapter_name(OTHER)]
    before = _logits(backend, slots, 1)
    backend.load_adapter(random_adapter(backend.model, ref, seed=11, scale=0.2))
    after = _logits(backend, slots, 1)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], rtol=0, atol=0)
    torch.testing.assert_close(after[0], _logits(backend, slots[:1], 1, _ids(2, 1)[:1])[0], rtol=1e-4, atol=1e-4)
    backend.unload_adapter(ref)


def test_the_stacks_of_many_sets_hold_no_more_than_the_adapters(backend: HFBackend) -> None:
    """Batches over ever new sets of adapters (as many agents' groups join and leave): the stacked
    copies kept for earlier sets are dropped, oldest first, while all of them would hold more than
    the loaded adapters do; the set in use keeps its stack, and every batch is still right."""
    extra = [AdapterRef(f"agent{i}") for i in range(6)]
    for i, ref in enumerate(extra):
        backend.load_adapter(random_adapter(backend.model, ref, seed=20 + i, scale=0.2))
    try:
        router = backend._lora.router
        names = [backend._adapter_name(ref) for ref in extra]
        loaded = sum(_multilora._nbytes(p) for layers, _ in router.tables.values() for p in layers.values())
        sets = [names[i : i + 3] for i in range(4)] + [names[:2], names[4:], names[::2]]
        for chosen in sets:
            slots = [name for name in chosen for _ in range(2)]
            batched = _logits(backend, slots, 1)
            assert router.grouped is not None and router.grouped.slots == tuple(chosen)
            assert tuple(chosen) in router._stacks, "the set in use keeps its stack"
            held = sum(_multilora._nbytes(p) for layers in router._stacks.values() for p in layers.values())
            assert held == router._stacked_bytes <= loaded
            for row, slot in enumerate(slots):
                alone = _logits(backend, [slot], 1, _ids(len(slots), 1)[row : row + 1])[0]
                torch.testing.assert_close(batched[row], alone, rtol=1e-4, atol=1e-4)
        assert len(router._stacks) < len(sets), "earlier sets' stacks were dropped"
    finally:
        for ref in extra:
            backend.unload_adapter(ref)
