"""What the engine does to one sample request before and after it shares a batch.

- ``check_request``: token ids (prompt, ``stop_token_ids``, ``choices``) outside the model's
  vocabulary and prompts that leave the model no room are refused for that request alone, with
  a ``ConfigError`` naming the field, before the request enters a batch: in a batch such an id
  is an ``IndexError`` (on a GPU, a device-side assert) that fails every request beside it.
- ``split_request``: a request of more samples than one batch holds, as chunks of at most
  ``max_rows`` samples. Chunk ``c`` of a seeded request draws with ``chunk_seed(seed, c)``:
  chunk 0 keeps the request's seed (a request that fits one batch samples as before) and the
  others get seeds derived from (seed, c), so no two chunks repeat each other's draws and the
  whole answer depends only on the request and the engine's ``max_batch_size``.
- ``join_chunks``: the chunks' futures as one future whose result holds their sequences in
  chunk order; a chunk that fails or is cancelled fails that request only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError

import numpy as np

from polytinker.engine.types import AdapterRef, SampleRequest, SampleResult, check_token_ids
from polytinker.errors import ConfigError, ModelError


def check_request(request: SampleRequest, vocab_size: int, max_model_len: int) -> None:
    """ConfigError naming the field when ``request`` cannot run on a model with ids in
    ``[0, vocab_size)`` and ``max_model_len`` positions. A chat (``messages``) prompt is rendered
    by the backend with the model's own tokenizer, so only its length is unknown here; a backend
    refuses one that is too long, and the engine then fails that request alone."""
    params = request.params
    check_token_ids(params.stop_token_ids, "SamplingParams.stop_token_ids", vocab_size)
    for i, choice in enumerate(params.choices):
        check_token_ids(choice, f"SamplingParams.choices[{i}]", vocab_size)
    if request.prompt_token_ids is None:
        return
    prompt = request.prompt_token_ids
    if not prompt:
        raise ConfigError("SampleRequest.prompt_token_ids: the prompt is empty; give at least one token")
    check_token_ids(prompt, "SampleRequest.prompt_token_ids", vocab_size)
    room = max_model_len - len(prompt)
    if room <= 0:
        raise ConfigError(
            f"SampleRequest.prompt_token_ids: a prompt of {len(prompt)} tokens leaves no room in the "
            f"model's {max_model_len} positions"
        )
    longest = max(map(len, params.choices), default=0)
    if longest > room:
        raise ConfigError(
            f"SamplingParams.choices: a choice of {longest} tokens does not fit after a prompt of "
            f"{len(prompt)} tokens (the model has {max_model_len} positions)"
        )


def check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int, max_model_len: int) -> None:
    """ConfigError naming the sequence when one to score holds an id outside the vocabulary or
    is longer than the model (on a GPU such an id is a device-side assert that every later call
    on the device fails with, whoever makes it)."""
    for i, seq in enumerate(sequences):
        check_token_ids(seq, f"sequences[{i}]", vocab_size)
        if len(seq) > max_model_len:
            raise ConfigError(f"sequences[{i}]: {len(seq)} tokens exceed the model's {max_model_len} positions")


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed chunk ``chunk`` of a split request draws with (see the module docstring)."""
    if chunk == 0:
        return seed
    return int(np.random.SeedSequence([seed, chunk]).generate_state(1, np.uint64)[0] >> 1)


def split_request(request: SampleRequest, max_rows: int) -> list[SampleRequest]:
    """``request`` as chunks of at most ``max_rows`` samples, in order (itself if it fits)."""
    n = request.num_samples
    if n <= max_rows:
        return [request]
    chunks = []
    for c, start in enumerate(range(0, n, max_rows)):
        seed = None if request.params.seed is None else chunk_seed(request.params.seed, c)
        params = dataclasses.replace(request.params, seed=seed)
        chunks.append(dataclasses.replace(request, params=params, num_samples=min(max_rows, n - start)))
    return chunks


def check_answer(request: SampleRequest, result: SampleResult) -> None:
    """A backend must answer one sequence per sample: a caller that asks for n gets n."""
    if len(result.sequences) != request.num_samples:
        raise ModelError(f"the backend answered {len(result.sequences)} sequences for {request.num_samples} samples")


def join_chunks(chunks: Sequence[Future[SampleResult]], adapter: AdapterRef | None) -> Future[SampleResult]:
    """One future for a split request: its chunks' sequences in chunk order, or the first error.
    Cancelling it cancels the chunks still queued; a failed chunk cancels the others."""
    joined: Future[SampleResult] = Future()
    # Reentrant: cancelling a chunk runs its callbacks on this thread, inside ours.
    lock = threading.RLock()

    def settle(outcome: SampleResult | BaseException) -> None:
        try:
            if isinstance(outcome, BaseException):
                joined.set_exception(outcome)
            else:
                joined.set_result(outcome)
        except InvalidStateError:  # the caller cancelled it meanwhile
            pass

    def on_chunk(_: Future[SampleResult]) -> None:
        with lock:
            if joined.done():
                return
            failed = next((f for f in chunks if f.done() and (f.cancelled() or f.exception() is not None)), None)
            if failed is not None:
                error = None if failed.cancelled() else failed.exception()
                settle(error or ModelError("a part of this request was cancelled"))
                for f in chunks:
                    f.cancel()
            elif all(f.done() for f in chunks):
                parts = [f.result() for f in chunks]
                sequences = tuple(s for part in parts for s in part.sequences)
                settle(SampleResult(parts[0].prompt_token_ids, sequences, adapter))

    def on_joined(f: Future[SampleResult]) -> None:
        if f.cancelled():
            for chunk in chunks:
                chunk.cancel()

    joined.add_done_callback(on_joined)
    for chunk in chunks:
        chunk.add_done_callback(on_chunk)
    return joined


__all__ = ["check_answer", "check_request", "check_sequences", "chunk_seed", "join_chunks", "split_request"]
