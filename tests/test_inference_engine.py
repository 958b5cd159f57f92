"""InferenceEngine: dynamic batching, adapter slots (LRU, pinning, versions held by requests),
on the real hf backend with the tiny model; and the engine worker the runtime runs, in a child
process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _worker import worker_process

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference import random_adapter, write_adapter_dir
from polytinker.engine.inference.config import EngineConfig, HFBackendConfig
from polytinker.engine.inference.engine import InferenceEngine
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import AdapterRef, SampleRequest, SampleResult, SamplingParams
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError, ModelError, RemoteError
from polytinker.scheduler.service.config import EngineWorkerConfig
from polytinker.scheduler.service.replies import AdapterTensors, SampleReply

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = (1, 9690, 198, 2683, 359, 253)
REMOTE, ON_VLLM = "alice/job/remote", "alice/job/on-vllm"  # adapter keys (tenant/job/agent) as the scheduler names them


@pytest.fixture(scope="module")
def backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)
    b = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    yield b
    b.close()


def _adapter(backend: HFBackend, name: str, version: int = 0, seed: int = 0) -> AdapterWeights:
    return random_adapter(backend.model, AdapterRef(name, version), seed=seed, scale=0.1)


def _request(ref: AdapterRef | None, params: SamplingParams = GREEDY, num_samples: int = 1) -> SampleRequest:
    return SampleRequest(prompt_token_ids=PROMPT, adapter=ref, params=params, num_samples=num_samples)


def _same(a: SampleResult, b: SampleResult) -> bool:
    """Same tokens; logprobs equal up to float noise (batch shapes change summation order)."""
    return [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences] and all(
        x.logprobs == pytest.approx(y.logprobs, abs=1e-4) for x, y in zip(a.sequences, b.sequences, strict=True)
    )


def _make_engine(backend: HFBackend, **config: float) -> InferenceEngine:
    for ref in backend.loaded_adapters():  # engines share the module's backend: start clean
        backend.unload_adapter(ref)
    return InferenceEngine(backend, EngineConfig(**config))  # type: ignore[arg-type]


def test_concurrent_requests_share_one_mixed_batch(backend: HFBackend) -> None:
    engine = _make_engine(backend, batch_window_s=1.0, max_batch_size=8)
    refs = [AdapterRef(n) for n in "abc"]
    for i, ref in enumerate(refs):
        engine.load_adapter(_adapter(backend, ref.name, seed=i))
    requests = [_request(refs[i % 3] if i % 4 else None) for i in range(8)]
    results: list[object] = [None] * 8
    barrier = threading.Barrier(8)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = engine.submit(requests[i]).result(timeout=120)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.stats.batch_sizes == [8] and engine.stats.batch_adapters == [4]
    alone = [engine.sample([r])[0] for r in requests]
    assert all(_same(r, a) for r, a in zip(results, alone, strict=True))  # type: ignore[arg-type]
    engine.close(close_backend=False)


def test_max_batch_size_splits_batches(backend: HFBackend) -> None:
    engine = _make_engine(backend, batch_window_s=0.5, max_batch_size=3)
    params = SamplingParams(max_tokens=2, temperature=0)
    futures = [engine.submit(_request(None, params, num_samples=2)) for _ in range(4)]
    assert all(len(f.result(timeout=120).sequences) == 2 for f in futures)
    assert max(engine.stats.batch_sizes) <= 3 and sum(engine.stats.batch_sizes) == 8
    engine.close(close_backend=False)


def test_lru_eviction_and_pinning(backend: HFBackend) -> None:
    engine = _make_engine(backend, batch_window_s=0.0, max_resident_adapters=2)
    refs = [AdapterRef(n) for n in "abc"]
    for i, ref in enumerate(refs):
        engine.load_adapter(_adapter(backend, ref.name, seed=i))
    first = engine.sample([_request(refs[0])])[0]
    engine.sample([_request(refs[1])])
    engine.sample([_request(refs[2])])  # evicts a, the least recently used
    assert set(backend.loaded_adapters()) == {refs[1], refs[2]} and engine.slots.evictions == 1
    again = engine.sample([_request(refs[0])])[0]  # reloaded from its host copy: same answer
    assert _same(again, first) and set(backend.loaded_adapters()) == {refs[2], refs[0]}
    engine.pin(refs[2])
    engine.sample([_request(refs[1])])  # c is pinned, so a (older of the unpinned) goes
    assert set(backend.loaded_adapters()) == {refs[2], refs[1]}
    with pytest.raises(ConfigError, match="pinned"):
        engine.pin(refs[0])
        engine.pin(refs[1])
    engine.close(close_backend=False)


def test_request_in_flight_keeps_its_version(backend: HFBackend) -> None:
    engine = _make_engine(backend, batch_window_s=0.5)
    old, new = AdapterRef("v", 1), AdapterRef("v", 2)
    backend.load_adapter(_adapter(backend, "v", 1, seed=1))  # what v@1's weights answer, measured directly
    expected_old = backend.sample([_request(old)])[0]
    backend.unload_adapter(old)
    engine.load_adapter(_adapter(backend, "v", 1, seed=1))
    futures = [engine.submit(_request(old)) for _ in range(3)]
    engine.load_adapter(_adapter(backend, "v", 2, seed=2))  # arrives while v@1 requests wait
    served = [f.result(timeout=120) for f in futures]
    assert all(r.adapter == old for r in served)
    assert engine.latest("v") == new and engine.slots.known() == [new], "v@1 retires once unused"
    with pytest.raises(ConfigError, match="v@1"):
        engine.submit(_request(old))
    # What v@1 answered is what v@1's weights give, not v@2's.
    assert _same(served[0], expected_old)
    assert not _same(engine.sample([_request(new)])[0], expected_old)
    engine.close(close_backend=False)


def test_compute_logprobs_and_errors_go_back_to_the_caller(backend: HFBackend) -> None:
    engine = _make_engine(backend, batch_window_s=0.0)
    engine.load_adapter(_adapter(backend, "s"))
    direct = backend.compute_logprobs([list(PROMPT)], None)
    assert engine.compute_logprobs([list(PROMPT)]) == direct
    with pytest.raises(ConfigError):
        engine.submit(_request(AdapterRef("missing")))
    with pytest.raises(ConfigError, match="empty"):  # fails inside the batch; the worker survives
        engine.submit(SampleRequest(prompt_token_ids=(), params=GREEDY)).result(timeout=60)
    assert len(engine.sample([_request(AdapterRef("s"))])[0].sequences[0].token_ids) == GREEDY.max_tokens
    engine.close(close_backend=False)
    with pytest.raises(ModelError, match="closed"):
        engine.submit(_request(None))


def _store(root: Path, weights: AdapterWeights, adapter: str) -> wm.WeightsRef:
    """Write ``weights`` as the export a learner leaves for the engines of ``adapter``; its ids."""
    stored = wm.WeightsRef(adapter, weights.ref.version, "export")
    write_adapter_dir(weights, root / stored.relative_path)
    return stored


def _sample_msg(adapter: str, weights: wm.WeightsRef | None, version: int = 0) -> wm.EngineSample:
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=GREEDY.temperature, ignore_eos=GREEDY.ignore_eos)
    return wm.EngineSample(adapter, version, weights, PROMPT, 1, params)


def _same_reply(reply: SampleReply, result: SampleResult) -> bool:
    """An engine worker's reply holds ``result``'s tokens and (up to float noise) logprobs."""
    got = reply.sequences
    return [s.tokens for s in got] == [list(s.token_ids) for s in result.sequences] and all(
        r.logprobs == pytest.approx(s.logprobs, abs=1e-4) for r, s in zip(got, result.sequences, strict=True)
    )


def test_engine_worker_samples_in_a_child_process(backend: HFBackend, tmp_path: Path) -> None:
    """The engine worker the runtime runs, in its own process and called over its Curve RPC server
    with the scheduler's messages: an adapter version served from the peft directory a learner
    left, concurrent requests batched together, logprobs as in-process, and a version it cannot
    read answered NotResident, then served from tensors sent over the transport."""
    for ref in backend.loaded_adapters():
        backend.unload_adapter(ref)
    weights = _adapter(backend, "remote", seed=4)
    backend.load_adapter(weights)
    expected = backend.sample([_request(weights.ref), _request(None)])
    root = tmp_path / "state"
    stored = _store(root, weights, REMOTE)
    config = EngineWorkerConfig(batch_window_s=1.0)
    with worker_process(config, model=TINY_RANDOM, state_dir=root, run_dir=tmp_path) as engine:
        futures = [
            engine.call_async("sched.w.sample", msg) for msg in (_sample_msg(REMOTE, stored), _sample_msg("", None))
        ]
        got = [f.result(timeout=240) for f in futures]
        assert all(_same_reply(g, e) for g, e in zip(got, expected, strict=True))
        stats = engine.call("sched.w.stats", wm.WorkerStats())
        assert (stats["batches"], stats["max_batch_sequences"], stats["sequences"]) == (1, 2, 2), (
            "two concurrent requests should share one batch"
        )
        assert stats["mixed_adapter_batches"] == 1 and stats["resident"] == [f"{REMOTE}@0"]
        sequence = (*PROMPT, *got[0].sequences[0].tokens)
        remote = engine.call("sched.w.logprobs", wm.EngineLogprobs(REMOTE, 0, stored, (sequence,))).logprobs[0]
        assert remote == pytest.approx(backend.compute_logprobs([list(sequence)], weights.ref)[0], abs=1e-4)
        # A version this engine cannot read (no shared filesystem): NotResident, so the scheduler
        # sends its tensors over the transport (sched.w.put_adapter), and then it serves.
        unread = wm.WeightsRef(REMOTE, 1, "export")
        assert engine.call("sched.w.has_weights", wm.EngineHasWeights(unread)) is False
        with pytest.raises(RemoteError, match="not here; send its tensors") as err:
            engine.call("sched.w.sample", _sample_msg(REMOTE, unread, version=1))
        assert err.value.remote_type == "NotResident"
        newer = _adapter(backend, REMOTE, version=1, seed=5)
        engine.call("sched.w.put_adapter", wm.EnginePutAdapter(unread, AdapterTensors.of(newer)))
        assert engine.call("sched.w.has_weights", wm.EngineHasWeights(unread)) is True
        backend.load_adapter(newer)
        sent = engine.call("sched.w.sample", _sample_msg(REMOTE, unread, version=1))
        assert _same_reply(sent, backend.sample([_request(newer.ref)])[0])
        assert engine.call("sched.w.stats", wm.WorkerStats())["adapters_received"] == 1
        assert _same_reply(engine.call("sched.w.sample", _sample_msg("", None)), expected[1])


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_worker_on_vllm(backend: HFBackend, tmp_path: Path) -> None:
    weights = _adapter(backend, "on-vllm", seed=8)
    root = tmp_path / "state"
    stored = _store(root, weights, ON_VLLM)
    config = EngineWorkerConfig(backend="vllm", adapter_slots=2)
    with worker_process(config, model=TINY_RANDOM, state_dir=root, run_dir=tmp_path, timeout_s=400) as engine:
        futures = [
            engine.call_async("sched.w.sample", msg) for msg in (_sample_msg(ON_VLLM, stored), _sample_msg("", None))
        ]
        results = [f.result(timeout=400) for f in futures]
        assert [len(r.sequences[0].tokens) for r in results] == [GREEDY.max_tokens] * 2
        assert results[0].sequences[0].tokens != results[1].sequences[0].tokens, "the adapter must matter"
        sequence = (*PROMPT, *results[0].sequences[0].tokens)
        logprobs = engine.call("sched.w.logprobs", wm.EngineLogprobs(ON_VLLM, 0, stored, (sequence,))).logprobs
        assert len(logprobs[0]) == len(sequence) - 1
