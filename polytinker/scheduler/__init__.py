"""polytinker.scheduler: the scheduling policy and its simulator.

Here: the pure decision core the central scheduler runs (priorities, weighted fair share across
tenants, backfill, preemption at step boundaries, admission control, bounded queues, adapter
placement on engines, learner time-slicing choices), a FIFO baseline behind the same interface,
and a discrete-event simulator that replays job traces through that code (``benchmarks/scheduler.py``).
See docs/scheduler.md.

The service that calls this policy (``polytinker serve``, workers, the SQLite job table, the
``jobs`` command, Tinker-style clients) is a separate part, in ``polytinker.scheduler.service`` and
``polytinker.client`` (docs/scheduler-service.md); nothing here imports it.
"""

from polytinker.errors import SimulationError
from polytinker.scheduler.cluster import ClusterState
from polytinker.scheduler.config import SchedulerPolicyConfig, SimulatorConfig
from polytinker.scheduler.fifo import FifoPolicy
from polytinker.scheduler.placement import AdapterLoad, AdapterPlacement, next_learner_job
from polytinker.scheduler.policy import FairSharePolicy
from polytinker.scheduler.policy_base import SchedulingPolicy
from polytinker.scheduler.sim_result import JobOutcome, SimResult
from polytinker.scheduler.simulator import Simulator, simulate
from polytinker.scheduler.trace import TraceConfig, default_cluster, generate_trace, load_trace, save_trace
from polytinker.scheduler.types import (
    Accepted,
    ClusterSpec,
    Decision,
    DecisionKind,
    EngineSpec,
    HybridSpec,
    Job,
    JobID,
    JobKind,
    JobState,
    LearnerSpec,
    Overloaded,
    Placement,
    Rejected,
    SubmitResult,
    TenantID,
)

__all__ = [
    "Accepted",
    "AdapterLoad",
    "AdapterPlacement",
    "ClusterSpec",
    "ClusterState",
    "Decision",
    "DecisionKind",
    "EngineSpec",
    "FairSharePolicy",
    "FifoPolicy",
    "HybridSpec",
    "Job",
    "JobID",
    "JobKind",
    "JobOutcome",
    "JobState",
    "LearnerSpec",
    "Overloaded",
    "Placement",
    "Rejected",
    "SchedulerPolicyConfig",
    "SchedulingPolicy",
    "SimResult",
    "SimulationError",
    "Simulator",
    "SimulatorConfig",
    "SubmitResult",
    "TenantID",
    "TraceConfig",
    "default_cluster",
    "generate_trace",
    "load_trace",
    "next_learner_job",
    "save_trace",
    "simulate",
]

# The service and client API, re-exported lazily: importing the decision core stays free of them.
_SERVICE_NAMES = {
    "ServiceClient": "polytinker.client",
    "TrainingClient": "polytinker.client",
    "SamplingClient": "polytinker.client",
    "LocalRuntime": "polytinker.scheduler.service",
    "RuntimeConfig": "polytinker.scheduler.service",
}


def __getattr__(name: str) -> object:
    if name in _SERVICE_NAMES:
        import importlib

        return getattr(importlib.import_module(_SERVICE_NAMES[name]), name)
    raise AttributeError(f"module 'polytinker.scheduler' has no attribute {name!r}")


__all__ += list(_SERVICE_NAMES)
