"""The scheduler process: the one entry point of a runtime.

``SchedulerService`` serves the client requests (``polytinker.scheduler.service.messages``) on
one RPC server, authenticates each by its API key, checks that the job or adapter it names is the
tenant's own, bounds what is in flight (an overloaded answer says when to retry), and forwards the
work to the learner group or engine the job was placed on (through the ``Broker``). Its handlers
are the job and training calls; the sampling calls are ``SamplingCalls`` (``sampling.py``), those
on kept checkpoints ``CheckpointCalls`` (``checkpoints.py``). ``SchedulerActor`` (``actor.py``) runs
it as the runtime's scheduler process.

Durability: ``optim_step`` answers only after the learner wrote the new version's checkpoint and
this process committed the version to SQLite. A scheduler killed at any moment restarts with every
acknowledged step (``JobManager.recover``); a step taken but not acknowledged is rolled back to
the recorded checkpoint the next time the job's adapter is used, unless its call is resent (the
learner then answers the step it took, and it is recorded).

Idempotent training calls: ``forward_backward`` and ``optim_step`` go to the learner with an
idempotency key, the job's adapter and the call's ``request_id`` (the client's, the same on each of
its resends; one made here for a client that sends none), with the adapter version the call builds
on. The learner answers a key it already ran with its first result, so the broker may resend them
to a worker it wrongly declared dead, and the client may resend them to a restarted scheduler: a
gradient is applied once, and a completed step is recorded, not lost or taken twice.

Paths: a tenant names its weights by name (``save_state``'s name, or the ``polytinker-ckpt://JOB/NAME``
it returned) or by model path (``polytinker://JOB/AGENT@VERSION``), never by a filesystem path, and
only its own jobs' resolve (``WeightsCatalog``, in ``weights.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter
from typing import Any

from polytinker.engine.worker import messages as wm
from polytinker.engine.worker.layout import check_name
from polytinker.errors import (
    ConfigError,
    GradientLost,
    JobNotRunning,
    OverloadedError,
    RemoteError,
)
from polytinker.model_path import SAMPLER_NAME_PREFIX, CheckpointPath, ModelPath
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.audit import AuditLog
from polytinker.scheduler.service.broker import Broker, WorkerHandle
from polytinker.scheduler.service.checkpoints import CheckpointCalls
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.jobs import FINAL_STATES, LIVE_STATES, JobManager, adapter_key
from polytinker.scheduler.service.load import Admission
from polytinker.scheduler.service.sampling import SamplingCalls
from polytinker.scheduler.service.state import HISTORY_RETENTION_S, StateStore
from polytinker.scheduler.service.state_rows import AdapterRow, JobRow
from polytinker.scheduler.service.tenants import Tenants
from polytinker.scheduler.service.usage import UsageMeter
from polytinker.scheduler.service.weights import WeightsCatalog, expiry
from polytinker.scheduler.types import JobKind, JobState
from polytinker.transport import RpcServer, ServerCurve, TransportConfig, ask, handler_table
from polytinker.transport.server import peer_user_id

log = logging.getLogger("polytinker.scheduler.service")


class SchedulerService:
    """Handlers of every client and worker request; see the module docstring."""

    def __init__(self, config: RuntimeConfig, token: str) -> None:
        self.config = config
        self.root = config.state_path
        self.store = StateStore(self.root / "scheduler.sqlite3")
        self.tenants = Tenants(self.store)
        for t in config.tenants:
            self.tenants.add(t)
        self.broker = Broker(config, token)
        self.jobs = JobManager(config, self.store, self.tenants.weights())
        self.jobs.follow_workers(self.broker)
        self.audit = AuditLog(self.store, self._tenant)
        self.meter = UsageMeter(self.store, self._tenant)
        self.weights = WeightsCatalog(self.root, self.store, self.jobs, config, self.audit)
        self.checkpoints = CheckpointCalls(self.store, self.jobs, self.weights, self.audit, self._tenant, config.model)
        # forward_backward request ids answered since each adapter's last step: optim_step tells the learner how
        # many it must hold, so a learner restarted between a step's calls refuses the step (GradientLost) instead
        # of stepping on part of its gradient. No entry (restarted, or a step failed): only resent steps are checked.
        self._fb_ids: dict[str, set[str]] = {}
        # Per adapter, the learner process that last loaded it (worker id, incarnation): a load by
        # another one is a restore from the checkpoint, which the job's events tell its tenant.
        self._held_by: dict[str, tuple[str, str]] = {}
        self.jobs.when_final(self._job_final)  # both maps let go of a job that ended: bounded by the live jobs
        self.admission = Admission(config, weights=dict(self.tenants.weights()))
        self.sampling = SamplingCalls(
            config, self.broker, self.jobs, self.weights, self.admission, self.meter, self.audit, self._tenant
        )
        self._stop = threading.Event()
        self.server: RpcServer | None = None
        self.local_server: RpcServer | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self, address: str) -> SchedulerService:
        """Recover the jobs, serve ``handlers()`` at ``address`` and start the scheduling passes.
        ``address=""`` serves no socket: an in-process runtime (``InprocRuntime``) calls the handlers."""
        recovered = self.jobs.recover()
        log.info("recovered %d live jobs from %s", recovered, self.store.path)
        if not address:
            threading.Thread(target=self._tick, name="scheduler-tick", daemon=True).start()
            return self
        curve = None
        if self.config.curve_secret_file:
            curve = ServerCurve.from_files(self.config.curve_secret_file, [self.config.curve_clients_dir])
        threads, timeout_s = self.config.handler_threads, self.config.request_timeout_s
        cfg = TransportConfig(handler_threads=threads, request_timeout_s=timeout_s)
        self.server = RpcServer(address, self.handlers(), config=cfg, curve=curve).start()
        if curve is not None:
            # Processes on this machine (local workers, the launcher) talk over a Unix socket that
            # only this user can open, so they need no Curve keys of their own.
            self.local_server = RpcServer(self.config.local_address, self.handlers(), config=cfg).start()
        threading.Thread(target=self._tick, name="scheduler-tick", daemon=True).start()
        return self

    def _tick(self) -> None:
        passes = 0
        while not self._stop.wait(0.5):
            passes += 1
            try:
                self.broker.forget_gone()
                self.jobs.pause_idle()
                self.jobs.schedule()
                if passes % 10 == 0:  # every 5 s: a query over the finished jobs, one over expiries
                    self.jobs.prune_finished()
                    self.weights.expire(time.time())
                    self.meter.flush()
                if passes % 7200 == 1:  # hourly, from the first pass: audit rows and usage past retention
                    self.store.prune_history(time.time() - HISTORY_RETENTION_S)
            except Exception:  # the loop must outlive one bad pass
                log.exception("scheduling pass failed")

    def stop(self) -> None:
        self._stop.set()
        for server in (self.server, self.local_server):
            if server is not None:
                server.stop()
        self.broker.close()
        self.store.close()

    def handlers(self) -> dict[str, Any]:
        h = {
            m.CreateJob: self.create_job,
            m.JobQuery: self.job_query,
            m.JobAction: self.job_action,
            m.ListJobs: self.list_jobs,
            m.ForwardBackward: self.forward_backward,
            m.Forward: self.forward,
            m.OptimStep: self.optim_step,
            m.SaveState: self.save_state,
            m.LoadState: self.load_state,
            m.SaveWeights: self.save_weights,
            m.RuntimeStatus: self.runtime_status,
        }
        h |= self.sampling.handlers() | self.checkpoints.handlers() | self.audit.handlers() | self.meter.handlers()
        workers = {wm.Register: self.broker.register, wm.Leave: self.broker.leave}
        workers |= {wm.WorkersQuery: self.broker.workers_query, wm.ActorsReport: self.broker.supervised}
        return handler_table({cls: self._guard(fn) for cls, fn in h.items()} | workers)

    def _guard(self, fn: Any) -> Any:
        """Check the tokens a request carries against the base model (its ``check_model``) before
        anything is queued, and answer the expected refusals as typed retry answers instead of errors."""

        @functools.wraps(fn)  # the handler's annotations stay readable (tests/test_handler_tables.py)
        def run(msg: Any) -> Any:
            if (check_model := getattr(msg, "check_model", None)) is not None:
                check_model(self.broker.model_limits)
            try:
                with self.jobs.activity.calls():  # the job the call names is busy until it ends
                    return fn(msg)
            except OverloadedError as exc:
                return r.OverloadedReply(exc.retry_after_s, str(exc))
            except JobNotRunning as exc:
                if exc.state in FINAL_STATES:
                    raise  # it will never run again: fail now instead of making the client wait
                self.admission.waited(exc.tenant)
                return r.WaitingReply(JobState(exc.state), 0.25, str(exc))

        return run

    def _tenant(self, api_key: str) -> str:
        return self.tenants.authenticate(api_key, peer_user_id())

    # --- jobs ------------------------------------------------------------------------------------
    def create_job(self, msg: m.CreateJob) -> r.JobReply:
        tenant = self._tenant(msg.api_key)
        row = self.jobs.create(tenant, msg)
        if row.kind != JobKind.INFERENCE:
            key = adapter_key(tenant, row.job_id, row.agent)
            self.store.ensure_adapter(key, tenant, row.job_id, row.agent)  # a resend's job may lack it (killed)
            if row.state not in FINAL_STATES:  # a rejected job makes no calls
                self._fb_ids.setdefault(key, set())  # a resend's job: the ids its calls made stay
        return r.JobReply(row.public())

    def job_query(self, msg: m.JobQuery) -> r.JobQueryReply:
        row = self.jobs.get(self._tenant(msg.api_key), msg.job_id)
        a = self.store.adapter(adapter_key(row.tenant, row.job_id, row.agent))
        checkpoints = self.store.checkpoints(row.job_id)
        adapter = (
            None
            if a is None
            else {"agent": a.agent, "version": a.version, "model_path": str(ModelPath(row.job_id, a.agent, a.version))}
        )
        return r.JobQueryReply(
            row.public(),
            adapter,
            row.lora_shape(),
            [c["name"] for c in checkpoints],
            self.store.events(row.job_id),
            {c["name"]: float(c["expires_s"]) for c in checkpoints if c["expires_s"] is not None},
            [c["name"] for c in checkpoints if c["public"]],
            {c["name"]: self.weights.size_of(c["path"], int(c["version"])) for c in checkpoints},
        )

    def job_action(self, msg: m.JobAction) -> r.JobReply:
        row = self.jobs.action(self._tenant(msg.api_key), msg.job_id, msg.action)
        for slicer in self.broker.slicers.values():
            slicer.release(row.job_id)
        if row.state in FINAL_STATES:
            self.weights.drop_learner_state(row)
        return r.JobReply(row.public())

    def list_jobs(self, msg: m.ListJobs) -> r.JobListReply:
        tenant = self._tenant(msg.api_key)
        rows = self.store.jobs(tenant)
        if not msg.include_finished:
            rows = [row for row in rows if row.state not in FINAL_STATES]
        activity = self.jobs.activity.stats()
        jobs = [row.public() | activity.get(row.job_id, {}) for row in rows]
        return r.JobListReply(jobs, self._load(tenant))

    def _load(self, tenant: str) -> dict[str, Any]:
        """The tenant's own call figures (see ``Admission``) and how many of its jobs are in each live state."""
        states = Counter(row.state for row in self.store.jobs(tenant))
        jobs = {str(s): states[s] for s in (*LIVE_STATES, JobState.PAUSED)}
        return {"tenant": tenant, **self.admission.tenant_status(tenant), "jobs": jobs}

    def runtime_status(self, msg: m.RuntimeStatus) -> r.RuntimeStatusReply:
        tenant = self._tenant(msg.api_key)
        stats: dict[str, Any] = {}
        for w in self.broker.workers():
            if w["alive"]:
                with contextlib.suppress(Exception):
                    stats[w["worker_id"]] = self.broker.call(
                        w["worker_id"], wm.WorkerStats(), timeout_s=10.0, retry=False
                    )
        switches = {k: s.switches for k, s in self.broker.slicers.items()}
        return r.RuntimeStatusReply(
            base_model=self.config.model,
            workers=self.broker.workers(),
            actors=self.broker.actors(),
            stats=stats,
            learner_switches=switches,
            tenants={tenant: self._load(tenant)},  # a tenant sees its own figures only
            totals=self.admission.totals(),
        )

    # --- training --------------------------------------------------------------------------------
    def _training(self, api_key: str, job_id: str) -> tuple[JobRow, AdapterRow, str]:
        tenant = self._tenant(api_key)
        row, placement = self.jobs.running(tenant, job_id)
        if row.kind == JobKind.INFERENCE or placement.learner is None:
            raise ConfigError(f"job {job_id} is an inference job: it has no learner")
        a = self.store.adapter(adapter_key(tenant, job_id, row.agent))
        assert a is not None
        return row, a, placement.learner

    def _prepare(self, row: JobRow, a: AdapterRow) -> tuple[str, Any]:
        """Make the learner hold the adapter at its recorded version (once per learner process)."""
        full = row.kind == JobKind.FULL_RL
        lora = row.lora

        def ensure(h: WorkerHandle) -> None:
            current = self.store.adapter(a.adapter_key) or a
            msg = wm.EnsureAdapter(
                current.adapter_key,
                current.version,
                self.weights.stored(current.checkpoint, current.version) if current.checkpoint else None,
                lora["rank"],
                lora["alpha"],
                tuple(lora["target_modules"]),
                lora["seed"],
                full,
            )
            out = ask(h.client, msg, timeout_s=self.config.request_timeout_s)
            self._note_restored(row.job_id, current, h, out.loaded)

        return f"ensure:{a.adapter_key}", ensure

    def _job_final(self, job_id: str) -> None:
        row = self.store.job(job_id)
        if row is not None:
            key = adapter_key(row.tenant, row.job_id, row.agent)
            self._fb_ids.pop(key, None)
            self._held_by.pop(key, None)

    def _note_restored(self, job_id: str, a: AdapterRow, h: WorkerHandle, loaded: bool) -> None:
        """Say where a trained adapter came back from, in the job's events (``restore``) and the
        log, when a learner process that did not hold it loaded its last version's checkpoint."""
        before = self._held_by.get(a.adapter_key)
        self._held_by[a.adapter_key] = (h.worker_id, h.incarnation)
        if not loaded or before == (h.worker_id, h.incarnation):
            return  # it held the version already, or the same process reloaded it (models switched)
        if before is None:
            how = f"{h.worker_id} loaded it"
        elif before[0] == h.worker_id:
            how = f"{h.worker_id} restarted (a new process) and loaded it"
        else:
            how = f"it moved from {before[0]} to {h.worker_id}, which loaded it"
        reason = f"{how} at version {a.version}, from that version's checkpoint"
        self.store.log_event(job_id, "restore", reason)
        log.info("job %s: %s", job_id, reason)

    def _turn(self, learner: str, row: JobRow, ends_step: bool = False) -> Any:
        """The job's turn on its learner group: LoRA jobs share it, a full-parameter job holds it alone."""
        shared = row.kind != JobKind.FULL_RL
        return self.broker.slicers[learner].turn(row.job_id, row.priority, ends_step=ends_step, shared=shared)

    def forward_backward(self, msg: m.ForwardBackward) -> r.ForwardBackwardReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        req = wm.LearnerForwardBackward(
            a.adapter_key,
            msg.data,
            msg.loss_fn,
            msg.loss_fn_config,
            row.kind == JobKind.FULL_RL,
            request_id=msg.request_id or uuid.uuid4().hex,
            from_version=a.version,
            attempt=msg.attempt,
        )
        with self.admission.admit(row.tenant, "train"), self._turn(learner, row):
            # LoRA calls that meet at this learner run as one pass; a full-parameter call goes alone.
            out: r.ForwardBackwardReply = self.broker.batchers[learner].call(req, self._prepare(row, a))
        ids = self._fb_ids.get(a.adapter_key)
        if ids is not None:
            ids.add(req.request_id)
        self.meter.tokens(row.tenant, "training", [d.input_tokens for d in msg.data], row.base_model, row.job_id)
        return out  # the learner's answer goes on to the client as it is

    def forward(self, msg: m.Forward) -> r.ForwardReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        req = wm.LearnerForward(a.adapter_key, msg.data, row.kind == JobKind.FULL_RL, msg.loss_fn, msg.loss_fn_config)
        with self.admission.admit(row.tenant, "train"), self._turn(learner, row):
            out: r.ForwardReply = self.broker.call(learner, req, prepare=self._prepare(row, a))
        self.meter.tokens(row.tenant, "training", [d.input_tokens for d in msg.data], row.base_model, row.job_id)
        return out

    def optim_step(self, msg: m.OptimStep) -> r.OptimStepReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        full = row.kind == JobKind.FULL_RL
        fb_ids = self._fb_ids.get(a.adapter_key)
        req = wm.LearnerStep(
            a.adapter_key,
            msg.adam,
            True,
            full,
            request_id=msg.request_id or uuid.uuid4().hex,
            from_version=a.version,
            attempt=msg.attempt,
            expected_fb=-1 if fb_ids is None else len(fb_ids),
        )
        with self.admission.admit(row.tenant, "train"), self._turn(learner, row, ends_step=True):
            # Resent when the learner goes silent: the same process answers a step it took once; a
            # replacement answers it from the key written next to its checkpoint, or refuses
            # (GradientLost) when the step's gradient died with the old process.
            try:
                out: r.StepResult = self.broker.call(learner, req, prepare=self._prepare(row, a), keyed=True)
            except BaseException as exc:
                # GradientLost: the learner dropped what it held and the client redoes the step's
                # calls from nothing. Any other failure leaves the count unknown.
                if isinstance(exc, RemoteError) and exc.code == GradientLost.code:
                    self._fb_ids[a.adapter_key] = set()
                    lost = f"step {a.version + 1}'s gradient died with {learner}'s process; its calls are sent again"
                    self.store.log_event(row.job_id, "lost", lost)
                    log.warning("job %s: %s", row.job_id, lost)
                else:
                    self._fb_ids.pop(a.adapter_key, None)
                raise
            ckpt = wm.WeightsRef(a.adapter_key, out.version)  # where the learner wrote them (layout)
            export = ckpt if full else wm.WeightsRef(a.adapter_key, out.version, "export")
            self.store.record_version(a.adapter_key, out.version, ckpt.relative_path, export.relative_path)
            self._fb_ids[a.adapter_key] = set()
        self.weights.prune(a, out.version)
        self.jobs.step_boundary(row.job_id, out.version)
        return r.OptimStepReply(out.version, out.metrics)

    def save_state(self, msg: m.SaveState) -> r.SaveStateReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        check_name("checkpoint name", msg.name)
        req = wm.LearnerSave(a.adapter_key, msg.name, row.kind == JobKind.FULL_RL)
        with self.admission.admit(row.tenant, "train"), self._turn(learner, row):
            out: r.SavedCheckpoint = self.broker.call(learner, req, prepare=self._prepare(row, a))
        saved = wm.WeightsRef(a.adapter_key, out.version, "checkpoint", msg.name)
        self.store.add_checkpoint(row.job_id, msg.name, saved.relative_path, out.version, expiry(msg.ttl_s))
        self._named(row, msg.name, out.version)
        return r.SaveStateReply(str(CheckpointPath(row.job_id, msg.name)), out.version)

    def load_state(self, msg: m.LoadState) -> r.LoadStateReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        src_job, name = self.weights.checkpoint_name(row, msg.path)
        found = self.store.checkpoint(src_job, name)
        if found is None:
            raise ConfigError(f"no checkpoint {name!r} of job {src_job}; save_state names them")
        path, version = found
        req = wm.LearnerLoad(
            a.adapter_key, self.weights.stored(path, version), row.kind == JobKind.FULL_RL, msg.optimizer
        )
        with self.admission.admit(row.tenant, "train"), self._turn(learner, row):
            out: r.WorkerVersion = self.broker.call(learner, req, prepare=self._prepare(row, a), retry=False)
            assert out.version is not None  # a load leaves the checkpoint's version resident
            export = path  # full parameters: engines load the version from its checkpoint
            if row.kind != JobKind.FULL_RL:
                # Its own export path: the loaded weights are not the ones this version had before.
                loaded = name if src_job == row.job_id else f"{src_job}.{name}"[:128]
                req_export = wm.LearnerExport(a.adapter_key, out.version, loaded_from=loaded)
                export = self.broker.call(learner, req_export, retry=False).weights
            self.store.record_version(a.adapter_key, out.version, path, export)
        source = row if src_job == row.job_id else self.store.job(src_job)
        if source is not None:
            read = {"purpose": "load_state", "into": row.job_id}
            self.audit.checkpoint("checkpoint_read", row.tenant, source, name, version, **read)
        self._fb_ids[a.adapter_key] = set()  # loading replaced the adapter's state, gradient included
        return r.LoadStateReply(out.version)

    def save_weights(self, msg: m.SaveWeights) -> r.SaveWeightsReply:
        row, a, learner = self._training(msg.api_key, msg.job_id)
        name = check_name("sampler name", f"{SAMPLER_NAME_PREFIX}{msg.name}") if msg.name else ""
        if not a.export_dir:  # version 0 was never stepped: export the fresh weights once
            full = row.kind == JobKind.FULL_RL  # full: the export is a checkpoint, kept with them
            req = wm.LearnerExport(a.adapter_key, a.version, full)
            with self._turn(learner, row):
                out: r.ExportedWeights = self.broker.call(learner, req, prepare=self._prepare(row, a))
            self.store.set_export(a.adapter_key, a.version, out.weights)
            if self.store.version_row(a.adapter_key, a.version) is None:
                self.store.record_version(a.adapter_key, a.version, a.checkpoint, out.weights)
            a = self.store.adapter(a.adapter_key) or a
        if name:
            self.store.add_checkpoint(row.job_id, name, a.export_dir, a.version, expiry(msg.ttl_s))
            self._named(row, name, a.version)
        self.weights.handed_out(row.tenant, a.adapter_key, a.version)  # kept sampler_keep_s past keep_checkpoints
        return r.SaveWeightsReply(str(ModelPath(row.job_id, row.agent, a.version)), a.version)

    def _named(self, row: JobRow, name: str, version: int) -> None:
        """A save that named a checkpoint: audited as created, counted as a checkpoint."""
        self.audit.checkpoint("checkpoint_create", row.tenant, row, name, version)
        self.meter.add(row.tenant, "checkpoint", 1, row.base_model, row.job_id)


__all__ = ["SchedulerService"]
