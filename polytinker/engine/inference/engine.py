"""The inference engine: a thread-safe front over one backend, with dynamic batching.

``submit`` may be called from any thread and returns a ``Future``. One worker thread owns the
backend: it takes the oldest waiting work, waits ``batch_window_s`` for others to arrive, and
serves what fits (``max_batch_size`` sequences, adapters within the resident slots) as one mixed
batch. Adapter loads and ``compute_logprobs`` calls also run on that thread, between batches, so
a batch never sees its weights change under it.

Tenants share the engine without hurting each other:

- A request is checked against the model before it is queued (``_requests.check_request``): a
  token id outside the vocabulary or a prompt too long for the model is refused for it alone.
- A request of more samples than ``max_batch_size`` is split into chunks of at most that many
  (``_requests.split_request``, which says what a split request's seed means), and batches take
  turns across the tenants named at ``submit`` (``_queue.FairQueue``): another tenant's small
  request runs in the next batch, not after every chunk.
- A long batch does not hold other tenants up to its end: between two of its decode steps, the
  engine runs batches of other tenants' waiting requests, of fewer tokens in all than it has left
  to draw and at most ``max_batch_size`` sequences in all (``_between_steps``), each to its end,
  inside it; one that arrives while another runs there runs next, not after another step. Each
  may in turn let a third set of tenants in, up to ``MAX_NESTED_BATCHES`` batches at once (each
  keeps its own KV cache meanwhile). The paused batch goes on one step per such gap, so a tenant's
  64-token chunk delays another's 4-token sample by at most about one step, not 64. The ``hf``
  backend decodes in steps; vLLM runs a batch as one call, so there a batch runs to its end.
- When a batch fails, it is run again in halves down to the request that fails it: the others
  are answered, and only that request gets the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytinker.engine.inference._queue import FairQueue, Gap, Pending
from polytinker.engine.inference._requests import (
    check_answer,
    check_request,
    check_sequences,
    join_chunks,
    split_request,
)
from polytinker.engine.inference.base import InferenceBackend
from polytinker.engine.inference.config import EngineConfig
from polytinker.engine.inference.slots import AdapterSlots
from polytinker.engine.types import AdapterName, AdapterRef, AdapterWeights, SampleRequest, SampleResult, ScoredTopK
from polytinker.errors import ModelError

log = logging.getLogger(__name__)

# Batches in progress at once, each paused between its steps while the next runs inside it: the
# memory of this many batches' KV caches is what an engine may hold.
MAX_NESTED_BATCHES = 3


@dataclass(frozen=True)
class _Paused:
    """A batch waiting between its decode steps while another runs: its tenants and versions."""

    tenants: frozenset[str]
    refs: frozenset[AdapterRef | None]


@dataclass
class EngineStats:
    """What the engine did so far: batch sizes in sequences (tests check merging with these)."""

    batch_sizes: list[int] = field(default_factory=list)
    batch_adapters: list[int] = field(default_factory=list)  # distinct adapters (base counts) per batch
    requests: int = 0
    failed_batches: int = 0  # backend calls that raised (a failed batch is retried in halves)


class InferenceEngine:
    """Dynamic batching and adapter slots over an :class:`InferenceBackend`."""

    def __init__(self, backend: InferenceBackend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        self.slots = AdapterSlots(backend, self.config.max_resident_adapters)
        self.stats = EngineStats()
        self._queue = FairQueue()
        self._cv = threading.Condition()
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
            self.slots.prepare([adapter])
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
        self._run_job(lambda: self.slots.prepare([ref]))

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
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

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

    def _run(self, batch: list[Pending], paused: tuple[_Paused, ...] = ()) -> None:
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
        self._serve(live, paused)

    def _between_steps(self, paused: tuple[_Paused, ...]) -> Callable[[int], None] | None:
        """What a batch runs between its decode steps (``paused`` ends with itself), told the
        tokens it has left to draw: batches of the waiting requests of tenants none of ``paused``
        serves, of fewer tokens in all and at most one batch's sequences in all, whose versions
        fit in the slots beside theirs, each to its end. Only smaller work: a small request in
        progress is not held up by a big one."""
        if len(paused) >= MAX_NESTED_BATCHES:
            return None
        tenants = frozenset().union(*(p.tenants for p in paused))
        refs = {r for p in paused for r in p.refs if r is not None}

        def fits(new: set[AdapterRef]) -> bool:
            return self.slots.fits(new | refs)

        def run_other_tenants(tokens_left: int) -> None:
            # Batch after batch while work is admitted, so a request that arrived while one of them
            # ran does not wait for another step of the paused batch. The bounds (one batch's
            # sequences, fewer tokens than the paused batch has left) keep it going step by step.
            gap, rows_left = Gap(tenants, tokens_left), self.config.max_batch_size
            # len() is a racy read: a request that arrives just then waits one step.
            while rows_left > 0 and len(self._queue):
                with self._cv:
                    batch = self._queue.take(rows_left, fits, gap=gap)
                if not batch:
                    return
                rows_left -= sum(p.rows for p in batch)
                self._run(batch, paused)

        return run_other_tenants

    def _serve(self, live: list[Pending], paused: tuple[_Paused, ...] = ()) -> None:
        """Run ``live`` as one batch (inside the ``paused`` ones, whose versions stay resident).
        If it fails, run each half again, down to the request that fails it: every other request
        is answered, and only that one gets the error."""
        requests = [p.request for p in live if p.request is not None]
        me = _Paused(frozenset(p.tenant for p in live), frozenset(r.adapter for r in requests))
        try:
            self.slots.prepare((r.adapter for r in requests), keep=(r for p in paused for r in p.refs))
            outcomes = list(self.backend.sample(requests, self._between_steps((*paused, me))))
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
            self._serve(live[:half], paused)
            self._serve(live[half:], paused)
            return
        except BaseException as exc:  # an interrupt: nothing is retried
            for p in live:
                self._resolve(p, error=exc)
            raise
        self.stats.batch_sizes.append(sum(r.params.n for r in requests))
        self.stats.batch_adapters.append(len({r.adapter for r in requests}))
        for p, outcome in zip(live, outcomes, strict=True):
            self._resolve(p, outcome)

    def _resolve(self, pending: Pending, outcome: Any = None, error: BaseException | None = None) -> None:
        # Release before resolving: a caller that sees its result also sees its version released.
        self._release(pending)
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(outcome)


__all__ = ["EngineStats", "InferenceEngine"]
