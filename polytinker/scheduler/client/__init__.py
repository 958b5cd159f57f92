"""The Tinker-style client API of the central scheduler.

- ``ServiceClient``: connects to a scheduler (or starts a local runtime) and creates clients.
- ``TrainingClient``: ``forward_backward``, ``forward``, ``optim_step``, ``save_state``,
  ``load_state``, ``save_weights_and_get_sampling_client``; calls return futures.
- ``SamplingClient``: ``sample``, ``compute_logprobs``; calls return futures.
- Results: ``ForwardBackwardOutput``, ``OptimStepResult``, ``SampleResponse``, ``SampledSequence``.

See docs/client.md.
"""

from __future__ import annotations

from polytinker.scheduler.client._connection import (
    ForwardBackwardOutput,
    OptimStepResult,
    SampledSequence,
    SampleResponse,
)
from polytinker.scheduler.client.sampling_client import SamplingClient
from polytinker.scheduler.client.service_client import ServiceClient
from polytinker.scheduler.client.training_client import TrainingClient

__all__ = [
    "ForwardBackwardOutput",
    "OptimStepResult",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
