"""polytinker: infrastructure for training many LLM agents together with reinforcement learning.

The public surface is re-exported here; subpackages:

- ``polytinker.transport``: ZeroMQ sockets, msgpack codec with out-of-band tensors, RPC, auth.
- ``polytinker.engine``: process actors and supervision, models, inference engines, learners.
- ``polytinker.scheduler``: the central scheduler, its policy, and the clients (``ServiceClient``).
- ``polytinker.agents``: agents, algorithms, the training loop (``Experiment``).
- ``polytinker.envs``: text multi-agent environments on PettingZoo, registry, coordinator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polytinker.errors import (
    ActorDeadError,
    ActorError,
    AuthError,
    ConfigError,
    EnvError,
    JobNotRunning,
    ModelError,
    NotBuiltError,
    OverloadedError,
    PeerDeadError,
    PolytinkerError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    RuntimeDead,
    TransportError,
    WorkerUnavailable,
)

__version__ = "0.1.0"

# Heavy parts of the surface load on first use: every actor process imports this package, and
# an actor that only moves messages should not pay for the scheduler client (or torch) at start.
_LAZY = {
    "AdapterSpec": "polytinker.agents",
    "AgentSpec": "polytinker.agents",
    "AlgorithmConfig": "polytinker.agents",
    "Experiment": "polytinker.agents",
    "ExperimentConfig": "polytinker.agents",
    "MappingConfig": "polytinker.agents",
    "RunSummary": "polytinker.agents",
    "SamplingConfig": "polytinker.agents",
    "SamplingClient": "polytinker.scheduler.client",
    "ServiceClient": "polytinker.scheduler.client",
    "TrainingClient": "polytinker.scheduler.client",
}

if TYPE_CHECKING:
    from polytinker.agents import (
        AdapterSpec,
        AgentSpec,
        AlgorithmConfig,
        Experiment,
        ExperimentConfig,
        MappingConfig,
        RunSummary,
        SamplingConfig,
    )
    from polytinker.scheduler.client import SamplingClient, ServiceClient, TrainingClient


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polytinker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ActorDeadError",
    "ActorError",
    "AdapterSpec",
    "AgentSpec",
    "AlgorithmConfig",
    "AuthError",
    "ConfigError",
    "EnvError",
    "Experiment",
    "ExperimentConfig",
    "JobNotRunning",
    "MappingConfig",
    "ModelError",
    "NotBuiltError",
    "OverloadedError",
    "PeerDeadError",
    "PolytinkerError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeout",
    "RunSummary",
    "RuntimeDead",
    "SamplingClient",
    "SamplingConfig",
    "ServiceClient",
    "TrainingClient",
    "TransportError",
    "WorkerUnavailable",
    "__version__",
]
