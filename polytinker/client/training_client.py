"""``TrainingClient``: Tinker's training primitives on one job's adapter (or full weights).

Calls return an ``APIFuture`` at once and run in the order they were made (one ordered lane per
client), so ``fb = tc.forward_backward(...); st = tc.optim_step(...)`` is safe without waiting in
between; ``fb.result()`` or ``await fb`` then. As in Tinker, each ``*_async`` twin is a
coroutine that answers the same ``APIFuture`` (``await (await tc.optim_step_async(...))``), so
an ``async`` loop can submit calls back to back before it waits. ``optim_step`` resolves only
once the new version is durable in the scheduler's state (a checkpoint on disk, the version in
SQLite).

A learner that restarts between a step's calls loses the gradient they built; the scheduler
refuses the step then (``GradientLost``) rather than apply part of it. The client keeps the
``forward_backward`` calls of the step in progress and, on that refusal, sends them again (under
new request ids: the learner that took them is gone) and then the step, up to
``STEP_REPLAYS`` times: a run goes on through what supervision survives.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, overload

from polytinker.client._connection import Connection
from polytinker.client._convert import fb_output, to_datum
from polytinker.client._future import APIFuture, ReadyClient, submit
from polytinker.client.sampling_client import SamplingClient
from polytinker.engine.models import load_tokenizer
from polytinker.errors import ConfigError, GradientLost, NotBuiltError
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.types import JobKind
from polytinker.types import (
    AdamParams,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelData,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    tinker_metrics,
)

T = TypeVar("T")
log = logging.getLogger("polytinker.client")
STEP_REPLAYS = 3  # a step's calls sent again after GradientLost, at most this many times in a row
# The save calls answer SaveWeightsResponse / SaveWeightsForSamplerResponse, which are str: typed
# Any, so that code written for the Future[str] these calls answered before still type-checks
# (a Future is invariant in its result type).
_Path = Any


def _adam(params: Any) -> AdamParams:
    """``AdamParams`` from what a caller passes: one (Tinker's is the same class), a dict of its
    fields, an object with them, or None (the defaults)."""
    if params is None:
        return AdamParams()
    if isinstance(params, AdamParams):
        return params
    if isinstance(params, Mapping):
        return AdamParams(**params)
    names = [f.name for f in dataclasses.fields(AdamParams) if hasattr(params, f.name)]
    return AdamParams(**{name: float(getattr(params, name)) for name in names})


def _no_token(token: str | None) -> None:
    if token is not None:
        raise NotBuiltError("weights_access_token is not built: load your own tenant's checkpoints")


class TrainingClient(ReadyClient):
    """Trains one job's model; made by ``ServiceClient.create_lora_training_client`` (or
    ``create_training_client`` for full parameters)."""

    def __init__(self, connection: Connection, job: dict[str, Any], lora: Mapping[str, Any] | None = None) -> None:
        self._conn = connection
        self.job_id: str = job["job_id"]
        self.base_model: str = job["base_model"]
        self.agent: str = job["agent"]
        self.kind: str = job["kind"]
        self.lora: dict[str, Any] | None = dict(lora) if lora and self.kind != JobKind.FULL_RL else None
        self._lane = ThreadPoolExecutor(1, thread_name_prefix=f"polytinker-{self.job_id}")
        self._tokenizer: Any = None
        # The step in progress's answered forward_backward calls (touched only in the lane).
        self._step_calls: list[m.ForwardBackward] = []

    def __repr__(self) -> str:
        return f"<TrainingClient {self.job_id} ({self.kind}, agent {self.agent})>"

    @property
    def model_id(self) -> str:
        """Tinker's name for the training run: the job id."""
        return self.job_id

    def _submit(self, fn: Callable[[], T]) -> APIFuture[T]:
        return submit(self._lane, fn)

    def _key(self) -> str:
        return self._conn.api_key

    # --- Tinker primitives ---------------------------------------------------------------------------
    def forward_backward(
        self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Loss and gradient of ``data`` (``polytinker.types.Datum``, or ``polytinker.engine.types.Datum``);
        the gradient accumulates until ``optim_step``. A resend of the call (after a lost connection)
        carries the same request id: applied once."""
        data_msgs = tuple(to_datum(d) for d in data)
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        msg = m.ForwardBackward(self._key(), self.job_id, data_msgs, loss_fn, config, uuid.uuid4().hex)

        def run() -> ForwardBackwardOutput:
            out = self._conn.ask(msg)
            self._step_calls.append(msg)
            return fb_output(out.loss, out.logprobs, out.metrics)

        return self._submit(run)

    @overload
    def forward(
        self, data: Sequence[Any], loss_fn: None = None, loss_fn_config: None = None
    ) -> APIFuture[list[list[float]]]: ...

    @overload
    def forward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[Any]:
        """The target tokens' log-probabilities, no gradient. With ``loss_fn`` (Tinker's form):
        a ``ForwardBackwardOutput`` with the loss and metrics ``forward_backward`` would answer
        (the learner computes them, KL term included); without: the per-datum lists themselves."""
        data_msgs = tuple(to_datum(d) for d in data)
        if loss_fn is None:
            msg = m.Forward(self._key(), self.job_id, data_msgs)
            return self._submit(lambda: self._conn.ask(msg).logprobs)
        config = dict(loss_fn_config) if loss_fn_config is not None else None
        msg = m.Forward(self._key(), self.job_id, data_msgs, loss_fn, config)  # a bad loss fails here, at the call

        def run() -> ForwardBackwardOutput:
            out = self._conn.ask(msg)
            return fb_output(out.loss, out.logprobs, out.metrics)

        return self._submit(run)

    def optim_step(self, adam_params: Any = None, *, optim_params: Any = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW (``AdamParams`` or a dict; defaults if None;
        ``optim_params=`` is Tinker's newer name). A resend of the call (after a lost connection)
        carries the same request id: one step."""
        if adam_params is not None and optim_params is not None:
            raise ConfigError("pass adam_params or optim_params, not both")
        adam = _adam(adam_params if adam_params is not None else optim_params)
        msg = m.OptimStep(self._key(), self.job_id, adam, request_id=uuid.uuid4().hex)

        def run() -> OptimStepResponse:
            out = self._step(msg)
            return OptimStepResponse(metrics=tinker_metrics(out.metrics), version=int(out.version))

        return self._submit(run)

    def _step(self, msg: m.OptimStep) -> r.OptimStepReply:
        """``msg`` answered; after a ``GradientLost``, the step's calls and the step sent again."""
        for replay in range(STEP_REPLAYS + 1):
            try:
                out = self._conn.ask(msg)
                break
            except GradientLost as exc:
                if replay == STEP_REPLAYS:
                    raise
                calls = self._step_calls
                log.warning("%s: %s; sending the step's %d forward_backward calls again", self.job_id, exc, len(calls))
                self._step_calls = []
                for fb in calls:  # new ids: the learner process that answered the old ones is gone
                    again = dataclasses.replace(fb, request_id=uuid.uuid4().hex)
                    self._conn.ask(again)
                    self._step_calls.append(again)
                msg = dataclasses.replace(msg, request_id=uuid.uuid4().hex)
        self._step_calls = []
        return out

    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[_Path]:
        """Checkpoint weights and optimizer state as ``name``; resolves to its path
        (``polytinker-ckpt://JOB/NAME``, a ``str`` with ``.path``) that ``load_state`` takes.
        ``ttl_seconds``: the runtime deletes the checkpoint that long after (None: it is kept until
        ``ServiceClient.delete_checkpoint``)."""
        msg = m.SaveState(self._key(), self.job_id, name, ttl_s=float(ttl_seconds or 0))
        return self._submit(lambda: SaveWeightsResponse(self._conn.ask(msg).path))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[LoadWeightsResponse]:
        """Restore a checkpoint's weights (a name, or a path ``save_state`` gave, of this tenant);
        the optimizer starts afresh, as in Tinker. ``.version``: the job's version after it."""
        return self._load(path, weights_access_token, optimizer=False)

    def load_state_with_optimizer(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Restore a checkpoint's weights and optimizer state (resuming a run)."""
        return self._load(path, weights_access_token, optimizer=True)

    def _load(self, path: str, token: str | None, *, optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        _no_token(token)
        msg = m.LoadState(self._key(), self.job_id, str(path), optimizer=optimizer)

        def run() -> LoadWeightsResponse:
            version = int(self._conn.ask(msg, idempotent=False).version)
            self._step_calls = []  # loading replaced the adapter's state, its gradient included
            return LoadWeightsResponse(path=str(path), model_id=self.job_id, version=version)

        return self._submit(run)

    def save_weights_for_sampler(self, name: str = "", ttl_seconds: int | None = None) -> APIFuture[_Path]:
        """Make the current version sampleable; resolves to its model path
        (``polytinker://JOB/AGENT@VERSION``, a ``str`` with ``.path``). A ``name`` keeps the version
        (listed as ``sampler-NAME``), for ``ttl_seconds`` if given."""
        msg = m.SaveWeights(self._key(), self.job_id, name or "", ttl_s=float(ttl_seconds or 0) if name else 0.0)
        return self._submit(lambda: SaveWeightsForSamplerResponse(self._conn.ask(msg).model_path))

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A SamplingClient on the current version (after every call made before this one).
        A ``name`` keeps the version sampleable for good (Tinker ignores it)."""
        return SamplingClient(self._conn, self.base_model, self.save_weights_for_sampler(name or "").result().path)

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return SamplingClient(self._conn, self.base_model, str(model_path))

    # --- the model -----------------------------------------------------------------------------------
    def get_info(self) -> GetInfoResponse:
        """The base model and the adapter's shape (from the job; no request)."""
        rank = int(self.lora["rank"]) if self.lora and self.lora.get("rank") else None
        return GetInfoResponse(
            model_data=ModelData(model_name=self.base_model, tokenizer_id=self.base_model),
            model_id=self.job_id,
            is_lora=self.kind != JobKind.FULL_RL,
            lora_rank=rank,
            model_name=self.base_model,
        )

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer (``polytinker.engine.models.load_tokenizer``; loaded once)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.base_model)
        return self._tokenizer

    # --- asyncio: coroutines answering the call's APIFuture (Tinker's rule) --------------------------
    async def forward_backward_async(
        self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_async(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[Any]:
        return self.forward(data) if loss_fn is None else self.forward(data, loss_fn, loss_fn_config)

    async def optim_step_async(
        self, adam_params: Any = None, *, optim_params: Any = None
    ) -> APIFuture[OptimStepResponse]:
        return self.optim_step(adam_params, optim_params=optim_params)

    async def save_state_async(self, name: str, ttl_seconds: int | None = None) -> APIFuture[_Path]:
        return self.save_state(name, ttl_seconds)

    async def load_state_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(path, weights_access_token)

    async def load_state_with_optimizer_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        return self.load_state_with_optimizer(path, weights_access_token)

    async def save_weights_for_sampler_async(self, name: str = "", ttl_seconds: int | None = None) -> APIFuture[_Path]:
        return self.save_weights_for_sampler(name, ttl_seconds)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        """The SamplingClient itself after one ``await``, as in Tinker."""
        saved = await self.save_weights_for_sampler(name or "")
        return SamplingClient(self._conn, self.base_model, saved.path)

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        return self.create_sampling_client(model_path)

    async def get_info_async(self) -> GetInfoResponse:
        return self.get_info()

    # --- the job -------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The job as the scheduler sees it (state, reason, adapter version, checkpoints, decisions)."""
        return self._conn.ask(m.JobQuery(self._key(), self.job_id)).as_dict()

    def finish(self) -> None:
        """Mark the job done and free its resources (after the calls already made)."""
        action = m.JobAction(self._key(), self.job_id, "finish")
        self._submit(lambda: self._conn.ask(action)).result()
        self._lane.shutdown(wait=True)


__all__ = ["TrainingClient", "to_datum"]
