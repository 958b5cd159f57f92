"""polytinker: infrastructure for training many LLM agents together with reinforcement learning.

The public surface is re-exported here. Code written for the ``tinker`` SDK runs on it with the
import changed: ``import polytinker as tinker``, ``from polytinker import types`` (the Tinker
vocabulary: ``ModelInput``, ``Datum``, ``SamplingParams``, ... also importable from here), then
``tinker.ServiceClient()`` (docs/client.md). Subpackages:

- ``polytinker.transport``: ZeroMQ sockets, msgpack codec with out-of-band tensors, RPC, auth.
- ``polytinker.actors``: process actors and their supervision.
- ``polytinker.engine``: models, inference engines and learners, and the worker processes of each.
- ``polytinker.scheduler``: the central scheduler service and its policy.
- ``polytinker.client``: the clients (``ServiceClient``, ``TrainingClient``, ``SamplingClient``).
- ``polytinker.gateway``: the HTTP front door (the Tinker API, OpenAI's at /v1), a client of the scheduler.
- ``polytinker.agents``: agents, algorithms, the training loop (``Experiment``).
- ``polytinker.envs``: text multi-agent environments on PettingZoo, registry, coordinator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polytinker.errors import (
    ActorDeadError,
    ActorError,
    ActorStartError,
    AuthError,
    ConfigError,
    EnvBusy,
    EnvError,
    EnvHookError,
    GradientLost,
    JobNotRunning,
    ModelError,
    NotBuiltError,
    NotResident,
    OverloadedError,
    PeerDeadError,
    PolytinkerError,
    ProtocolError,
    RemoteError,
    RequestKeyReused,
    RequestTimeout,
    RuntimeDead,
    SimulationError,
    StateDirInUse,
    TransportError,
    WorkerFailed,
    WorkerUnavailable,
)

__version__ = "0.1.0"

# Heavy parts of the surface load on first use: every actor process imports this package, and
# an actor that only moves messages should not pay for the scheduler client (or torch) at start.
_LAZY = {
    "AdapterSpec": "polytinker.agents",
    "AgentSpec": "polytinker.agents",
    "AlgorithmConfig": "polytinker.agents",
    "CrossPlay": "polytinker.agents",
    "EnvSetup": "polytinker.agents",
    "EvalConfig": "polytinker.agents",
    "Experiment": "polytinker.agents",
    "ExperimentConfig": "polytinker.agents",
    "MappingConfig": "polytinker.agents",
    "OutputConfig": "polytinker.agents",
    "RendererConfig": "polytinker.agents",
    "RunSummary": "polytinker.agents",
    "RuntimeSetup": "polytinker.agents",
    "SamplingConfig": "polytinker.agents",
    "TrainConfig": "polytinker.agents",
    "APIFuture": "polytinker.client",
    "SamplingClient": "polytinker.client",
    "ServiceClient": "polytinker.client",
    "TrainingClient": "polytinker.client",
    # Tinker's commonly used types, as the tinker package exports them
    "AdamParams": "polytinker.types",
    "Datum": "polytinker.types",
    "EncodedTextChunk": "polytinker.types",
    "ForwardBackwardOutput": "polytinker.types",
    "ModelInput": "polytinker.types",
    "OptimStepResponse": "polytinker.types",
    "SampleResponse": "polytinker.types",
    "SampledSequence": "polytinker.types",
    "SamplingParams": "polytinker.types",
    "StopReason": "polytinker.types",
    "TensorData": "polytinker.types",
    "TensorDtype": "polytinker.types",
}

if TYPE_CHECKING:
    from polytinker import types
    from polytinker.agents import (
        AdapterSpec,
        AgentSpec,
        AlgorithmConfig,
        CrossPlay,
        EnvSetup,
        EvalConfig,
        Experiment,
        ExperimentConfig,
        MappingConfig,
        OutputConfig,
        RendererConfig,
        RunSummary,
        RuntimeSetup,
        SamplingConfig,
        TrainConfig,
    )
    from polytinker.client import APIFuture, SamplingClient, ServiceClient, TrainingClient
    from polytinker.types import (
        AdamParams,
        Datum,
        EncodedTextChunk,
        ForwardBackwardOutput,
        ModelInput,
        OptimStepResponse,
        SampledSequence,
        SampleResponse,
        SamplingParams,
        StopReason,
        TensorData,
        TensorDtype,
    )


def __getattr__(name: str) -> Any:
    if name == "types":  # the module polytinker.types, loaded on first use
        module_types = importlib.import_module("polytinker.types")
        globals()["types"] = module_types
        return module_types
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polytinker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "APIFuture",
    "ActorDeadError",
    "ActorError",
    "ActorStartError",
    "AdamParams",
    "AdapterSpec",
    "AgentSpec",
    "AlgorithmConfig",
    "AuthError",
    "ConfigError",
    "CrossPlay",
    "Datum",
    "EncodedTextChunk",
    "EnvBusy",
    "EnvError",
    "EnvHookError",
    "EnvSetup",
    "EvalConfig",
    "Experiment",
    "ExperimentConfig",
    "ForwardBackwardOutput",
    "GradientLost",
    "JobNotRunning",
    "MappingConfig",
    "ModelError",
    "ModelInput",
    "NotBuiltError",
    "NotResident",
    "OptimStepResponse",
    "OutputConfig",
    "OverloadedError",
    "PeerDeadError",
    "PolytinkerError",
    "ProtocolError",
    "RemoteError",
    "RendererConfig",
    "RequestKeyReused",
    "RequestTimeout",
    "RunSummary",
    "RuntimeDead",
    "RuntimeSetup",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingConfig",
    "SamplingParams",
    "ServiceClient",
    "SimulationError",
    "StateDirInUse",
    "StopReason",
    "TensorData",
    "TensorDtype",
    "TrainConfig",
    "TrainingClient",
    "TransportError",
    "WorkerFailed",
    "WorkerUnavailable",
    "__version__",
    "types",
]
