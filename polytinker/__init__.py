"""polytinker: infrastructure for training many LLM agents together with reinforcement learning.

The public surface is re-exported here; subpackages:

- ``polytinker.transport``: ZeroMQ sockets, msgpack codec with out-of-band tensors, RPC, auth.
- ``polytinker.engine``: process actors and supervision, models, inference engines, learners.
- ``polytinker.scheduler``: the central scheduler, its policy, and the clients (``ServiceClient``).
- ``polytinker.agents``: agents, algorithms, the training loop (not built yet).
- ``polytinker.envs``: text multi-agent environments on PettingZoo, registry, coordinator.
"""

from __future__ import annotations

from polytinker.errors import (
    ActorDeadError,
    ActorError,
    ConfigError,
    EnvError,
    ModelError,
    NotBuiltError,
    PeerDeadError,
    PolytinkerError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    TransportError,
)
from polytinker.scheduler.client import SamplingClient, ServiceClient, TrainingClient

__version__ = "0.1.0"

__all__ = [
    "ActorDeadError",
    "ActorError",
    "ConfigError",
    "EnvError",
    "ModelError",
    "NotBuiltError",
    "PeerDeadError",
    "PolytinkerError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeout",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
    "TransportError",
    "__version__",
]
