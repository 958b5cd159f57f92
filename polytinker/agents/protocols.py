"""The client surface the agents layer drives, as protocols (Tinker's shape).

- ``Pending[T]``: a call's answer to come: ``.result()`` blocks for it, ``await`` waits for it
  (``polytinker.client.APIFuture``).
- ``SamplingClientLike``: samples one saved version (``sample_async``) named by ``model_path``.
- ``TrainingClientLike``: one agent's job: ``forward_backward``, ``optim_step``, the saves and
  loads, a sampling client on the current version, ``finish``.
- ``ServiceClientLike``: makes the agents' training and sampling clients, reports the runtime.
- ``RunHooks``: what the ``Trainer`` calls back into while it runs (``Experiment`` is one).

``polytinker.client.ServiceClient``, ``TrainingClient`` and ``SamplingClient`` satisfy these (mypy
checks it: see the ``TYPE_CHECKING`` block at the end). Only the calls and arguments the agents
layer uses are named here, so a stand-in for tests needs no more than them.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from polytinker.types import (
        ForwardBackwardOutput,
        LoadWeightsResponse,
        OptimStepResponse,
        SampleResponse,
        SaveWeightsForSamplerResponse,
        SaveWeightsResponse,
    )

T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """A call's answer to come (an ``APIFuture``)."""

    def result(self, timeout: float | None = None) -> T_co: ...

    def __await__(self) -> Generator[Any, None, T_co]: ...


class SamplingClientLike(Protocol):
    """Samples one model: a saved version (``model_path``) or the base model."""

    @property
    def model_path(self) -> str: ...

    async def sample_async(self, prompt: Any, num_samples: int = 1, sampling_params: Any = None) -> SampleResponse: ...


class TrainingClientLike(Protocol):
    """One agent's training job."""

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> Pending[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: Any = None) -> Pending[OptimStepResponse]: ...

    def save_state(self, name: str) -> Pending[SaveWeightsResponse]: ...

    def load_state_with_optimizer(self, path: str) -> Pending[LoadWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str = "") -> Pending[SaveWeightsForSamplerResponse]: ...

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClientLike: ...

    def finish(self) -> None: ...


class ServiceClientLike(Protocol):
    """The runtime, as the agents layer sees it."""

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        *,
        agent: str = "default",
        alpha: int | None = None,
        target_modules: tuple[str, ...] = (),
        steps: int = 0,
        max_staleness: int = 0,
    ) -> TrainingClientLike: ...

    def create_training_client(
        self, base_model: str, *, agent: str = "default", steps: int = 0, max_staleness: int = 0
    ) -> TrainingClientLike: ...

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClientLike: ...

    def runtime_status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class RunHooks(Protocol):
    """What the ``Trainer`` reports to while it runs: logging, transcripts, checkpoints, progress."""

    def log_eval(self, step: int, metrics: dict[str, float]) -> None: ...

    def transcripts(self, rows: list[dict[str, Any]]) -> None: ...

    async def after_update(self, step: int) -> None: ...

    async def end_step(self, step: int, metrics: dict[str, float]) -> None: ...


if TYPE_CHECKING:
    from polytinker.client import SamplingClient, ServiceClient, TrainingClient

    def _clients_conform(
        service: ServiceClient, training: TrainingClient, sampling: SamplingClient
    ) -> tuple[ServiceClientLike, TrainingClientLike, SamplingClientLike]:
        return service, training, sampling  # mypy: each client satisfies its protocol


__all__ = [
    "Pending",
    "RunHooks",
    "SamplingClientLike",
    "ServiceClientLike",
    "TrainingClientLike",
]
