"""The scheduler's calls on checkpoints a tenant keeps: delete, TTL, publish, describe, copy,
export, storage (``sched.delete_checkpoint``, ``sched.set_checkpoint_ttl``,
``sched.publish_checkpoint``, ``sched.weights_info``, ``sched.copy_checkpoint``,
``sched.export_weights``, ``sched.storage_usage``), and holds on versions a client may still
sample (``sched.hold_weights``).

They touch no worker: what they read and write is the scheduler's database and its state root,
through ``WeightsCatalog``. Only the owner deletes, publishes or sets a TTL; reading (describe,
copy, export) takes the tenant's own weights or published ones. Each act goes to the audit log
(``AuditLog``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from polytinker.engine.worker.layout import check_name
from polytinker.errors import ConfigError
from polytinker.model_path import CheckpointPath, ModelPath
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.audit import AuditLog
from polytinker.scheduler.service.jobs import JobManager
from polytinker.scheduler.service.request_keys import repeated_job, request_digest
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.state_rows import JobRow
from polytinker.scheduler.service.weights import WeightsCatalog, expiry
from polytinker.scheduler.types import JobState


class CheckpointCalls:
    def __init__(
        self,
        store: StateStore,
        jobs: JobManager,
        weights: WeightsCatalog,
        audit: AuditLog,
        tenant: Callable[[str], str],
        base_model: str,
    ) -> None:
        self.store, self.jobs, self.weights, self.audit = store, jobs, weights, audit
        self._tenant = tenant  # the tenant of an API key (AuthError for none)
        self.base_model = base_model
        # A tenant's copies one at a time: a resend that reaches this process while the first copy
        # of its call is still being made waits for it, instead of taking its half-made job for one
        # a crash abandoned. Per tenant: one tenant's long copy holds up no other tenant's.
        self._copying: dict[str, threading.Lock] = {}
        self._copying_guard = threading.Lock()

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            m.DeleteCheckpoint: self.delete_checkpoint,
            m.SetCheckpointTtl: self.set_checkpoint_ttl,
            m.PublishCheckpoint: self.publish_checkpoint,
            m.WeightsInfo: self.weights_info,
            m.CopyCheckpoint: self.copy_checkpoint,
            m.ExportWeights: self.export_weights,
            m.StorageUsage: self.storage_usage,
            m.HoldWeights: self.hold_weights,
        }

    def hold_weights(self, msg: m.HoldWeights) -> r.HoldWeightsReply:
        """Hold a version the tenant may sample (its own, or published) for ``holder``, or release
        every hold of ``holder`` (no model path), which prunes what only they kept."""
        tenant = self._tenant(msg.api_key)
        if not msg.model_path:
            return r.HoldWeightsReply(self.weights.release(tenant, msg.holder))
        self.weights.hold(tenant, msg.holder, msg.model_path)
        return r.HoldWeightsReply(self.weights.holds.count(tenant, msg.holder))

    def delete_checkpoint(self, msg: m.DeleteCheckpoint) -> r.DeleteCheckpointReply:
        """Forget one of a job's named checkpoints (as the job lists them) and delete its files;
        a job of any state, the tenant's own only."""
        row = self.jobs.get(self._tenant(msg.api_key), msg.job_id)
        files_deleted = self.weights.delete_checkpoint(row, check_name("checkpoint name", msg.name), row.tenant)
        self.store.log_event(row.job_id, "delete_checkpoint", msg.name)
        return r.DeleteCheckpointReply(msg.name, files_deleted)

    def set_checkpoint_ttl(self, msg: m.SetCheckpointTtl) -> r.CheckpointTtlReply:
        row = self.jobs.get(self._tenant(msg.api_key), msg.job_id)
        expires = expiry(msg.ttl_s)
        found = self.store.checkpoint(row.job_id, msg.name)
        if found is None or not self.store.set_checkpoint_expiry(row.job_id, msg.name, expires):
            raise ConfigError(f"job {row.job_id} has no checkpoint {msg.name!r}")
        self.audit.checkpoint("checkpoint_ttl_set", row.tenant, row, msg.name, found[1], expires_s=expires)
        return r.CheckpointTtlReply(msg.name, expires)

    def publish_checkpoint(self, msg: m.PublishCheckpoint) -> r.PublishCheckpointReply:
        row = self.jobs.get(self._tenant(msg.api_key), msg.job_id)  # the owner's alone
        was = self.weights.publish(row, check_name("checkpoint name", msg.name), msg.public)
        if was != msg.public:
            event = "publish" if msg.public else "unpublish"
            self.store.log_event(row.job_id, event, msg.name)
            found = self.store.checkpoint(row.job_id, msg.name)
            assert found is not None  # publish found it
            self.audit.checkpoint(f"checkpoint_{event}", row.tenant, row, msg.name, found[1])
        return r.PublishCheckpointReply(msg.name, msg.public, was)

    def weights_info(self, msg: m.WeightsInfo) -> r.WeightsInfoReply:
        tenant = self._tenant(msg.api_key)
        job, public = self.weights.info(tenant, msg.path)
        owned = job.tenant == tenant
        return r.WeightsInfoReply(job.job_id, job.kind, job.base_model, job.agent, job.lora_shape(), public, owned)

    def copy_checkpoint(self, msg: m.CopyCheckpoint) -> r.CopyCheckpointReply:
        """Saved weights the tenant may read, copied into a new job of its own that holds them
        (finished from the start: it never takes a learner or an engine slot)."""
        tenant = self._tenant(msg.api_key)
        source, _ = self.weights.info(tenant, msg.path)
        with self._copying_guard:
            lock = self._copying.setdefault(tenant, threading.Lock())
        with lock:
            return self._copy(tenant, source, msg)

    def _copy(self, tenant: str, source: JobRow, msg: m.CopyCheckpoint) -> r.CopyCheckpointReply:
        earlier = self._copied_before(tenant, msg)
        if earlier is not None:  # a resend of a copy that was made: its answer, not a second copy
            return earlier
        copy = self._copy_job(tenant, source, f"holds a copy of {msg.path}; it does not train", msg)
        try:
            path = self.weights.copy_into(tenant, msg.path, copy, expiry(msg.ttl_s))
        except BaseException:
            self.store.delete_jobs([copy.job_id])  # nothing refers to it yet
            raise
        self.store.log_event(copy.job_id, "copy", f"from {msg.path}")
        self.audit.record("checkpoint_read", tenant, source, msg.path, purpose="copy", into=copy.job_id)
        self.audit.record("checkpoint_create", tenant, copy, path, copied_from=msg.path)
        return r.CopyCheckpointReply(copy.job_id, path)

    def export_weights(self, msg: m.ExportWeights) -> r.ExportWeightsReply:
        """Saved weights' files, read from this scheduler's state root: a LoRA version's peft files
        (``adapter_config.json`` as text, the weights as one uint8 array, which travels as a raw
        frame), or a learner checkpoint's weights and ``meta.json`` (a full-parameter version's, or
        a ``save_state`` checkpoint's)."""
        tenant = self._tenant(msg.api_key)
        version, config, weights, full, meta = self.weights.stored_files(tenant, msg.model_path)
        source, _ = self.weights.info(tenant, msg.model_path)
        self.audit.record("checkpoint_read", tenant, source, msg.model_path, version=version, purpose="download")
        return r.ExportWeightsReply(version, self.base_model, config, weights, full, meta)

    def storage_usage(self, msg: m.StorageUsage) -> r.StorageUsageReply:
        """The tenant's named checkpoints now and their bytes (per-step versions not counted: they
        come and go with training)."""
        named = [c for job in self.store.jobs(self._tenant(msg.api_key)) for c in self.store.checkpoints(job.job_id)]
        return r.StorageUsageReply(len(named), sum(self.weights.size_of(c["path"], int(c["version"])) for c in named))

    def _copied_before(self, tenant: str, msg: m.CopyCheckpoint) -> r.CopyCheckpointReply | None:
        """The answer of the tenant's earlier copy with ``msg``'s request key, if one was made."""
        row = repeated_job(self.store, tenant, msg)
        if row is None:
            return None
        held = self.store.checkpoints(row.job_id)
        if not held:  # the first copy's process ended before its weights were in: make it again
            self.store.delete_jobs([row.job_id])
            return None
        if CheckpointPath.parse(msg.path) is not None:
            return r.CopyCheckpointReply(row.job_id, str(CheckpointPath(row.job_id, held[0]["name"])))
        return r.CopyCheckpointReply(row.job_id, str(ModelPath(row.job_id, row.agent, int(held[0]["version"]))))

    def _copy_job(self, tenant: str, source: JobRow, reason: str, msg: m.CopyCheckpoint) -> JobRow:
        """A finished job of ``tenant`` shaped like ``source`` (kind, base model, agent, LoRA
        shape), made to hold copied weights: it never runs, so nothing schedules it. It carries
        the copy call's request key (never the source's: a key names the call that made a job)."""
        now = time.time()
        job_id = f"{source.kind.replace('_', '')}-{uuid.uuid4().hex[:10]}"
        row = replace(
            source,
            job_id=job_id,
            tenant=tenant,
            state=JobState.DONE,
            priority=0,
            reason=reason,
            created_s=now,
            updated_s=now,
            request_key=msg.request_key,
            request_digest=request_digest(msg) if msg.request_key else "",
        )
        self.store.insert_job(row)
        return row


__all__ = ["CheckpointCalls"]
