"""The client API of the central scheduler, with Tinker's names and semantics.

- ``ServiceClient``: connects to a scheduler (or starts a local runtime) and creates clients.
- ``TrainingClient``: ``forward_backward``, ``forward``, ``optim_step``, ``save_state``,
  ``load_state``, ``load_state_with_optimizer``, ``save_weights_for_sampler``,
  ``save_weights_and_get_sampling_client``, ``get_info``, ``get_tokenizer``.
- ``SamplingClient``: ``sample``, ``compute_logprobs``, ``get_tokenizer``.
- ``APIFuture``: what the calls return at once; ``.result()``, or ``await`` it.
- ``merge_calls``, ``RecordedCall``, ``call_datum``: an agent's recorded ``/v1`` calls as
  training datums, one per episode where the calls continue each other (docs/openai.md).
- ``RuntimeConfig``, ``EngineWorkerConfig``, ``LearnerWorkerConfig``, ``TenantConfig``: the
  runtime a ``ServiceClient(runtime_config=...)`` starts for its script (the scheduler's config).
- ``load_tokenizer``: a base model's tokenizer, what ``get_tokenizer`` answers, before any client.
- Results (``polytinker.types``): ``ForwardBackwardOutput``, ``OptimStepResponse`` (also
  ``OptimStepResult``), ``SampleResponse``, ``SampledSequence``.

See docs/client.md.
"""

from __future__ import annotations

from polytinker.client._connection import (
    ForwardBackwardOutput,
    OptimStepResponse,
    OptimStepResult,
    SampledSequence,
    SampleResponse,
)
from polytinker.client._future import APIFuture
from polytinker.client.recorded import RecordedCall, call_datum, merge_calls
from polytinker.client.sampling_client import SamplingClient
from polytinker.client.service_client import ServiceClient
from polytinker.client.training_client import TrainingClient
from polytinker.engine.models import load_tokenizer
from polytinker.scheduler.service.config import EngineWorkerConfig, LearnerWorkerConfig, RuntimeConfig, TenantConfig

__all__ = [
    "APIFuture",
    "EngineWorkerConfig",
    "ForwardBackwardOutput",
    "LearnerWorkerConfig",
    "OptimStepResponse",
    "OptimStepResult",
    "RecordedCall",
    "RuntimeConfig",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "ServiceClient",
    "TenantConfig",
    "TrainingClient",
    "call_datum",
    "load_tokenizer",
    "merge_calls",
]
