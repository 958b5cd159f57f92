"""The inference engine: a thread-safe front over one backend, with dynamic batching.

``submit`` may be called from any thread and returns a ``Future``. One worker thread owns the
backend: it takes the oldest waiting request, waits ``batch_window_s`` for others to arrive,
and serves everything that fits (``max_batch_size`` sequences, adapters within the resident
slots) as one mixed batch. Adapter loads and ``compute_logprobs`` calls also run on that
thread, between batches, so a batch never sees its weights change under it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytinker.engine.inference.base import InferenceBackend
from polytinker.engine.inference.config import EngineConfig
from polytinker.engine.inference.slots import AdapterSlots
from polytinker.engine.types import AdapterName, AdapterRef, AdapterWeights, SampleRequest, SampleResult, ScoredTopK
from polytinker.errors import ModelError

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A queued request (``request`` set) or a job to run alone on the worker thread."""

    future: Future[Any]
    arrived_s: float
    request: SampleRequest | None = None
    job: Callable[[], Any] | None = None
    refs: tuple[AdapterRef | None, ...] = ()  # versions held until it completes


@dataclass
class EngineStats:
    """What the engine did so far: batch sizes in sequences (tests check merging with these)."""

    batch_sizes: list[int] = field(default_factory=list)
    batch_adapters: list[int] = field(default_factory=list)  # distinct adapters (base counts) per batch
    requests: int = 0


class InferenceEngine:
    """Dynamic batching and adapter slots over an :class:`InferenceBackend`."""

    def __init__(self, backend: InferenceBackend, config: EngineConfig | None = None) -> None:
        self.backend = backend
        self.config = config or EngineConfig()
        self.slots = AdapterSlots(backend, self.config.max_resident_adapters)
        self.stats = EngineStats()
        self._queue: deque[_Pending] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="polytinker-engine", daemon=True)
        self._thread.start()

    # ----- public API (any thread) -----

    def submit(self, request: SampleRequest) -> Future[SampleResult]:
        """Queue one request; the future resolves when its batch has run."""
        self.slots.acquire(request.adapter)  # fails fast on an unknown adapter version
        return self._enqueue(_Pending(Future(), time.monotonic(), request=request, refs=(request.adapter,)))

    def sample(self, requests: Sequence[SampleRequest], timeout_s: float | None = None) -> list[SampleResult]:
        futures = [self.submit(r) for r in requests]
        return [f.result(timeout=timeout_s) for f in futures]

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], adapter: AdapterRef | None = None, timeout_s: float | None = None
    ) -> list[list[float]]:
        """See :meth:`InferenceBackend.compute_logprobs`; runs between batches."""
        return self.compute_logprobs_topk(sequences, 0, adapter, timeout_s)[0]

    def compute_logprobs_topk(
        self,
        sequences: Sequence[Sequence[int]],
        k: int,
        adapter: AdapterRef | None = None,
        timeout_s: float | None = None,
    ) -> ScoredTopK:
        """See :meth:`InferenceBackend.compute_logprobs_topk`; runs between batches."""
        self.slots.acquire(adapter)
        seqs = [list(s) for s in sequences]

        def job() -> ScoredTopK:
            self.slots.prepare([adapter])
            return self.backend.compute_logprobs_topk(seqs, k, adapter)

        future = self._enqueue(_Pending(Future(), time.monotonic(), job=job, refs=(adapter,)))
        result: ScoredTopK = future.result(timeout=timeout_s)
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
        return self._enqueue(_Pending(Future(), time.monotonic(), job=job)).result()

    def _enqueue(self, pending: _Pending) -> Future[Any]:
        with self._cv:
            if self._closed:
                self._release(pending)
                raise ModelError("the inference engine is closed")
            if len(self._queue) >= self.config.max_queue:
                self._release(pending)
                raise ModelError(f"the engine queue is full ({self.config.max_queue} waiting); retry later")
            self._queue.append(pending)
            self.stats.requests += pending.request is not None
            self._cv.notify_all()
        return pending.future

    def _release(self, pending: _Pending) -> None:
        for ref in pending.refs:
            self.slots.release(ref)

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[_Pending] | None:
        """Block for work; a job alone, or the requests that fit one batch after the window."""
        with self._cv:
            while not self._queue:
                if self._closed:
                    return None
                self._cv.wait()
            head = self._queue[0]
            if head.job is not None:
                return [self._queue.popleft()]
            deadline = head.arrived_s + self.config.batch_window_s
            while not self._closed and self._waiting_sequences() < self.config.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._take_batch()

    def _waiting_sequences(self) -> int:
        waiting = itertools.takewhile(lambda p: p.request is not None, self._queue)
        return sum(p.request.params.n for p in waiting if p.request is not None)

    def _take_batch(self) -> list[_Pending]:
        """Requests in arrival order that fit; a job stops the batch (it runs after it)."""
        batch: list[_Pending] = []
        sequences, refs, skipped = 0, set[AdapterRef](), []
        while self._queue and self._queue[0].request is not None:
            pending = self._queue.popleft()
            assert pending.request is not None
            ref, n = pending.request.adapter, pending.request.params.n
            new_refs = refs | ({ref} if ref is not None else set())
            if batch and (sequences + n > self.config.max_batch_size or not self.slots.fits(new_refs)):
                skipped.append(pending)
                if sequences >= self.config.max_batch_size:
                    break
                continue
            batch.append(pending)
            sequences, refs = sequences + n, new_refs
        self._queue.extendleft(reversed(skipped))  # skipped requests keep their place in line
        return batch

    def _run(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        outcomes: list[Any] = []
        error: BaseException | None = None
        try:
            if live and live[0].job is not None:
                outcomes = [live[0].job()]
            elif live:
                requests = [p.request for p in live if p.request is not None]
                self.slots.prepare(r.adapter for r in requests)
                outcomes = list(self.backend.sample(requests))
                self.stats.batch_sizes.append(sum(r.params.n for r in requests))
                self.stats.batch_adapters.append(len({r.adapter for r in requests}))
        except BaseException as exc:  # the callers get the error; the worker keeps serving
            log.warning("engine batch of %d failed: %s", len(live), exc)
            error = exc
        finally:
            # Release before resolving: a caller that sees its result also sees its version released.
            for p in batch:
                self._release(p)
        for i, p in enumerate(live):
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result(outcomes[i])
        if error is not None and not isinstance(error, Exception):
            raise error


__all__ = ["EngineStats", "InferenceEngine"]
