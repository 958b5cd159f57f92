"""The idle rules of the job manager, as plain functions of a job's facts.

- ``idle_verdict``: whether a job with no call for a while is paused or finished now;
  ``idle_actions`` applies it to every job.
- ``idle_pause_reason``, ``reclaim_pause_reason``: the reason an idle pause records (it starts
  with ``IDLE_REASON``, so the job's next call resumes it).
- ``asked_for``: whether someone waits on a queued job, the condition for taking an idle job's
  resources for it (``slot_reclaim_idle_s``; the policy picks which: ``FairSharePolicy.reclaim_idle``).
- ``finished_to_prune``: the finished inference jobs the job table no longer keeps.
"""

from __future__ import annotations

from collections.abc import Iterable

from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.state_rows import JobRow
from polytinker.scheduler.types import JobKind, JobState

IDLE_REASON = "idle:"
# A client answered "waiting" asks again within a few seconds (its back-off is capped at 2 s), so
# a queued job no call named for this long has nobody waiting on it: it takes nothing from others.
ASKED_WITHIN_S = 10.0


def idle_verdict(
    config: RuntimeConfig, kind: JobKind, state: JobState, reason: str, *, placed: bool, idle_s: float, in_flight: int
) -> str | None:
    """What the idle rules do to a job now: "pause", "finish" or None.

    A call in flight keeps any job live. A placed job (running, preempting) idle for its limit is
    paused: ``inference_idle_s`` for inference jobs (a base sampler holds no state and resumes at
    once), ``job_idle_pause_s`` for the others (their client probably died). A queued inference
    job that no client asked for in ``inference_idle_s`` is paused too (a live client keeps asking
    while it waits). An inference job idle-paused for ``job_idle_pause_s`` more is finished (its
    client is gone; finished ones are pruned). Paused training jobs stay paused: they hold state.
    (A placed job idle for ``slot_reclaim_idle_s`` is also paused when another job waits for its
    resources; the policy chooses those, see ``FairSharePolicy.reclaim_idle``.)"""
    if in_flight > 0:
        return None
    if kind == JobKind.INFERENCE:
        if (placed or state == JobState.QUEUED) and idle_s >= config.inference_idle_s:
            return "pause"
        idle_paused = state == JobState.PAUSED and reason.startswith(IDLE_REASON)
        if idle_paused and idle_s >= config.inference_idle_s + config.job_idle_pause_s:
            return "finish"
        return None
    return "pause" if placed and idle_s >= config.job_idle_pause_s else None


def idle_actions(
    config: RuntimeConfig,
    live: Iterable[tuple[str, JobKind, bool, float, int]],
    idle_paused: Iterable[tuple[str, float, int]],
) -> list[tuple[str, str, str]]:
    """``(job_id, "pause" or "finish", reason)`` by ``idle_verdict`` for the jobs the policy knows
    (``live``: job id, kind, placed, idle seconds, calls in flight) and the inference jobs paused for
    being idle (``idle_paused``: job id, idle seconds, calls in flight)."""
    out = []
    for job_id, kind, placed, idle_s, busy in live:
        state = JobState.RUNNING if placed else JobState.QUEUED
        if idle_verdict(config, kind, state, "", placed=placed, idle_s=idle_s, in_flight=busy) == "pause":
            out.append((job_id, "pause", idle_pause_reason(config, kind, placed)))
    for job_id, idle_s, busy in idle_paused:
        verdict = idle_verdict(
            config, JobKind.INFERENCE, JobState.PAUSED, IDLE_REASON, placed=False, idle_s=idle_s, in_flight=busy
        )
        if verdict == "finish":
            out.append((job_id, "finish", f"{IDLE_REASON} no call for {idle_s:.0f} s; finished (its client is gone)"))
    return out


def idle_pause_reason(config: RuntimeConfig, kind: JobKind, placed: bool) -> str:
    limit = config.inference_idle_s if kind == JobKind.INFERENCE else config.job_idle_pause_s
    if placed:
        return f"{IDLE_REASON} no call for {limit:g} s; paused to free its resources (a call resumes it)"
    return f"{IDLE_REASON} no client asked for it for {limit:g} s while queued; paused (a call resumes it)"


def reclaim_pause_reason(why: str) -> str:
    """``why``: the policy's words for this victim (they name no other tenant or job)."""
    return (
        f"{IDLE_REASON} {why}; paused, its resources freed for the waiting job (its state is kept; a call resumes it)"
    )


def asked_for(now: float, last_call: float | None) -> bool:
    """Whether someone waits on a queued job whose last call (or submission) was at ``last_call``."""
    return last_call is not None and now - last_call <= ASKED_WITHIN_S


def finished_to_prune(rows: Iterable[JobRow], keep: int, cutoff_s: float) -> list[str]:
    """Of finished inference jobs, those to delete: per tenant all but the newest ``keep``, and any
    updated (finished) before ``cutoff_s`` (wall-clock seconds)."""
    by_tenant: dict[str, list[JobRow]] = {}
    for row in rows:
        by_tenant.setdefault(row.tenant, []).append(row)
    doomed = []
    for mine in by_tenant.values():
        mine.sort(key=lambda r: r.updated_s, reverse=True)
        doomed += [r.job_id for i, r in enumerate(mine) if i >= keep or r.updated_s < cutoff_s]
    return doomed


__all__ = [
    "ASKED_WITHIN_S",
    "IDLE_REASON",
    "asked_for",
    "finished_to_prune",
    "idle_actions",
    "idle_pause_reason",
    "idle_verdict",
    "reclaim_pause_reason",
]
