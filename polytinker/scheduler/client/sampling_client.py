"""``SamplingClient``: sample from, and score with, one saved adapter version (or the base model).

Calls return ``concurrent.futures.Future``; the ``_async`` variants are awaitable. Requests of
many clients (and tenants) meet in the engines' mixed batches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from polytinker.errors import AuthError
from polytinker.scheduler.client._connection import Connection, SampledSequence, SampleResponse
from polytinker.scheduler.service.messages import ComputeLogprobs, Sample, SamplingMsg


def prompt_tokens(prompt: Any) -> tuple[int, ...]:
    """Token ids of a prompt: a sequence of ints, or an object with ``to_ints()`` (Tinker's ModelInput)."""
    if hasattr(prompt, "to_ints"):
        prompt = prompt.to_ints()
    if isinstance(prompt, str) or not all(isinstance(t, int) for t in prompt):
        raise TypeError("a prompt is a list of token ids (tokenize text with the model's tokenizer first)")
    return tuple(int(t) for t in prompt)


def sampling_msg(params: Any) -> SamplingMsg:
    """SamplingMsg from ``polytinker.SamplingParams`` (or any object with its fields), a dict, or None."""
    if params is None:
        return SamplingMsg()
    if isinstance(params, SamplingMsg):
        return params
    get = params.get if isinstance(params, dict) else lambda k, d: getattr(params, k, d)
    d = SamplingMsg()
    return SamplingMsg(
        max_tokens=int(get("max_tokens", d.max_tokens)),
        temperature=float(get("temperature", d.temperature)),
        top_p=float(get("top_p", d.top_p)),
        top_k=int(get("top_k", d.top_k)),
        stop=tuple(get("stop", ()) or ()),
        stop_token_ids=tuple(get("stop_token_ids", ()) or ()),
        seed=get("seed", None),
        ignore_eos=bool(get("ignore_eos", False)),
    )


class SamplingClient:
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

    def __repr__(self) -> str:
        return f"<SamplingClient {self.model_path or self.base_model}>"

    def sample(self, prompt: Any, num_samples: int = 1, sampling_params: Any = None) -> Future[SampleResponse]:
        """``num_samples`` completions of ``prompt`` (token ids)."""
        msg = Sample(
            self._conn.api_key,
            self.model_path,
            self.base_model,
            prompt_tokens(prompt),
            num_samples,
            sampling_msg(sampling_params),
            self.job_id,
        )
        return self._conn.pool.submit(self._sample, msg)

    def _request(self, kind: str, msg: Sample | ComputeLogprobs) -> dict[str, Any]:
        """The call; once more on a new inference job when this one is gone from the job table
        (finished while its client was quiet for hours, then pruned: docs/scheduler-service.md)."""
        try:
            return self._conn.request(kind, msg)
        except AuthError as exc:
            if self._reopen is None or not msg.job_id or repr(msg.job_id) not in str(exc):
                raise
            with self._reopen_lock:
                if self.job_id == msg.job_id:  # not yet replaced by a concurrent call
                    self.job_id = self._reopen()
            return self._conn.request(kind, dataclasses.replace(msg, job_id=self.job_id))

    def _sample(self, msg: Sample) -> SampleResponse:
        reply = self._request("sched.sample", msg)
        return SampleResponse([SampledSequence(**s) for s in reply["sequences"]])

    async def sample_async(self, prompt: Any, num_samples: int = 1, sampling_params: Any = None) -> SampleResponse:
        return await asyncio.wrap_future(self.sample(prompt, num_samples, sampling_params))

    def compute_logprobs(self, prompt: Any) -> Future[list[float | None]]:
        """Log-probability of each token of ``prompt`` given the ones before it (``None`` for the first)."""
        msg = ComputeLogprobs(
            self._conn.api_key, self.model_path, self.base_model, (prompt_tokens(prompt),), self.job_id
        )
        return self._conn.pool.submit(self._logprobs, msg)

    def _logprobs(self, msg: ComputeLogprobs) -> list[float | None]:
        reply = self._request("sched.compute_logprobs", msg)
        return [None, *reply["logprobs"][0]]

    async def compute_logprobs_async(self, prompt: Any) -> list[float | None]:
        return await asyncio.wrap_future(self.compute_logprobs(prompt))


__all__ = ["SamplingClient", "prompt_tokens", "sampling_msg"]
