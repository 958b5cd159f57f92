"""``TrainingClient``: Tinker's training primitives on one job's adapter (or full weights).

Calls return ``concurrent.futures.Future`` at once and run in the order they were made (one
ordered lane per client), so ``fb = tc.forward_backward(...); st = tc.optim_step(...)`` is safe
without waiting in between. The ``_async`` variants are awaitable. ``optim_step`` resolves only
once the new version is durable in the scheduler's state (a checkpoint on disk, the version in
SQLite).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from polytinker.scheduler.client._connection import Connection, ForwardBackwardOutput, OptimStepResult
from polytinker.scheduler.client.sampling_client import SamplingClient
from polytinker.scheduler.service import messages as m

T = TypeVar("T")


def datum_msg(d: Any) -> m.DatumMsg:
    """DatumMsg from ``polytinker.engine.types.Datum`` (or any object with its fields), or from
    Tinker's shape: ``model_input`` (token ids, or an object with ``to_ints()``) and ``loss_fn_inputs``
    (``target_tokens``, ``weights``, and ``advantages`` / ``logprobs`` for the RL losses), as an
    object or a dict."""
    if isinstance(d, m.DatumMsg):
        return d

    def get(key: str) -> Any:
        return d.get(key) if isinstance(d, dict) else getattr(d, key, None)

    if get("model_input") is not None:
        return _tinker_datum(get("model_input"), get("loss_fn_inputs") or {})

    def opt(v: Any) -> tuple[float, ...] | None:
        return None if v is None else tuple(float(x) for x in v)

    return m.DatumMsg(
        tuple(int(t) for t in get("input_tokens")),
        tuple(int(t) for t in get("target_tokens_T")),
        tuple(float(w) for w in get("weights_T")),
        opt(get("advantages_T")),
        opt(get("sampling_logprobs_T")),
    )


def _tinker_datum(model_input: Any, inputs: Any) -> m.DatumMsg:
    def floats(key: str) -> tuple[float, ...] | None:
        v = inputs.get(key)
        if v is None:
            return None
        v = v.tolist() if hasattr(v, "tolist") else v
        return tuple(float(x) for x in v)

    tokens = model_input.to_ints() if hasattr(model_input, "to_ints") else model_input
    targets = floats("target_tokens")
    if targets is None:
        raise TypeError("a Tinker-style datum needs loss_fn_inputs['target_tokens']")
    weights = floats("weights") or tuple(1.0 for _ in targets)
    return m.DatumMsg(
        tuple(int(t) for t in tokens), tuple(int(t) for t in targets), weights, floats("advantages"), floats("logprobs")
    )


def _adam(params: Any) -> dict[str, float]:
    from polytinker.engine.learner.config import AdamParams

    p = params if params is not None else AdamParams()
    if isinstance(p, dict):
        p = AdamParams(**p)
    keys = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    return {k: float(getattr(p, k)) for k in keys}


class TrainingClient:
    """Trains one job's model; made by ``ServiceClient.create_lora_training_client`` (or
    ``create_training_client`` for full parameters)."""

    def __init__(self, connection: Connection, job: dict[str, Any]) -> None:
        self._conn = connection
        self.job_id: str = job["job_id"]
        self.base_model: str = job["base_model"]
        self.agent: str = job["agent"]
        self.kind: str = job["kind"]
        self._lane = ThreadPoolExecutor(1, thread_name_prefix=f"polytinker-{self.job_id}")

    def __repr__(self) -> str:
        return f"<TrainingClient {self.job_id} ({self.kind}, agent {self.agent})>"

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        return self._lane.submit(fn)

    def _key(self) -> str:
        return self._conn.api_key

    # --- Tinker primitives ---------------------------------------------------------------------------
    def forward_backward(
        self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        """Loss and gradient of ``data`` (``Datum`` objects); the gradient accumulates until ``optim_step``.
        A resend of the call (after a lost connection) carries the same request id: applied once."""
        data_msgs = tuple(datum_msg(d) for d in data)
        msg = m.ForwardBackward(self._key(), self.job_id, data_msgs, loss_fn, loss_fn_config, uuid.uuid4().hex)

        def run() -> ForwardBackwardOutput:
            r = self._conn.request("sched.forward_backward", msg)
            return ForwardBackwardOutput(r["loss"], r["logprobs"], r["metrics"])

        return self._submit(run)

    def forward(self, data: Sequence[Any]) -> Future[list[list[float]]]:
        """Per-datum log-probabilities of the target tokens; no gradient."""
        msg = m.Forward(self._key(), self.job_id, tuple(datum_msg(d) for d in data))
        return self._submit(lambda: self._conn.request("sched.forward", msg)["logprobs"])

    def optim_step(self, adam_params: Any = None) -> Future[OptimStepResult]:
        """Apply the accumulated gradient with AdamW (``AdamParams`` or a dict; defaults if None).
        A resend of the call (after a lost connection) carries the same request id: one step."""
        a = _adam(adam_params)
        msg = m.OptimStep(
            self._key(),
            self.job_id,
            a["learning_rate"],
            a["beta1"],
            a["beta2"],
            a["eps"],
            a["weight_decay"],
            request_id=uuid.uuid4().hex,
            grad_clip_norm=a["grad_clip_norm"],
        )

        def run() -> OptimStepResult:
            r = self._conn.request("sched.optim_step", msg)
            return OptimStepResult(r["version"], r["metrics"])

        return self._submit(run)

    def save_state(self, name: str) -> Future[str]:
        """Checkpoint weights and optimizer state as ``name``; resolves to a path ``load_state`` takes."""
        msg = m.SaveState(self._key(), self.job_id, name)
        return self._submit(lambda: str(self._conn.request("sched.save_state", msg)["path"]))

    def load_state(self, path: str) -> Future[int]:
        """Restore a checkpoint of this tenant (a name or a path ``save_state`` gave); resolves to the version."""
        msg = m.LoadState(self._key(), self.job_id, path)
        return self._submit(lambda: int(self._conn.request("sched.load_state", msg, idempotent=False)["version"]))

    def save_weights_for_sampler(self, name: str = "") -> Future[str]:
        """Make the current version sampleable; resolves to its model path."""
        msg = m.SaveWeights(self._key(), self.job_id, name)
        return self._submit(lambda: str(self._conn.request("sched.save_weights", msg)["model_path"]))

    def save_weights_and_get_sampling_client(self, name: str = "") -> SamplingClient:
        """A SamplingClient on the current version (after every call made before this one)."""
        return SamplingClient(self._conn, self.base_model, self.save_weights_for_sampler(name).result())

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return SamplingClient(self._conn, self.base_model, model_path)

    # --- asyncio -------------------------------------------------------------------------------------
    async def forward_backward_async(
        self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
    ) -> ForwardBackwardOutput:
        return await asyncio.wrap_future(self.forward_backward(data, loss_fn, loss_fn_config))

    async def forward_async(self, data: Sequence[Any]) -> list[list[float]]:
        return await asyncio.wrap_future(self.forward(data))

    async def optim_step_async(self, adam_params: Any = None) -> OptimStepResult:
        return await asyncio.wrap_future(self.optim_step(adam_params))

    async def save_state_async(self, name: str) -> str:
        return await asyncio.wrap_future(self.save_state(name))

    async def load_state_async(self, path: str) -> int:
        return await asyncio.wrap_future(self.load_state(path))

    async def save_weights_and_get_sampling_client_async(self, name: str = "") -> SamplingClient:
        path = await asyncio.wrap_future(self.save_weights_for_sampler(name))
        return SamplingClient(self._conn, self.base_model, path)

    # --- the job -------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The job as the scheduler sees it (state, reason, adapter version, checkpoints, decisions)."""
        return self._conn.request("sched.job_query", m.JobQuery(self._key(), self.job_id))

    def finish(self) -> None:
        """Mark the job done and free its resources (after the calls already made)."""
        action = m.JobAction(self._key(), self.job_id, "finish")
        self._submit(lambda: self._conn.request("sched.job_action", action)).result()
        self._lane.shutdown(wait=True)


__all__ = ["TrainingClient", "datum_msg"]
