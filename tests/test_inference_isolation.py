"""Tenants sharing one engine cannot hurt each other: a bad request fails alone, a big request is
split and takes turns with the others, a caller that asks for N samples gets N. The real hf
backend on the tiny model (and the same checks on vLLM where it is installed)."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from polytinker.engine.inference import random_adapter
from polytinker.engine.inference._queue import Pending
from polytinker.engine.inference.config import EngineConfig, HFBackendConfig
from polytinker.engine.inference.engine import InferenceEngine
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.inference.worker import EngineWorker
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import AdapterRef, SampleRequest, SampleResult, SamplingParams
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import EngineWorkerConfig
from polytinker.scheduler.service.replies import SampleReply

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# Tenant A's eight prompts: distinct, so each answer can be told from the others.
PROMPTS = [(1, 9690, 198, 2683, 359, 253 + i) for i in range(8)]


@pytest.fixture(scope="module")
def backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)
    b = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    yield b
    b.close()


def _engine(backend: HFBackend, **config: Any) -> InferenceEngine:
    for ref in backend.loaded_adapters():  # engines share the module's backend: start clean
        backend.unload_adapter(ref)
    return InferenceEngine(backend, EngineConfig(**config))


def _request(
    prompt: tuple[int, ...], params: SamplingParams = GREEDY, ref: AdapterRef | None = None, num_samples: int = 1
) -> SampleRequest:
    return SampleRequest(prompt_token_ids=prompt, adapter=ref, params=params, num_samples=num_samples)


def _tokens(result: SampleResult | SampleReply) -> list[list[int]]:
    if isinstance(result, SampleReply):
        return [list(s.tokens) for s in result.sequences]
    return [list(s.token_ids) for s in result.sequences]


def _alone(backend: HFBackend) -> list[list[list[int]]]:
    """What tenant A's eight requests answer, each in a batch of its own."""
    return [_tokens(backend.sample([_request(p)])[0]) for p in PROMPTS]


def _concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` at once on threads; each one's result, or the exception it raised."""
    out: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = calls[i]()
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


# ----- a bad request fails alone -----


@pytest.mark.parametrize("bad_id", [10**6, -5])
def test_a_bad_token_id_through_the_engine_worker_fails_only_its_request(
    backend: HFBackend, tmp_path: Path, bad_id: int
) -> None:
    """Tenant B's prompt with an id outside the vocabulary, sent as the scheduler sends it, while
    tenant A has eight requests in flight: A gets all eight answers, the same as alone; B gets a
    ConfigError naming the field, before its request shares a batch."""
    expected = _alone(backend)
    worker = EngineWorker(TINY_RANDOM, EngineWorkerConfig(batch_window_s=0.5, max_batch_size=9), tmp_path, backend)
    engine = worker.engine
    try:
        good = [wm.EngineSample("", 0, None, p, 1, GREEDY, tag="A") for p in PROMPTS]
        bad = wm.EngineSample("", 0, None, (1, 9690, bad_id, 253), 1, GREEDY, tag="B")
        out = _concurrently([lambda m=m: worker.sample(m) for m in [*good[:4], bad, *good[4:]]])
        got_b = out.pop(4)
        assert isinstance(got_b, ConfigError) and "prompt_token_ids" in str(got_b) and str(bad_id) in str(got_b)
        assert [_tokens(r) for r in out] == expected
        assert engine.stats.failed_batches == 0, "B was refused at the door, not in a batch"
        assert sum(engine.stats.batch_sizes) == 8
    finally:
        worker.full.close()
        engine.close(close_backend=False)


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("stop_token_ids", SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(10**6,))),
        ("choices[1]", SamplingParams(max_tokens=4, temperature=0, choices=((5, 2), (10**6, 2)))),
    ],
)
def test_ids_in_sampling_params_are_checked_at_the_door(backend: HFBackend, field: str, params: SamplingParams) -> None:
    engine = _engine(backend, batch_window_s=0.0)
    try:
        with pytest.raises(ConfigError, match=re.escape(f"SamplingParams.{field}:")):
            engine.submit(_request(PROMPTS[0], params), tenant="B")
        too_long = tuple([1] * backend.max_model_len)
        with pytest.raises(ConfigError, match=r"prompt_token_ids.*no room"):
            engine.submit(_request(too_long), tenant="B")
        assert engine.stats.requests == 0 and len(engine._queue) == 0
    finally:
        engine.close(close_backend=False)


def _with_culprit(engine: InferenceEngine, culprit: Callable[[], Future[SampleResult]]) -> list[Any]:
    """Tenant A's eight requests and B's culprit, submitted so that all nine meet in one batch."""
    futures = [engine.submit(_request(p), tenant="A") for p in PROMPTS[:4]]
    futures.append(culprit())
    futures += [engine.submit(_request(p), tenant="A") for p in PROMPTS[4:]]
    out: list[Any] = []
    for f in futures:
        try:
            out.append(f.result(timeout=120))
        except Exception as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("bad_id", [10**6, -5])
def test_a_failing_batch_is_run_again_without_its_culprit(backend: HFBackend, bad_id: int) -> None:
    """Defence in depth: B's bad id put into the queue past the door check (as a bug in a check
    would let it), in one batch with A's eight: the batch fails, the engine runs it again in
    halves, and A gets every answer, the same as alone; only B gets the error."""
    expected = _alone(backend)
    engine = _engine(backend, batch_window_s=5.0, max_batch_size=9)  # the batch goes when all nine wait
    bad = _request((1, 9690, bad_id, 253))

    def culprit() -> Future[SampleResult]:
        pending = Pending(Future(), time.monotonic(), request=bad, tenant="B")
        engine._enqueue([pending], requests=1)
        return pending.future

    try:
        out = _with_culprit(engine, culprit)
        assert isinstance(out.pop(4), IndexError)
        assert [_tokens(r) for r in out] == expected
        stats = engine.stats
        assert stats.failed_batches >= 2, "the batch of nine failed, then B's half, then B alone"
        assert sum(stats.batch_sizes) == 8 and max(stats.batch_sizes) <= 8
    finally:
        engine.close(close_backend=False)


def test_a_request_the_backend_refuses_fails_alone(backend: HFBackend) -> None:
    """A chat prompt too long for the model passes the door (its length is known only once the
    backend renders it) and fails its batch there: A's eight are answered, B gets the error."""
    expected = _alone(backend)
    engine = _engine(backend, batch_window_s=5.0, max_batch_size=9)
    words = " ".join(["word"] * (backend.max_model_len + 10))
    long_chat = SampleRequest(messages=({"role": "user", "content": words},), params=GREEDY)
    try:
        out = _with_culprit(engine, lambda: engine.submit(long_chat, tenant="B"))
        got_b = out.pop(4)
        assert isinstance(got_b, ConfigError) and "no room" in str(got_b)
        assert [_tokens(r) for r in out] == expected
        assert engine.stats.failed_batches >= 1 and sum(engine.stats.batch_sizes) == 8
    finally:
        engine.close(close_backend=False)


# ----- a big request takes turns -----


def test_a_huge_request_does_not_delay_another_tenants_small_one(backend: HFBackend) -> None:
    """B asks for 1024 samples: they run as chunks of at most max_batch_size. C's sample runs at
    the next step of B's first chunk, beside it (the batch is full, and C has nothing in it); A's,
    submitted when C's is answered, runs the same way, long before B's last chunk."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32)
    hog_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    seen: dict[str, Any] = {}
    a_done = threading.Event()

    def a_ran(_: Future[SampleResult]) -> None:
        seen["a_steps"] = engine.stats.steps - seen["arrival_steps"]
        a_done.set()

    def a_arrives(_: Future[SampleResult]) -> None:
        # On the engine thread, while B's chunks run: A arrives after the steps counted so far.
        seen["arrival_steps"], seen["hog_done"] = engine.stats.steps, hog.done()
        seen["a"] = engine.submit(_request(PROMPTS[0]), tenant="A")
        seen["a"].add_done_callback(a_ran)

    try:
        hog = engine.submit(_request(PROMPTS[1], hog_params, num_samples=1024), tenant="B")
        engine.submit(_request(PROMPTS[2]), tenant="C").add_done_callback(a_arrives)
        assert a_done.wait(120)
        assert len(hog.result(timeout=300).sequences) == 1024
        assert not seen["hog_done"], "A must arrive while B's chunks are still waiting"
        # A's 4 tokens: the first from its prefill when it joins, three more steps.
        assert seen["a_steps"] <= 4, f"A took {seen['a_steps']} steps of the batch in progress"
        assert _tokens(seen["a"].result()) == _alone(backend)[0]
        assert max(engine.stats.batch_sizes) <= 32 and engine.stats.sequences == 1024 + 2
        assert engine.stats.peak_rows == 32
    finally:
        engine.close(close_backend=False)


def _once_running(future: Future[Any], timeout_s: float = 60.0) -> None:
    """Wait until ``future``'s batch has started on the engine's thread."""
    deadline = time.monotonic() + timeout_s
    while not future.running():
        assert not future.done() and time.monotonic() < deadline, "the batch never started"
        time.sleep(0.001)


LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
LONG_ROWS = 32  # a full batch of max_batch_size 32


def test_a_small_request_runs_beside_another_tenants_full_batch(backend: HFBackend) -> None:
    """B's full batch draws 32 x 400 tokens; A's 4-token sample, submitted once it runs, runs
    beside it and is answered long before it ends. B's own second request does not push into its
    full batch: it waits its turn. Each answers what it answers alone."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32)
    finished: list[str] = []
    try:
        hog = engine.submit(_request(PROMPTS[1], LONG, num_samples=LONG_ROWS), tenant="B")
        _once_running(hog)
        mine = engine.submit(_request(PROMPTS[2]), tenant="B")
        a = engine.submit(_request(PROMPTS[0]), tenant="A")
        for name, future in (("hog", hog), ("B's second", mine), ("A", a)):
            future.add_done_callback(lambda _, name=name: finished.append(name))
        results = [f.result(timeout=300) for f in (hog, mine, a)]
        assert finished == ["A", "hog", "B's second"]
        assert engine.stats.batch_sizes == [32, 1, 1], "A ran beside B's batch; B's second started the next"
        runs = ((1, LONG, LONG_ROWS), (2, GREEDY, 1), (0, GREEDY, 1))
        alone = [backend.sample([_request(PROMPTS[i], p, num_samples=k)])[0] for i, p, k in runs]
        assert [_tokens(r) for r in results] == [_tokens(r) for r in alone]
    finally:
        engine.close(close_backend=False)


def test_requests_that_arrive_while_a_batch_runs_join_it(backend: HFBackend) -> None:
    """B's 8 rows of 400 tokens run with room to spare; A's and C's 8-row requests, submitted a
    moment later, join B's batch at its next steps (one batch of 24 rows decodes their tokens
    together) and are answered long before it ends; B's own next request joins too. Each answers
    what it answers alone."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32)
    six = dataclasses.replace(GREEDY, max_tokens=6)
    try:
        hog = engine.submit(_request(PROMPTS[1], LONG, num_samples=8), tenant="B")
        _once_running(hog)
        tenants = ((0, "A"), (2, "C"), (3, "B"))
        others = [engine.submit(_request(PROMPTS[i], six, num_samples=8), tenant=t) for i, t in tenants]
        results = [f.result(timeout=300) for f in others]
        assert not hog.done(), "they joined B's batch, and did not wait for its end"
        assert engine.stats.peak_rows >= 16 and engine.stats.batch_sizes[0] == 8
        assert [_tokens(r) for r in results] == [
            _tokens(backend.sample([_request(PROMPTS[i], six, num_samples=8)])[0]) for i in (0, 2, 3)
        ]
        long8 = _request(PROMPTS[1], LONG, num_samples=8)
        assert _tokens(hog.result(timeout=300)) == _tokens(backend.sample([long8])[0])
    finally:
        engine.close(close_backend=False)


def test_requests_arriving_one_after_another_each_run_at_the_next_step(backend: HFBackend) -> None:
    """Ten tenants' 1-row samples, each submitted when the one before it is answered, while B's
    full 4-row batch of 400 tokens runs: each runs at its next step, beside it, and takes its 4
    tokens' steps, not B's 400. B answers what it answers alone."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=4)
    long4 = _request(PROMPTS[1], LONG, num_samples=4)
    answered: list[Future[SampleResult]] = []
    steps: list[int] = []

    def submit(k: int) -> None:
        future = engine.submit(_request(PROMPTS[k % len(PROMPTS)]), tenant=f"T{k}")
        answered.append(future)
        start = engine.stats.steps
        future.add_done_callback(lambda _: steps.append(engine.stats.steps - start))
        if k < 9:  # on the engine's thread, as the previous one is answered
            future.add_done_callback(lambda _: submit(k + 1))

    try:
        hog = engine.submit(long4, tenant="B")
        _once_running(hog)
        submit(0)
        assert _tokens(hog.result(timeout=300)) == _tokens(backend.sample([long4])[0])
        assert len(answered) == 10 and all(f.done() for f in answered)
        assert max(steps) <= 5 and sum(steps) <= 50, f"steps each waited: {steps}"
        assert engine.stats.peak_rows == 4, "the small ones ran beside B's batch, not in it"
        assert [_tokens(f.result()) for f in answered[:2]] == _alone(backend)[:2]
    finally:
        engine.close(close_backend=False)


def test_requests_beside_a_batch_keep_its_adapter_resident(backend: HFBackend) -> None:
    """Two adapter slots; B's long batch uses x. A (adapter y) and C (adapter z) arrive while it
    runs: y and z cannot both sit beside x, so they run one after the other beside B's full batch,
    and the slots make room by evicting each other, never x: B answers what it answers alone."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32, max_resident_adapters=2)
    x, y, z = AdapterRef("x", 1), AdapterRef("y", 1), AdapterRef("z", 1)
    for seed, ref in enumerate((x, y, z)):
        engine.load_adapter(random_adapter(backend.model, ref, seed=seed, scale=0.1))
    try:
        alone = engine.submit(_request(PROMPTS[1], LONG, x, num_samples=LONG_ROWS), tenant="B").result(timeout=300)
        hog = engine.submit(_request(PROMPTS[1], LONG, x, num_samples=LONG_ROWS), tenant="B")
        _once_running(hog)
        small = [engine.submit(_request(PROMPTS[i], ref=ref), tenant=t) for i, ref, t in ((0, y, "A"), (2, z, "C"))]
        for f in small:
            f.result(timeout=300)
            assert not hog.done(), "A and C run beside B's batch"
        assert _tokens(hog.result(timeout=300)) == _tokens(alone)
        assert engine.stats.batch_sizes == [32, 32, 1, 1] and engine.stats.failed_batches == 0
        assert engine.slots.evictions >= 1 and x in engine.slots.resident()
    finally:
        engine.close(close_backend=False)


def test_a_failed_step_runs_each_request_again_alone(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step that raises (injected once, in this unit test) costs no request: each of the
    batch's requests runs again alone from its start and answers what it answers alone."""
    from polytinker.engine.inference._decode import DecodeBatch

    engine = _engine(backend, batch_window_s=0.5, max_batch_size=8)
    real_step, calls = DecodeBatch.step, {"n": 0}

    def step_failing_once(self: DecodeBatch) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step(self)

    monkeypatch.setattr(DecodeBatch, "step", step_failing_once)
    try:
        futures = [engine.submit(_request(PROMPTS[i]), tenant=f"T{i}") for i in range(3)]
        assert [_tokens(f.result(timeout=120)) for f in futures] == _alone(backend)[:3]
        assert engine.stats.failed_batches == 1 and calls["n"] > 2
    finally:
        engine.close(close_backend=False)


def test_a_split_request_is_assembled_in_order_with_per_chunk_seeds(backend: HFBackend) -> None:
    """70 seeded samples with max_batch_size 32 run as chunks of 32, 32 and 6: the answer has 70
    sequences, the first 32 are what the same seed draws unsplit, the chunks do not repeat each
    other, and the same request answers the same again."""
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    try:
        first = _tokens(engine.submit(_request(PROMPTS[0], params, num_samples=70)).result(timeout=120))
        again = _tokens(engine.submit(_request(PROMPTS[0], params, num_samples=70)).result(timeout=120))
        assert len(first) == 70 and first == again
        unsplit = _tokens(backend.sample([_request(PROMPTS[0], params, num_samples=32)])[0])
        assert first[:32] == unsplit
        assert first[32:64] != first[:32] and len({tuple(t) for t in first}) > 35
        assert engine.stats.batch_sizes == [32, 32, 6] * 2 and engine.stats.peak_rows == 32
    finally:
        engine.close(close_backend=False)


def test_cancelling_a_split_request_drops_its_chunks_and_releases_its_version(backend: HFBackend) -> None:
    engine = _engine(backend, batch_window_s=0.0, max_batch_size=32)
    old, new = AdapterRef("hog", 1), AdapterRef("hog", 2)
    engine.load_adapter(random_adapter(backend.model, old, seed=1, scale=0.1))
    hog_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        hog = engine.submit(_request(PROMPTS[1], hog_params, old, num_samples=1024), tenant="B")
        # C's request runs right after B's first chunk; cancelling then drops the other 31.
        engine.submit(_request(PROMPTS[2]), tenant="C").add_done_callback(lambda _: hog.cancel())
        engine.load_adapter(random_adapter(backend.model, new, seed=2, scale=0.1))
        assert len(engine.submit(_request(PROMPTS[0]), tenant="A").result(timeout=120).sequences) == 1
        engine.sample([_request(PROMPTS[0], ref=new)], timeout_s=120)  # the queue has drained past B's chunks
        assert hog.cancelled()
        assert engine.stats.sequences < 1024, "the cancelled chunks must not run"
        assert engine.slots.known() == [new], "every chunk released hog@1, so it retired"
    finally:
        engine.close(close_backend=False)


# ----- a caller gets the samples it asked for -----


def test_the_engine_worker_bounds_sizes_and_answers_every_sample(backend: HFBackend, tmp_path: Path) -> None:
    worker = EngineWorker(TINY_RANDOM, EngineWorkerConfig(batch_window_s=0.0, max_batch_size=16), tmp_path, backend)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    try:
        reply = worker.sample(wm.EngineSample("", 0, None, PROMPTS[0], 100, params, tag="A"))
        assert len(reply.sequences) == 100 and all(len(s.tokens) == 1 for s in reply.sequences)
        assert max(worker.engine.stats.batch_sizes) <= 16
        for n in (0, 1025):
            with pytest.raises(ConfigError, match="num_samples"):
                worker.sample(wm.EngineSample("", 0, None, PROMPTS[0], n, params, tag="A"))
        with pytest.raises(ConfigError, match="prompt_token_ids"):
            worker.sample(wm.EngineSample("", 0, None, (), 1, params, tag="A"))
        with pytest.raises(ConfigError, match=r"prompt_token_ids.*no room"):
            worker.sample(wm.EngineSample("", 0, None, (1,) * backend.max_model_len, 1, params, tag="A"))
        with pytest.raises(ConfigError, match=re.escape("sequences[1]: token id 1000000")):
            worker.logprobs(wm.EngineLogprobs("", 0, None, ((1, 2), (1, 10**6))))
    finally:
        worker.full.close()
        worker.engine.close(close_backend=False)


def test_a_sample_request_bounds_its_count() -> None:
    assert _request(PROMPTS[0], num_samples=1024).num_samples == 1024
    for bad in (0, -1, 1025, True, 2.0):
        with pytest.raises(ConfigError, match=re.escape("SampleRequest.num_samples must be in 1..1024")):
            _request(PROMPTS[0], num_samples=bad)  # type: ignore[arg-type]


@pytest.mark.vllm
def test_vllm_goes_through_the_same_checks_chunks_and_retries(vllm_tiny: Any) -> None:
    engine = InferenceEngine(vllm_tiny, EngineConfig(batch_window_s=0.0, max_batch_size=16))
    try:
        with pytest.raises(ConfigError, match="prompt_token_ids"):
            engine.submit(_request((1, 9690, 10**6)), tenant="B")
        with pytest.raises(ConfigError, match="no room"):
            engine.submit(_request(tuple([1] * vllm_tiny.max_model_len)), tenant="B")
        params = SamplingParams(max_tokens=2, temperature=1.0, seed=3)
        result = engine.submit(_request(PROMPTS[0], params, num_samples=40), tenant="A").result(timeout=300)
        assert len(result.sequences) == 40 and engine.stats.batch_sizes == [16, 16, 8]
    finally:
        engine.close(close_backend=False)
    # Past the door, B's id fails vLLM's whole batch; the retry answers A's three as alone.
    alone = [_tokens(vllm_tiny.sample([_request(p)])[0]) for p in PROMPTS[:3]]
    engine = InferenceEngine(vllm_tiny, EngineConfig(batch_window_s=5.0, max_batch_size=4))
    try:
        bad = Pending(Future(), time.monotonic(), request=_request((1, 9690, 10**6)), tenant="B")
        good = [engine.submit(_request(p), tenant="A") for p in PROMPTS[:2]]
        engine._enqueue([bad], requests=1)
        good.append(engine.submit(_request(PROMPTS[2]), tenant="A"))
        assert [_tokens(f.result(timeout=300)) for f in good] == alone
        with pytest.raises(Exception, match="1000000"):
            bad.future.result(timeout=300)
        assert engine.stats.failed_batches >= 2
    finally:
        engine.close(close_backend=False)
