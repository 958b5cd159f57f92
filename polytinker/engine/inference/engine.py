"""The inference engine: a thread-safe front over one backend, with continuous batching.

``submit`` may be called from any thread and returns a ``Future``. One worker thread owns the
backend. With nothing running it takes the oldest waiting work, waits ``batch_window_s`` for
others to arrive, and starts what fits (``max_batch_size`` sequences, adapters within the resident
slots) as one mixed batch. A backend that decodes in steps (``hf`` and ``vllm``:
``SteppingBackend``) is then driven one step at a time, and between two steps the requests waiting
that fit beside the batch join it (prefilled, then decoded with the others), while requests that
end leave it and are answered at once: requests that arrive a moment apart share the model's
matmuls, and a short one is not held up by a long one.
Adapter loads and jobs (``compute_logprobs``, ``pin``) run on the same thread, between batches or
between steps, so no step sees its weights change under it.

Tenants share the engine without hurting each other:

- A request is checked against the model before it is queued (``_requests.check_request``): a
  token id outside the vocabulary or a prompt too long for the model is refused for it alone.
- A request of more samples than ``max_batch_size`` is split into chunks of at most that many
  (``_requests.split_request``, which says what a split request's seed means), and work is taken
  in turns across the tenants named at ``submit`` (``_queue.FairQueue``): another tenant's small
  request joins at the next step, not after every chunk.
- When the batch is full, the small requests (at most ``max_batch_size // 4`` sequences in all, of
  fewer tokens than it has left to draw) of tenants that have nothing in it run at its next step
  as a batch of their own, to their end, while it waits (``_beside``): one tenant's big chunks
  neither lock the others out for their length nor slow each of their steps. The request first in
  line that does not fit yet is not passed over for good: others wait behind it while the batch
  drains.
- When a batch fails, it is run again in halves down to the request that fails it: the others
  are answered, and only that request gets the error. A request that joins a batch in progress
  is prefilled with the others that join at the same step; if that fails, they join one by one.
  If a step fails, each request of the batch runs again alone from its start (a seeded request
  draws the same tokens wherever it runs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference._queue import FairQueue, Joining, Pending
from polytinker.engine.inference._requests import (
    check_answer,
    check_request,
    check_sequences,
    join_chunks,
    split_request,
)
from polytinker.engine.inference.base import InferenceBackend, StepBatch, SteppingBackend
from polytinker.engine.inference.config import EngineConfig
from polytinker.engine.inference.slots import AdapterSlots
from polytinker.engine.types import AdapterName, AdapterRef, SampleRequest, SampleResult, ScoredTopK
from polytinker.errors import ModelError

log = logging.getLogger(__name__)

# When the batch in progress is full, the small requests of tenants that have nothing in it (up to
# max_batch_size // this many sequences) run beside it, between two of its steps.
NEWCOMER_SHARE = 4


@dataclass
class EngineStats:
    """What the engine did so far (tests check merging with these)."""

    # Sequences and distinct adapters (the base counts) of each batch started, and of each group of
    # requests that joined a batch in progress at one step.
    batch_sizes: list[int] = field(default_factory=list)
    batch_adapters: list[int] = field(default_factory=list)
    requests: int = 0
    sequences: int = 0  # sequences answered, every tenant's (each chunk as it ends)
    steps: int = 0  # decode steps of batches driven step by step
    peak_rows: int = 0  # most sequences decoded together
    failed_batches: int = 0  # backend calls that raised (the work is retried in smaller parts)


class InferenceEngine:
    """Dynamic batching and adapter slots over an :class:`InferenceBackend`."""

    def __init__(self, backend: InferenceBackend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        self.slots = AdapterSlots(backend, self.config.max_resident_adapters)
        self.stats = EngineStats()
        self._queue = FairQueue()
        self._cv = threading.Condition()
        # The batch in progress on a stepping backend and its requests by key (worker thread only).
        self._batch: StepBatch | None = None
        self._in_batch: dict[Hashable, Pending] = {}
        self._paused: list[dict[Hashable, Pending]] = []  # a batch waiting while one runs beside it
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="polytinker-engine", daemon=True)
        self._thread.start()

    # ----- public API (any thread) -----

    def submit(self, request: SampleRequest, *, tenant: str = "") -> Future[SampleResult]:
        """Queue one request; the future resolves when its batch (all its chunks) has run.

        ``tenant`` names whose work it is: batches take turns across tenants. A request the model
        cannot run (see ``_requests.check_request``) raises ``ConfigError`` here."""
        check_request(request, self.backend.vocab_size, self.backend.max_model_len)
        chunks = split_request(request, self.config.max_batch_size)
        self.slots.acquire(request.adapter)  # fails fast on an unknown adapter version
        for _ in chunks[1:]:
            self.slots.acquire(request.adapter)  # each chunk holds the version until it completes
        now = time.monotonic()
        items = [Pending(Future(), now, request=c, refs=(request.adapter,), tenant=tenant) for c in chunks]
        self._enqueue(items, requests=1)
        if len(items) == 1:
            return items[0].future
        return join_chunks([p.future for p in items], request.adapter)

    def sample(self, requests: Sequence[SampleRequest], timeout_s: float | None = None) -> list[SampleResult]:
        futures = [self.submit(r) for r in requests]
        return [f.result(timeout=timeout_s) for f in futures]

    def compute_logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        adapter: AdapterRef | None = None,
        timeout_s: float | None = None,
        *,
        tenant: str = "",
    ) -> list[list[float]]:
        """See :meth:`InferenceBackend.compute_logprobs`; runs between batches."""
        return self.compute_logprobs_topk(sequences, 0, adapter, timeout_s, tenant=tenant)[0]

    def compute_logprobs_topk(
        self,
        sequences: Sequence[Sequence[int]],
        k: int,
        adapter: AdapterRef | None = None,
        timeout_s: float | None = None,
        *,
        tenant: str = "",
    ) -> ScoredTopK:
        """See :meth:`InferenceBackend.compute_logprobs_topk`; runs between batches."""
        seqs = [list(s) for s in sequences]
        check_sequences(seqs, self.backend.vocab_size, self.backend.max_model_len)
        self.slots.acquire(adapter)

        def job() -> ScoredTopK:
            self._prepare([adapter])
            return self.backend.compute_logprobs_topk(seqs, k, adapter)

        pending = Pending(Future(), time.monotonic(), job=job, refs=(adapter,), tenant=tenant)
        self._enqueue([pending])
        result: ScoredTopK = pending.future.result(timeout=timeout_s)
        return result

    def load_adapter(self, weights: AdapterWeights, *, pin: bool = False) -> None:
        """Register a version from tensors; it becomes resident when a batch first needs it."""
        self.slots.register(weights.ref, weights)
        if pin:
            self.pin(weights.ref)

    def load_adapter_dir(self, ref: AdapterRef, path: Path, *, pin: bool = False) -> None:
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise ModelError(f"{path} is not a peft adapter directory (no adapter_config.json)")
        self.slots.register(ref, path)
        if pin:
            self.pin(ref)

    def unload_adapter(self, ref: AdapterRef) -> None:
        self.slots.forget(ref)

    def pin(self, ref: AdapterRef) -> None:
        """Keep ``ref`` resident from now on (it is loaded before the next batch)."""
        self.slots.pin(ref)
        self._run_job(lambda: self._prepare([ref]))

    def unpin(self, ref: AdapterRef) -> None:
        self.slots.unpin(ref)

    def latest(self, name: AdapterName) -> AdapterRef | None:
        return self.slots.latest(name)

    def close(self, timeout_s: float = 30.0, *, close_backend: bool = True) -> None:
        """Finish queued work, stop the worker and (unless told not to) close the backend; idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if close_backend:
            self.backend.close()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals -----

    def _run_job(self, job: Callable[[], Any]) -> Any:
        pending = Pending(Future(), time.monotonic(), job=job)
        self._enqueue([pending])
        return pending.future.result()

    def _enqueue(self, items: list[Pending], requests: int = 0) -> None:
        """Queue ``items`` (a request's chunks) all or none."""
        with self._cv:
            if self._closed:
                self._release_all(items)
                raise ModelError("the inference engine is closed")
            if len(self._queue) + len(items) > self.config.max_queue:
                self._release_all(items)
                raise ModelError(
                    f"the engine queue is full ({len(self._queue)} waiting, {len(items)} more asked); retry later"
                )
            self._queue.push(items)
            self.stats.requests += requests
            self._cv.notify_all()

    def _release_all(self, items: list[Pending]) -> None:
        for pending in items:
            self._release(pending)

    def _release(self, pending: Pending) -> None:
        for ref in pending.refs:
            self.slots.release(ref)

    def _loop(self) -> None:
        while True:
            if self._in_batch:  # a batch in progress: let waiting work in, then one step
                self._admit()
                self._step()
                continue
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _held(self) -> set[AdapterRef | None]:
        """The versions of the batches in progress: they stay resident until they end."""
        batches = [self._in_batch, *self._paused]
        return {p.request.adapter for b in batches for p in b.values() if p.request is not None}

    def _prepare(self, refs: Iterable[AdapterRef | None]) -> None:
        self.slots.prepare(refs, keep=self._held())

    def _next_batch(self) -> list[Pending] | None:
        """Block for work; then, after the window, a job alone or the requests of one batch."""
        with self._cv:
            while len(self._queue) == 0:
                if self._closed:
                    return None
                self._cv.wait()
            deadline = self._queue.oldest_s() + self.config.batch_window_s
            while not self._closed and self._queue.waiting_rows() < self.config.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._queue.take(self.config.max_batch_size, self.slots.fits)

    def _run(self, batch: list[Pending]) -> None:
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        running = {id(p) for p in live}
        self._release_all([p for p in batch if id(p) not in running])  # cancelled while queued
        if not live:
            return
        if live[0].job is not None:
            try:
                outcome = live[0].job()
            except Exception as exc:  # the caller gets the error; the worker keeps serving
                self._resolve(live[0], error=exc)
            except BaseException as exc:
                self._resolve(live[0], error=exc)
                raise
            else:
                self._resolve(live[0], outcome)
            return
        if isinstance(self.backend, SteppingBackend):
            self._join(live)
        else:
            self._serve(live)

    def _admit(self) -> None:
        """Between two steps: a job, the waiting requests that fit beside the batch in progress,
        or, when it is full, other tenants' small requests in a batch of their own (``_beside``)."""
        if not len(self._queue):  # a racy read: a request that arrives just then joins a step later
            return
        assert isinstance(self.backend, SteppingBackend) and self._batch is not None
        size = self.config.max_batch_size
        held = {r for r in self._held() if r is not None}

        def fits(new: set[AdapterRef]) -> bool:
            return self.slots.fits(new | held)

        room = size - self._batch.rows if self.backend.joins else 0  # 0: jobs only
        with self._cv:
            work = self._queue.take(room, fits, joining=Joining())
            beside = not work
            if beside:
                newcomers = Joining(
                    strict=False,
                    exclude=frozenset(p.tenant for p in self._in_batch.values()),
                    tokens_below=self._batch.tokens_left,
                )
                work = self._queue.take(max(1, size // NEWCOMER_SHARE), fits, joining=newcomers)
        if work and beside and work[0].job is None:
            self._beside(work)
        elif work:
            self._run(work)

    def _beside(self, work: list[Pending]) -> None:
        """Run ``work`` as a batch of its own to its end while the batch in progress waits (its
        versions stay resident): a small request of another tenant is not held up by a full
        batch's long rows, nor slowed by them step after step. It has fewer tokens to draw than the
        waiting batch has left, so that batch is delayed by at most that much again."""
        paused = (self._batch, self._in_batch)
        self._paused.append(self._in_batch)
        self._batch, self._in_batch = None, {}
        try:
            self._run(work)
            while self._in_batch:
                self._step()
        finally:
            self._paused.pop()
            self._batch, self._in_batch = paused

    def _join(self, live: list[Pending]) -> None:
        """Prefill ``live`` into the batch in progress (a new one when there is none). If that
        fails, they join one by one: only the request that fails gets the error."""
        assert isinstance(self.backend, SteppingBackend)
        requests = [p.request for p in live if p.request is not None]
        if self._batch is None:
            self._batch = self.backend.open_batch()
        try:
            self._prepare(r.adapter for r in requests)
            ended = self._batch.add([(id(p), p.request) for p in live if p.request is not None])
        except Exception as exc:
            self.stats.failed_batches += 1
            if len(live) == 1:
                self._resolve(live[0], error=exc)
            else:
                log.warning("%d requests failed to join a batch (%s); joining them one by one", len(live), exc)
                for p in live:
                    self._join([p])
            return
        except BaseException as exc:  # an interrupt: nothing is retried
            self._fail_all([*live, *self._in_batch.values()], exc)
            raise
        self._in_batch.update((id(p), p) for p in live)
        self._count(requests, self._batch.rows)
        self._answer(ended)

    def _step(self) -> None:
        """One decode step of the batch in progress. If it fails, each of its requests runs again
        alone from its start (``_serve``): only the one that fails gets the error."""
        assert self._batch is not None
        try:
            ended = self._batch.step()
        except Exception as exc:
            self.stats.failed_batches += 1
            stranded = list(self._in_batch.values())
            self._batch, self._in_batch = None, {}
            log.warning("a decode step of %d requests failed (%s); running each again alone", len(stranded), exc)
            for p in stranded:
                self._serve([p])
            return
        except BaseException as exc:
            self._fail_all(list(self._in_batch.values()), exc)
            raise
        self.stats.steps += 1
        self._answer(ended)

    def _answer(self, ended: list[tuple[Hashable, SampleResult]]) -> None:
        for key, outcome in ended:
            p = self._in_batch.pop(key)
            assert p.request is not None
            try:
                check_answer(p.request, outcome)
            except Exception as exc:
                self._resolve(p, error=exc)
                continue
            self.stats.sequences += len(outcome.sequences)
            self._resolve(p, outcome)
        if not self._in_batch:
            self._batch = None

    def _fail_all(self, pending: list[Pending], exc: BaseException) -> None:
        for p in pending:
            if not p.future.done():
                self._resolve(p, error=exc)
        self._batch, self._in_batch = None, {}

    def _count(self, requests: list[SampleRequest], rows: int) -> None:
        self.stats.batch_sizes.append(sum(r.num_samples for r in requests))
        self.stats.batch_adapters.append(len({r.adapter for r in requests}))
        self.stats.peak_rows = max(self.stats.peak_rows, rows)

    def _serve(self, live: list[Pending]) -> None:
        """Run ``live`` as one batch to its end. If it fails, run each half again, down to the
        request that fails it: every other request is answered, and only that one gets the error."""
        requests = [p.request for p in live if p.request is not None]
        try:
            self._prepare(r.adapter for r in requests)
            outcomes = list(self.backend.sample(requests))
            if len(outcomes) != len(requests):
                raise ModelError(f"the backend answered {len(outcomes)} results for {len(requests)} requests")
            for request, outcome in zip(requests, outcomes, strict=True):
                check_answer(request, outcome)
        except Exception as exc:
            self.stats.failed_batches += 1
            if len(live) == 1:
                self._resolve(live[0], error=exc)
                return
            log.warning("engine batch of %d requests failed (%s); running it again in halves", len(live), exc)
            half = len(live) // 2
            self._serve(live[:half])
            self._serve(live[half:])
            return
        except BaseException as exc:  # an interrupt: nothing is retried
            self._fail_all(live, exc)
            raise
        self._count(requests, sum(r.num_samples for r in requests))
        for p, outcome in zip(live, outcomes, strict=True):
            self.stats.sequences += len(outcome.sequences)
            self._resolve(p, outcome)

    def _resolve(self, pending: Pending, outcome: Any = None, error: BaseException | None = None) -> None:
        # Release before resolving: a caller that sees its result also sees its version released.
        self._release(pending)
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(outcome)


__all__ = ["EngineStats", "InferenceEngine"]
