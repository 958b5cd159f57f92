"""Job lifecycle: submit, schedule, run, pause, resume, cancel, finish; recovery after a restart.

``JobManager`` owns the policy (``FairSharePolicy`` from the decision core: this module makes no
scheduling decision itself) and the job rows in SQLite. The policy sees each run of a job as a
policy job with its own id (``<job_id>.<attempt>``): a paused and resumed job, or a job recovered
after a scheduler restart, is submitted afresh. Every decision is written to the events table
with its reason.

States a tenant sees: queued (its reason says where in the queue and for what: ``waits.py``),
running, preempting (told to stop at its next step boundary), paused, done, cancelled, rejected.

Activity: every call that names a job marks it active while it runs and when it ends
(``running``, ``touch``; kept by ``JobActivity``, ``activity.py``); ``pause_idle`` applies the idle
rules of ``idle_verdict`` (``idle.py``) to the rest, and pauses placed jobs idle for
``slot_reclaim_idle_s`` whose resources a queued job someone waits on needs (the policy picks
which: ``FairSharePolicy.reclaim_idle``). A job's history (the events table) records what happened:
an idle pause is a ``pause`` event with its reason, never a ``cancel``. ``prune_finished``
deletes finished inference jobs beyond ``keep_finished_inference`` per tenant or older than
``finished_inference_keep_s``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from polytinker.engine.models import model_names, served_name
from polytinker.engine.worker.messages import Register
from polytinker.errors import AuthError, ConfigError, JobNotRunning, OverloadedError
from polytinker.scheduler.config import SchedulerPolicyConfig
from polytinker.scheduler.policy import FairSharePolicy
from polytinker.scheduler.service.activity import JobActivity
from polytinker.scheduler.service.broker import Broker
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.idle import (
    IDLE_REASON,
    asked_for,
    finished_to_prune,
    idle_actions,
    reclaim_pause_reason,
)
from polytinker.scheduler.service.messages import CreateJob
from polytinker.scheduler.service.policy_view import cluster_spec, policy_job, worker_spec
from polytinker.scheduler.service.request_keys import repeated_job, request_digest
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.state_rows import JobRow
from polytinker.scheduler.service.waits import WaitNotes
from polytinker.scheduler.types import (
    Accepted,
    Decision,
    DecisionKind,
    JobKind,
    JobState,
    Overloaded,
    Placement,
)

log = logging.getLogger("polytinker.scheduler.service")

LIVE_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.PREEMPTING)
FINAL_STATES = (JobState.DONE, JobState.CANCELLED, JobState.REJECTED)
# The state each of a tenant's job actions (but resume) leaves the job in.
_ACTION_STATES = {"cancel": JobState.CANCELLED, "pause": JobState.PAUSED, "finish": JobState.DONE}


def adapter_key(tenant: str, job_id: str, agent: str) -> str:
    """The runtime-wide adapter name: unique per (tenant, job, agent); tenants never share one."""
    return f"{tenant}/{job_id}/{agent}"


@dataclass
class _Live:
    """In-memory facts about a job the policy knows."""

    policy_id: str
    start_version: int  # the adapter version when this run was submitted: the policy counts steps from it
    placement: Placement | None = None
    kind: JobKind = JobKind.LORA_RL


class JobManager:
    """Jobs of every tenant; thread-safe (one lock around the policy and the job table)."""

    def __init__(
        self,
        config: RuntimeConfig,
        store: StateStore,
        tenant_weights: tuple[tuple[str, float], ...],
        clock: Callable[[], float] = time.monotonic,  # seconds; tests pass one they move by hand
    ):
        self.config = config
        self._clock = clock
        self.store = store
        policy_config = SchedulerPolicyConfig(
            tenant_weights=tenant_weights,
            max_queued_jobs=config.max_queued_jobs,
            max_queued_per_tenant=config.max_queued_per_tenant,
        )
        self.policy = FairSharePolicy(cluster_spec(config), policy_config)
        self._lock = threading.RLock()
        self._t0 = self._clock()
        self._live: dict[str, _Live] = {}
        self.activity = JobActivity(self._clock, self._lock)  # the calls that named each job
        # Jobs no worker there could run, kept queued for one that joins ([cluster] join_undeclared).
        self._awaiting_worker: set[str] = set()
        self._idle_paused: set[str] = set()  # inference jobs paused for idleness (finished if it lasts)
        self._by_policy_id: dict[str, str] = {}
        # Called with a job's id when it reaches a final state (``_forget``): what other parts keep per job lets go.
        self._on_final: list[Callable[[str], None]] = []
        self._waits = WaitNotes()
        self._attempts = itertools.count(1)
        self._rr = itertools.count()

    def now(self) -> float:
        return self._clock() - self._t0

    def when_final(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(job_id)`` each time a job becomes done, cancelled or rejected (under this
        manager's lock: it must not call back into it)."""
        self._on_final.append(hook)

    # --- recovery ----------------------------------------------------------------------------------
    def recover(self) -> int:
        """Put the live jobs of the job table back into a fresh policy; returns how many."""
        n = 0
        with self._lock:
            for row in self.store.jobs():
                if row.state in LIVE_STATES:
                    self._submit(row, steps_done=self._steps_of(row))
                    n += 1
                elif (
                    row.kind == JobKind.INFERENCE
                    and row.state == JobState.PAUSED
                    and row.reason.startswith(IDLE_REASON)
                ):
                    self._idle_paused.add(row.job_id)  # its idle time counts again from now
                    self.activity.restart(row.job_id)
            self.schedule()
        return n

    def _steps_of(self, row: JobRow) -> int:
        a = self.store.adapter(adapter_key(row.tenant, row.job_id, row.agent))
        return a.version if a is not None else 0

    def follow_workers(self, broker: Broker) -> None:
        """Place new jobs and adapters on the workers registered and alive now first, before
        declared ones that are not (not started yet, or gone: those get work only when nothing
        else will do); and on the workers that join at run time (``Broker.on_join``)."""
        self.policy.cluster.set_presence(broker.alive)
        broker.on_join, broker.on_leave = self._joined, self._left

    def _joined(self, msg: Register) -> None:
        with self._lock:  # the policy places on it from the next scheduling pass
            self.policy.cluster.add(worker_spec(self.config.model, msg.role, msg.worker_id, msg.memory_gb, msg.slots))
            waiting, self._awaiting_worker = sorted(self._awaiting_worker), set()
            for job_id in waiting:  # the jobs no worker could run: this one may
                row = self.store.job(job_id)
                if row is not None and row.state == JobState.QUEUED:
                    self._submit(row, steps_done=self._steps_of(row))

    def _left(self, worker_id: str) -> None:
        """A joined worker left for good (``Broker.forget_gone``): its jobs are queued again, to
        go on from their last version on the workers that are left, and it is placed on no more."""
        with self._lock:
            on_it = [j for j, x in self._live.items() if x.placement and worker_id in x.placement.resources()]
            rows = [row for row in map(self.store.job, on_it) if row is not None]
            for job_id in on_it:
                self._leave_policy(job_id, "requeue")
            self.policy.worker_left(worker_id)  # before they are submitted again: not there for them
            for row in rows:
                steps = self._steps_of(row)
                why = f"{worker_id} left the runtime; queued again at version {steps}"
                self.store.log_event(row.job_id, "requeue", why)
                self._submit(row, steps_done=steps)
            self.schedule()

    # --- submission --------------------------------------------------------------------------------
    def create(self, tenant: str, msg: CreateJob) -> JobRow:
        """A new job of the tenant's, or the one an earlier copy of this call made (``request_keys.py``)."""
        base_model = served_name(self.config.model, msg.base_model)  # by its preset name or its hub id
        if base_model is None:
            names = " or ".join(map(repr, model_names(self.config.model)))
            raise ConfigError(f"this runtime serves base model {names}, not {msg.base_model!r}")
        if msg.kind == JobKind.INFERENCE and msg.adapter:
            raise ConfigError("inference jobs sample the base model here; sample adapters with their model_path")
        if msg.kind == JobKind.LORA_RL:  # the one kind whose adapter the engines sample from
            self.config.check_servable_lora(msg.rank, msg.target_modules)
        if msg.kind == JobKind.FULL_RL:
            self.config.check_servable_full()
        now = time.time()
        job_id = f"{msg.kind.replace('_', '')}-{uuid.uuid4().hex[:10]}"
        lora = {"rank": msg.rank, "alpha": msg.alpha, "target_modules": list(msg.target_modules), "seed": msg.seed}
        head = (job_id, tenant, JobKind(msg.kind), base_model, msg.agent, lora, JobState.QUEUED, msg.priority)
        steps, key = msg.steps or self.config.jobs.steps, msg.request_key
        row = JobRow(*head, steps, "", now, now, msg.max_staleness, key, request_digest(msg) if key else "")
        with self._lock:  # the key's lookup and the job's insert under one lock: two copies make one job
            if (made := repeated_job(self.store, tenant, msg)) is not None:
                return made  # a resend (the first copy's answer was lost): its job, not a second one
            result = self._submit(row, steps_done=0, new=True)
            if isinstance(result, Overloaded):
                raise OverloadedError(result.decision.reason, result.retry_after_s)
            self.schedule()
        got = self.store.job(job_id)
        assert got is not None
        return got

    def _submit(self, row: JobRow, *, steps_done: int, new: bool = False) -> Accepted | Overloaded | None:
        policy_id = f"{row.job_id}.{next(self._attempts)}"
        adapter = adapter_key(row.tenant, row.job_id, row.agent)
        job = policy_job(self.config, row, policy_id, steps_done, self.now(), adapter)
        result = self.policy.submit(job, self.now())
        if isinstance(result, Overloaded):
            self._log(result.decision)
            if not new:
                self._set_state(row.job_id, JobState.QUEUED, result.decision.reason)
            return result
        if new:
            self.store.insert_job(row)
        self._log(result.decision)
        if isinstance(result, Accepted):
            self._live[row.job_id] = _Live(policy_id, start_version=steps_done, kind=row.kind)
            self.activity.restart(row.job_id)
            self._by_policy_id[policy_id] = row.job_id
            self._set_state(row.job_id, JobState.QUEUED, result.decision.reason)
            return result
        if self.config.cluster.join_undeclared:  # no worker can run it yet, but one may join
            self._awaiting_worker.add(row.job_id)
            why = result.decision.reason.removeprefix("can never run here: ")
            self._set_state(row.job_id, JobState.QUEUED, f"waiting for a worker that can run it to join: {why}")
            return None
        self._set_state(row.job_id, JobState.REJECTED, result.decision.reason)
        return None

    # --- the scheduling pass -----------------------------------------------------------------------
    def schedule(self) -> list[Decision]:
        with self._lock:
            decisions = self.policy.schedule(self.now())
            for d in decisions:
                job_id = self._by_policy_id.get(d.job_id)
                if job_id is None:
                    continue
                self._log(d)
                if d.kind is DecisionKind.START:
                    self._live[job_id].placement = d.placement
                    self.activity.restart(job_id)  # idle time counts from its start
                    self._set_state(job_id, JobState.RUNNING, d.reason)
                elif d.kind is DecisionKind.PREEMPT:
                    self._set_state(job_id, JobState.PREEMPTING, d.reason)
                    row = self.store.job(job_id)
                    if row is not None and row.kind == JobKind.INFERENCE:  # no step to wait for: stop now
                        self.step_boundary(job_id, self._live[job_id].start_version)
            self._waits.note(self.policy, self.now(), self._by_policy_id, self._set_state)
            return decisions

    def pause_idle(self) -> list[str]:
        """Apply the idle rules (``idle_verdict``): pause the idle jobs (their resources go back
        to the pool; the next call resumes them), finish the inference jobs whose client is gone,
        and pause the placed jobs idle for ``slot_reclaim_idle_s`` whose resources a queued job
        needs (``_reclaim``). Returns the ids of the jobs paused or finished."""
        now = self._clock()
        changed = []
        with self._lock:
            live = [(j, x.kind, x.placement is not None, *self.activity.idle(j, now)) for j, x in self._live.items()]
            paused = [(j, *self.activity.idle(j, now)) for j in self._idle_paused]
            for job_id, verdict, reason in idle_actions(self.config, live, paused):
                if verdict == "pause":
                    self._pause_for_idle(job_id, self._live[job_id].kind, reason)
                else:
                    self._set_state(job_id, JobState.DONE, reason)  # forgotten with it
                    self.store.log_event(job_id, "finish", reason)
                changed.append(job_id)
            if changed:  # what they freed may be enough: take nothing more from idle jobs than needed
                self.schedule()
            reclaimed = self._reclaim(now)
            if reclaimed:
                self.schedule()
        return changed + reclaimed

    def _reclaim(self, now: float) -> list[str]:
        """Pause placed jobs with no call for ``slot_reclaim_idle_s`` (and none in flight) whose
        resources queued jobs need, while someone waits on those (``asked_for``); the policy picks
        which (``FairSharePolicy.reclaim_idle``). Each is an idle pause: its state stays and its
        next call queues it again. The waiting job's history gets a ``reclaim`` event."""
        idle: dict[str, float] = {}
        for job_id, live in self._live.items():
            idle_s, busy = self.activity.idle(job_id, now)
            if live.placement is not None and not busy and idle_s >= self.config.slot_reclaim_idle_s:
                idle[live.policy_id] = idle_s

        def wanted(policy_id: str) -> bool:
            return asked_for(now, self.activity.last_call(self._by_policy_id.get(policy_id, "")))

        paused = []
        for r in self.policy.reclaim_idle(self.now(), idle, wanted):
            waiting = self._by_policy_id[r.for_job]
            for victim, why in zip(r.victims, r.reasons, strict=True):
                job_id = self._by_policy_id[victim]
                log.info("idle job %s paused so that %s fits: %s", job_id, waiting, why)
                self._pause_for_idle(job_id, self._live[job_id].kind, reclaim_pause_reason(why))
                paused.append(job_id)
            # No victim named: they may be another tenant's, and this history is this job's tenant's.
            self.store.log_event(waiting, "reclaim", f"{len(r.victims)} idle job(s) paused to free resources for it")
        return paused

    def _pause_for_idle(self, job_id: str, kind: JobKind, reason: str) -> None:
        self._leave_policy(job_id, "pause")
        self._set_state(job_id, JobState.PAUSED, reason)
        self.store.log_event(job_id, "pause", reason)
        if kind == JobKind.INFERENCE:
            self._idle_paused.add(job_id)

    def step_boundary(self, job_id: str, version: int) -> None:
        """The job completed optimizer step ``version`` (already durable): a preempted job stops here."""
        with self._lock:
            live = self._live.get(job_id)
            if live is None:
                return
            row = self.store.job(job_id)
            if row is None or row.state != JobState.PREEMPTING:
                return
            declared = max(1, row.steps - min(live.start_version, row.steps - 1))
            done = min(max(version - live.start_version, self.policy.steps_done(live.policy_id)), declared - 1)
            self._log(self.policy.job_stopped(live.policy_id, self.now(), done))
            live.placement = None
            self._set_state(job_id, JobState.QUEUED, "preempted at a step boundary; its state is saved; queued again")
            self.schedule()

    # --- queries and actions -------------------------------------------------------------------------
    def get(self, tenant: str, job_id: str) -> JobRow:
        row = self.store.job(job_id)
        if row is None or row.tenant != tenant:
            # The same answer for "not yours" and "does not exist": tenants learn nothing of others.
            raise AuthError(f"no job {job_id!r} for this tenant")
        return row

    def running(self, tenant: str, job_id: str) -> tuple[JobRow, Placement]:
        """The job and where it runs; JobNotRunning when it cannot take work now. A job paused
        for being idle is resumed by this call, and so is an inference job finished for being
        idle (its client was only quiet, not gone: a base sampler has no state to lose)."""
        with self._lock:  # read under the lock that pruning and the idle rules take
            row = self.get(tenant, job_id)
            idle_done = row.kind == JobKind.INFERENCE and row.state == JobState.DONE
            resume = row.reason.startswith(IDLE_REASON) and (row.state == JobState.PAUSED or idle_done)
            if row.state not in FINAL_STATES or resume:
                self.activity.mark(job_id)
            if resume:
                self._idle_paused.discard(job_id)
                self._submit(row, steps_done=self._steps_of(row))
                self.schedule()
                row = self.get(tenant, job_id)
            live = self._live.get(job_id)
            placement = live.placement if live is not None else None
        if row.state not in (JobState.RUNNING, JobState.PREEMPTING) or placement is None:
            raise JobNotRunning(f"job {job_id} is {row.state}: {row.reason}", row.state, tenant)
        return row, placement

    def touch(self, job_id: str) -> None:
        """A call used the job without needing it placed (sampling a training job's saved
        adapter): it counts as activity, so the job is not paused as idle while it is used. The
        caller has checked that the job is the tenant's own."""
        with self._lock:
            if job_id in self._live:
                self.activity.mark(job_id)

    def prune_finished(self) -> list[str]:
        """Delete finished inference jobs (and their events) from the job table: per tenant all
        but the newest ``keep_finished_inference``, and any finished ``finished_inference_keep_s``
        ago. A base sampler leaves nothing else behind; training jobs are never deleted."""
        cutoff = time.time() - self.config.finished_inference_keep_s
        with self._lock:  # a call resumes an idle-finished job under this lock: never delete one it revived
            rows = self.store.jobs_of(JobKind.INFERENCE, FINAL_STATES)
            doomed = finished_to_prune(rows, self.config.keep_finished_inference, cutoff)
            if doomed:
                self.store.delete_jobs(doomed)
        if doomed:
            log.info("pruned %d finished inference jobs from the job table", len(doomed))
        return doomed

    def action(self, tenant: str, job_id: str, action: str) -> JobRow:
        row = self.get(tenant, job_id)
        with self._lock:
            if action == "resume":
                if row.state != JobState.PAUSED:
                    raise ConfigError(f"job {job_id} is {row.state}; only a paused job can be resumed")
                self._idle_paused.discard(job_id)
                self._submit(row, steps_done=self._steps_of(row))
                self.schedule()
            elif row.state in FINAL_STATES or (row.state == JobState.PAUSED and action == "pause"):
                raise ConfigError(f"job {job_id} is {row.state}; it cannot be {action}d")
            else:
                self._leave_policy(job_id, action)
                new_state = _ACTION_STATES[action]
                self._set_state(job_id, new_state, f"{action} requested by its tenant")
                self.store.log_event(job_id, action, f"{action} requested by its tenant")
                self._idle_paused.discard(job_id)
                self.schedule()
        got = self.store.job(job_id)
        assert got is not None
        return got

    def _leave_policy(self, job_id: str, action: str) -> None:
        """Take the job out of the policy. Its history gets one event from the caller (the tenant's request, or the
        idle pause with its reason), not the policy's decision: a pause, or a finish of a job that never started,
        leaves through the policy's cancel, whose "cancelled by its tenant" did not happen, and a finish's "all steps
        done" need not be true."""
        live = self._live.pop(job_id, None)
        if live is None:
            return
        self._by_policy_id.pop(live.policy_id, None)
        if action == "finish" and live.placement is not None:
            decision = self.policy.job_finished(live.policy_id, self.now())
        else:
            decision = self.policy.cancel(live.policy_id, self.now())
        log.info("%s of %s takes it out of the policy: %s", action, job_id, decision)

    def _forget(self, job_id: str) -> None:
        """What is kept in memory for a job that ended (done, cancelled, rejected): its activity
        here and whatever the ``when_final`` hooks keep (bounded memory under many short-lived jobs)."""
        self.activity.forget(job_id)
        self._idle_paused.discard(job_id)
        for hook in self._on_final:
            hook(job_id)

    def learner_of(self, job_id: str) -> str | None:
        """The learner group a job is placed on now (None: it is not). Changes nothing."""
        with self._lock:
            live = self._live.get(job_id)
            return live.placement.learner if live is not None and live.placement is not None else None

    def route(self, adapter: str | None, base_model: str) -> str:
        """The engine a sample request goes to: placement's choice for an adapter (a holder, or one
        that loads it), round-robin over the base model's engines for the base model itself."""
        base_model = served_name(self.config.model, base_model) or base_model
        with self._lock:
            cluster = self.policy.cluster
            if adapter is None:
                engines = cluster.adapters.present_first(cluster.adapters.engines_of(base_model))
                if not engines:
                    raise ConfigError(f"no engine serves base model {base_model!r}")
                return engines[next(self._rr) % len(engines)]
            placed = cluster.adapters.route(adapter, base_model, self.now())
            if placed is None:
                raise OverloadedError("every adapter slot of every engine is pinned by running jobs", 5.0)
            return placed.engine

    def _set_state(self, job_id: str, state: JobState, reason: str) -> None:
        self.store.set_job_state(job_id, state, reason)
        if state in FINAL_STATES:
            self._forget(job_id)

    def _log(self, d: Decision) -> None:
        job_id = self._by_policy_id.get(d.job_id, d.job_id.rsplit(".", 1)[0])
        log.info("decision %s", d)
        self.store.log_event(job_id, str(d.kind), d.reason)


__all__ = ["FINAL_STATES", "LIVE_STATES", "JobManager", "adapter_key"]
