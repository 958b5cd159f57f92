"""A batch in progress on the hf backend takes requests between its steps (continuous batching):
a request that joins it, whatever the batch holds and however long its prompt, draws what it
draws alone, and rows that end leave the cache. The real hf backend on the tiny model."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator

import pytest
import torch

from polytinker.engine.inference import random_adapter
from polytinker.engine.inference._decode import DecodeBatch
from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import AdapterRef, SampleRequest, SampleResult, SamplingParams
from polytinker.errors import ModelError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True)
SHORT = (1, 9690, 198)
LONG_PROMPT = tuple(range(300, 340))


@pytest.fixture(scope="module")
def backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)
    b = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    for seed, name in enumerate("xy"):
        b.load_adapter(random_adapter(b.model, AdapterRef(name, 1), seed=seed, scale=0.2))
    yield b
    b.close()


def _request(
    prompt: tuple[int, ...], params: SamplingParams = GREEDY, adapter: str | None = None, num_samples: int = 1
) -> SampleRequest:
    ref = AdapterRef(adapter, 1) if adapter else None
    return SampleRequest(prompt_token_ids=prompt, adapter=ref, params=params, num_samples=num_samples)


def _tokens(result: SampleResult) -> list[tuple[int, ...]]:
    return [s.token_ids for s in result.sequences]


def _alone(backend: HFBackend, request: SampleRequest) -> SampleResult:
    return backend.sample([request])[0]


def test_requests_that_join_between_steps_draw_what_they_draw_alone(backend: HFBackend) -> None:
    """A long-prompt request joins a batch whose cache is shorter, a short one joins a longer
    cache, on other adapters, seeded with several samples and greedy: every answer is its answer
    alone, and each is returned at the step it ends."""
    first = _request(SHORT, dataclasses.replace(GREEDY, max_tokens=20), "x")
    seeded = _request(LONG_PROMPT, SEEDED, "y", num_samples=3)
    joiners: list[tuple[Hashable, SampleRequest]] = [
        ("long prompt", seeded),
        ("base", _request((*SHORT, 5, 6), GREEDY)),
        ("same adapter", _request(LONG_PROMPT[:7], GREEDY, "x")),
    ]
    batch = backend.open_batch()
    ended: dict[Hashable, SampleResult] = dict(batch.add([("first", first)]))
    ended_at: dict[Hashable, int] = {}
    step = 0
    while batch.rows:
        if step in (1, 3) and joiners:
            ended.update(batch.add([joiners.pop(0)] + ([joiners.pop(0)] if step == 3 else [])))
        done = batch.step()
        step += 1
        ended_at.update((key, step) for key, _ in done)
        ended.update(done)
    assert set(ended) == {"first", "long prompt", "base", "same adapter"}
    for key, request in [("first", first), ("long prompt", seeded)]:
        alone = _alone(backend, request)
        assert _tokens(ended[key]) == _tokens(alone), key
        for got, want in zip(ended[key].sequences, alone.sequences, strict=True):
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert _tokens(ended["base"]) == _tokens(_alone(backend, _request((*SHORT, 5, 6), GREEDY)))
    assert _tokens(ended["same adapter"]) == _tokens(_alone(backend, _request(LONG_PROMPT[:7], GREEDY, "x")))
    # Joined at steps 1 and 3: the 6-token requests end 5 steps later (their first token comes
    # from the prefill), the 20-token one at step 19, long before the batch's last step.
    assert ended_at["base"] == ended_at["same adapter"] == 8 and ended_at["first"] == 19


def test_rows_that_end_leave_the_cache_and_its_unused_positions(backend: HFBackend) -> None:
    """A 40-token prompt joins, ends, and leaves: the short rows that remain attend to their own
    positions only (the cache is cut back to them) and still draw their answer alone."""
    batch = backend.open_batch()
    batch.add([("short", _request(SHORT, dataclasses.replace(GREEDY, max_tokens=12)))])
    batch.add([("long", _request(LONG_PROMPT, dataclasses.replace(GREEDY, max_tokens=2)))])
    state = batch._state
    assert state is not None and state.mask_BL.shape[1] == len(LONG_PROMPT)
    ended = dict(batch.step())
    assert "long" in ended and batch.rows == 1
    state = batch._state
    assert state is not None and state.mask_BL.shape[1] == len(SHORT) + 1 and bool(state.mask_BL.all())
    while batch.rows:
        ended.update(batch.step())
    want = _alone(backend, _request(SHORT, dataclasses.replace(GREEDY, max_tokens=12)))
    assert _tokens(ended["short"]) == _tokens(want)


def test_a_failed_join_leaves_the_batch_as_it_was(backend: HFBackend) -> None:
    batch = backend.open_batch()
    batch.add([("a", _request(SHORT))])
    with pytest.raises(Exception, match="not loaded"):
        batch.add([("b", _request(SHORT, adapter="nope")), ("c", _request(SHORT))])
    with pytest.raises(ModelError, match="already in the batch"):
        batch.add([("a", _request(SHORT))])
    ended: dict[Hashable, SampleResult] = {}
    while batch.rows:
        ended.update(batch.step())
    assert list(ended) == ["a"] and len(batch) == 0
    assert _tokens(ended["a"]) == _tokens(_alone(backend, _request(SHORT)))


def test_a_batch_of_requests_that_end_at_once_is_empty(backend: HFBackend) -> None:
    batch = backend.open_batch()
    choices = SamplingParams(max_tokens=3, temperature=0, choices=((5, 6), (7,)))
    ended = dict(
        batch.add(
            [("one", _request(SHORT, dataclasses.replace(GREEDY, max_tokens=1))), ("c", _request(SHORT, choices))]
        )
    )
    assert set(ended) == {"one", "c"} and batch.rows == 0 and batch.step() == []


def test_decode_batch_is_what_sample_uses(backend: HFBackend) -> None:
    assert isinstance(backend.open_batch(), DecodeBatch) and backend.joins
