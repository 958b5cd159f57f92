"""``SamplingClient``: sample from, and score with, one saved adapter version (or the base model).

Calls return an ``APIFuture`` at once (``.result()``, or ``await`` it). As in Tinker,
``sample_async`` and ``compute_logprobs_async`` answer the result itself after one ``await``.
Requests of many clients (and tenants) meet in the engines' mixed batches.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from polytinker.client._connection import Connection
from polytinker.client._convert import prompt_tokens, samples_nothing, to_sampling_params
from polytinker.client._future import APIFuture, ReadyClient, submit
from polytinker.engine.models import load_tokenizer
from polytinker.engine.types import check_top_k
from polytinker.errors import AuthError, ConfigError
from polytinker.scheduler.service.messages import ComputeLogprobs, Sample
from polytinker.transport import Request
from polytinker.types import SampledSequence, SampleResponse, StopReason, check_seed

R = TypeVar("R")


class SamplingClient(ReadyClient):
    """Samples one model: ``model_path`` (``polytinker://JOB/AGENT@VERSION``) or, when empty, the
    base model, whose calls name ``job_id``: the inference job ``create_sampling_client`` made,
    which the scheduler's policy gates (its calls wait while it is queued) and accounts."""

    def __init__(
        self,
        connection: Connection,
        base_model: str,
        model_path: str = "",
        job_id: str = "",
        reopen: Callable[[], str] | None = None,
    ) -> None:
        self._conn = connection
        self.base_model = base_model
        self.model_path = model_path
        self.job_id = job_id
        self._reopen = reopen  # makes a new inference job when the scheduler deleted this one
        self._reopen_lock = threading.Lock()
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"<SamplingClient {self.model_path or self.base_model}>"

    def sample(
        self,
        prompt: Any,
        num_samples: int = 1,
        sampling_params: Any = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """``num_samples`` completions of ``prompt`` (a ``ModelInput`` or token ids).
        ``sampling_params``: ``polytinker.types.SamplingParams`` (Tinker's), or
        ``polytinker.engine.types.SamplingParams`` / a dict of its fields; None: polytinker's
        defaults. ``include_prompt_logprobs``: also score the prompt (``prompt_logprobs``);
        ``topk_prompt_logprobs=k``: the k likeliest tokens at each prompt position
        (``topk_prompt_logprobs``, k at most 20), from the same forward pass."""
        check_top_k(topk_prompt_logprobs)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive int, got {num_samples!r}")
        tokens = prompt_tokens(prompt)
        nothing = samples_nothing(sampling_params)
        if nothing:
            check_seed(getattr(sampling_params, "seed", None))
        params = to_sampling_params(None if nothing else sampling_params)  # checks the seed here, at the call
        # A key of its own, kept on resends: an engine still running the call answers a resend with it.
        key = uuid.uuid4().hex
        msg = Sample(
            self._conn.api_key, self.model_path, self.base_model, tokens, num_samples, params, self.job_id, key
        )
        want = (include_prompt_logprobs, bool(topk_prompt_logprobs))
        scored = self._logprobs_msg(tokens, topk_prompt_logprobs) if any(want) else None
        return submit(self._conn.pool, lambda: self._sample(None if nothing else msg, scored, want))

    def _request(self, msg: Request[R]) -> R:
        """The call (a ``Sample`` or a ``ComputeLogprobs``); once more on a new inference job when
        this one is gone from the job table (finished while its client was quiet for hours, then
        pruned: docs/scheduler-service.md)."""
        try:
            return self._conn.ask(msg)
        except AuthError as exc:
            job_id = cast(Sample | ComputeLogprobs, msg).job_id
            if self._reopen is None or not job_id or repr(job_id) not in str(exc):
                raise
            with self._reopen_lock:
                if self.job_id == job_id:  # not yet replaced by a concurrent call
                    self.job_id = self._reopen()
            return self._conn.ask(cast(Request[R], dataclasses.replace(cast(Any, msg), job_id=self.job_id)))

    def _sample(
        self, msg: Sample | None, scored: ComputeLogprobs | None, want: tuple[bool, bool] = (False, False)
    ) -> SampleResponse:
        prompt_logprobs, topk = self._scores(scored) if scored is not None else (None, None)
        prompt_logprobs, topk = (prompt_logprobs if want[0] else None), (topk if want[1] else None)
        if msg is None:
            return SampleResponse([], prompt_logprobs, topk)
        reply = self._request(msg)
        # An engine that failed mid-batch answers "abort": passed on as it is (Tinker names two reasons).
        sequences = [
            SampledSequence(cast(StopReason, s.stop_reason), list(s.tokens), list(s.logprobs), s.text)
            for s in reply.sequences
        ]
        return SampleResponse(sequences, prompt_logprobs, topk)

    async def sample_async(
        self,
        prompt: Any,
        num_samples: int = 1,
        sampling_params: Any = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> SampleResponse:
        """``sample``, awaited: the response itself (Tinker's ``sample_async``)."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs)

    def compute_logprobs(self, prompt: Any) -> APIFuture[list[float | None]]:
        """Log-probability of each token of ``prompt`` given the ones before it (``None`` for the first)."""
        msg = self._logprobs_msg(prompt_tokens(prompt))
        return submit(self._conn.pool, lambda: self._logprobs(msg))

    def _logprobs_msg(self, tokens: tuple[int, ...], top_k: int = 0) -> ComputeLogprobs:
        return ComputeLogprobs(self._conn.api_key, self.model_path, self.base_model, (tokens,), self.job_id, top_k)

    def _logprobs(self, msg: ComputeLogprobs) -> list[float | None]:
        return self._scores(msg)[0]

    def _scores(self, msg: ComputeLogprobs) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
        """The prompt's logprobs and (with ``top_k``) its top-k rows, each with None first."""
        reply = self._request(msg)
        topk = None
        if reply.topk is not None:
            topk = [None, *([(int(t), float(lp)) for t, lp in row] for row in reply.topk[0])]
        return [None, *reply.logprobs[0]], topk

    async def compute_logprobs_async(self, prompt: Any) -> list[float | None]:
        """``compute_logprobs``, awaited: the list itself."""
        return await self.compute_logprobs(prompt)

    # --- the model -----------------------------------------------------------------------------------
    def get_base_model(self) -> str:
        return self.base_model

    async def get_base_model_async(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (``polytinker.engine.models.load_tokenizer``; loaded once)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.base_model)
        return self._tokenizer


__all__ = ["SamplingClient", "prompt_tokens", "to_sampling_params"]
