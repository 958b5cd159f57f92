"""polytinker.scheduler: the scheduling policy and its simulator.

Built: the pure decision core the central scheduler is to run (priorities, weighted fair share
across tenants, backfill, preemption at step boundaries, admission control, bounded queues, adapter
placement on engines, learner time-slicing choices), a FIFO baseline behind the same interface, and
a discrete-event simulator that replays job traces through that code (``benchmarks/scheduler.py``).

Not built yet: the scheduler service itself (``polytinker serve``, workers, the SQLite job table,
the ``jobs`` command and the Tinker-style clients). See docs/scheduler.md.
"""

from polytinker.scheduler.cluster import ClusterState
from polytinker.scheduler.config import SchedulerPolicyConfig, SimulatorConfig
from polytinker.scheduler.placement import AdapterLoad, AdapterPlacement, next_learner_job
from polytinker.scheduler.policy import FairSharePolicy, FifoPolicy, SchedulingPolicy
from polytinker.scheduler.simulator import JobOutcome, SimResult, SimulationError, Simulator, simulate
from polytinker.scheduler.trace import TraceConfig, default_cluster, generate_trace, load_trace, save_trace
from polytinker.scheduler.types import (
    Accepted,
    ClusterSpec,
    Decision,
    DecisionKind,
    EngineSpec,
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
