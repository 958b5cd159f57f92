"""The scheduler service: the process every client talks to and every worker registers with.

- ``RuntimeConfig`` (and ``EngineWorkerConfig``, ``LearnerWorkerConfig``, ``TenantConfig``,
  ``JobDefaults``, ``ClusterConfig``): what a runtime runs; ``RuntimeConfig.from_toml``.
- ``LocalRuntime``: scheduler + engines + learner groups as supervised processes on this machine;
  ``RuntimeDead`` when one of them stayed down and it stopped. ``InprocRuntime``: the same as
  objects in this process, no sockets (``ServiceClient(inproc=True)``). With ``[cluster]
  backend = "ray"`` its engines and learner groups are Ray actors instead (``ray_placement``).
- ``SchedulerService``: the request handlers; ``StateStore``: the SQLite (WAL) state;
  ``JobManager``: job lifecycle over the policy; ``Broker``: worker registry and forwarding.
- ``messages`` and ``replies`` (modules): the typed requests and the typed replies on the wire,
  between clients and the scheduler and between the scheduler and its workers.
- ``AuthError``, ``JobNotRunning``, ``OverloadedError`` (from ``polytinker.errors``, re-exported
  here): what a request can be refused with.

See docs/scheduler-service.md.
"""

from __future__ import annotations

from polytinker.errors import AuthError, JobNotRunning, OverloadedError, RuntimeDead, WorkerUnavailable
from polytinker.scheduler.service.broker import Broker
from polytinker.scheduler.service.config import (
    ClusterConfig,
    EngineWorkerConfig,
    JobDefaults,
    LearnerWorkerConfig,
    RuntimeConfig,
    TenantConfig,
)
from polytinker.scheduler.service.inproc import InprocRuntime
from polytinker.scheduler.service.jobs import JobManager
from polytinker.scheduler.service.runtime import LocalRuntime
from polytinker.scheduler.service.scheduler import SchedulerService
from polytinker.scheduler.service.slicer import LearnerSlicer
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.tenants import new_api_key

__all__ = [
    "AuthError",
    "Broker",
    "ClusterConfig",
    "EngineWorkerConfig",
    "InprocRuntime",
    "JobDefaults",
    "JobManager",
    "JobNotRunning",
    "LearnerSlicer",
    "LearnerWorkerConfig",
    "LocalRuntime",
    "OverloadedError",
    "RuntimeConfig",
    "RuntimeDead",
    "SchedulerService",
    "StateStore",
    "TenantConfig",
    "WorkerUnavailable",
    "new_api_key",
]
