"""Why a queued job waits, in the words its tenant reads everywhere: the job's reason (``polytinker
jobs``, ``get_job``), the "waiting" answer its calls get, the Tinker gateway's queue state, and the
scheduler's log.

After each scheduling pass, each of the first ``MAX_NOTED`` queued jobs, in the order the policy
would start them (``FairSharePolicy.candidates``: priority, then fair share), gets the reason
``queued for capacity: position N in the queue; waiting for WHAT`` (WHAT from
``ClusterState.wants``: an adapter slot, a learner, engine memory, or resources reserved for a job
ahead of it). The row is written only when its reason changes (each write is a durable SQLite
transaction under the job manager's lock, and a start moves every position: hence few are kept
exact); a job that falls behind them reads ``queued for capacity: behind the first MAX_NOTED in the
queue``. The position counts every tenant's queued jobs but names none of them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping

from polytinker.scheduler.policy import FairSharePolicy
from polytinker.scheduler.types import JobState

log = logging.getLogger("polytinker.scheduler.service")

WAIT_PREFIX = "queued for capacity"
MAX_NOTED = 16  # queued jobs whose place a pass keeps exact


def wait_reasons(policy: FairSharePolicy, now_s: float, limit: int = MAX_NOTED) -> dict[str, str]:
    """Policy job id -> why it waits, for the first ``limit`` queued jobs in the policy's order."""
    out = {}
    for place, e in enumerate(itertools.islice(policy.candidates(), limit), 1):
        wants = policy.cluster.wants(e.job, now_s)
        out[e.job.job_id] = f"{WAIT_PREFIX}: position {place} in the queue; waiting for {wants}"
    return out


class WaitNotes:
    """The reasons written last, so that a pass writes only the ones that changed."""

    def __init__(self) -> None:
        self._noted: dict[str, tuple[str, str]] = {}  # job id -> (policy job id, reason written)

    def note(
        self,
        policy: FairSharePolicy,
        now_s: float,
        job_of: Mapping[str, str],
        set_state: Callable[[str, JobState, str], None],
    ) -> None:
        """Write each queued job's reason (``job_of``: policy job id -> job id) where it changed."""
        noted = {}
        for policy_id, why in wait_reasons(policy, now_s).items():
            job_id = job_of.get(policy_id)
            if job_id is not None:
                noted[job_id] = (policy_id, why)
        for job_id, (policy_id, _) in self._noted.items():  # fell behind the first MAX_NOTED, still queued
            if job_id not in noted and job_of.get(policy_id) == job_id and policy.state(policy_id) is JobState.QUEUED:
                noted[job_id] = (policy_id, f"{WAIT_PREFIX}: behind the first {MAX_NOTED} in the queue")
        for job_id, (_, why) in noted.items():
            if self._noted.get(job_id, ("", ""))[1] != why:
                set_state(job_id, JobState.QUEUED, why)
                log.info("job %s is %s", job_id, why)
        self._noted = {j: n for j, n in noted.items() if not n[1].startswith(f"{WAIT_PREFIX}: behind")}


__all__ = ["MAX_NOTED", "WAIT_PREFIX", "WaitNotes", "wait_reasons"]
