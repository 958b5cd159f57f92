"""What a tenant's names for weights resolve to, and which stored weights are kept.

A tenant names weights by a checkpoint name (``save_state``'s, or the ``polytinker-ckpt://JOB/NAME``
it returned) or by model path (``polytinker://JOB/AGENT@VERSION``), never by a filesystem path.
Its own jobs' resolve, and so do the checkpoints other tenants published (``publish``): a
published ``save_state`` checkpoint loads into any tenant's job, and a published named sampler
save's version samples for any tenant; deleting, publishing and TTLs stay the owner's. The
database keeps each version's checkpoint and export as a path relative to the state root
(``layout``); the workers are sent ids (``WeightsRef``) and make the paths themselves. Named
checkpoints stay until their owner deletes them or their TTL runs out (``delete_checkpoint``,
``expire``); per-step ones go past the last ``keep_checkpoints`` (``prune``), but a version some
client may still sample keeps its export (sampler weights): one a client holds (``holds``), or one
handed out or sampled within ``sampler_keep_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from polytinker.engine.worker.layout import check_name, parse_relative, under
from polytinker.engine.worker.messages import WeightsRef
from polytinker.errors import AuthError, ConfigError
from polytinker.model_path import CKPT_PREFIX, SAMPLER_NAME_PREFIX, CheckpointPath, ModelPath
from polytinker.scheduler.service.audit import EXPIRY_ACTOR, AuditLog
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.holds import WeightHolds
from polytinker.scheduler.service.jobs import JobManager, adapter_key
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.state_rows import AdapterRow, JobRow
from polytinker.scheduler.types import JobKind

log = logging.getLogger("polytinker.scheduler.weights")


def expiry(ttl_s: float) -> float | None:
    """When a checkpoint saved now with ``ttl_s`` is deleted (a Unix time); None (kept) for 0."""
    return time.time() + ttl_s if ttl_s > 0 else None


class WeightsCatalog:
    """Resolves a tenant's checkpoint names and model paths to stored weights under ``root``."""

    def __init__(self, root: Path, store: StateStore, jobs: JobManager, config: RuntimeConfig, audit: AuditLog) -> None:
        self.root, self.store, self.jobs, self.audit = root, store, jobs, audit
        self.keep_checkpoints, self.sampler_keep_s = config.keep_checkpoints, config.sampler_keep_s
        self.max_held_versions = config.max_held_versions
        self.holds = WeightHolds(store)
        # When each (adapter, version) was last sampled (monotonic s), in this process: a restarted
        # scheduler counts the window from the version's hand-out (kept in the holds table) only.
        self._used: dict[str, dict[int, float]] = {}  # adapter key -> version -> time
        self._used_lock = threading.Lock()  # handler threads sample while another prunes

    def stored(self, text: str, version: int) -> WeightsRef:
        """The ``WeightsRef`` of a checkpoint or export path this scheduler stored."""
        if os.path.isabs(text):  # a database written when absolute paths were kept
            with contextlib.suppress(ValueError):
                text = Path(text).relative_to(self.root).as_posix()
        adapter, kind, stored_version, name = parse_relative(text)
        return WeightsRef(adapter, version if stored_version is None else stored_version, kind, name)

    def handed_out(self, tenant: str, adapter_key: str, version: int) -> None:
        """A version was handed out for sampling (save_weights): its export stays ``sampler_keep_s``
        from now, also across a restart of the scheduler (``WeightHolds.handed_out``)."""
        self.holds.handed_out(tenant, adapter_key, version)

    def used(self, adapter_key: str, version: int) -> None:
        """A version was sampled: its export stays ``sampler_keep_s`` (counted in this process)."""
        with self._used_lock:
            self._used.setdefault(adapter_key, {})[version] = time.monotonic()

    def prune(self, a: AdapterRow, version: int) -> None:
        """Delete the per-step checkpoints and exports older than the last ``keep_checkpoints``;
        named ones (save_state, save_weights_for_sampler with a name) and other jobs' files stay,
        and a named sampler's version stays sampleable (its path keeps resolving). So does a
        version in use (``in_use``): its export stays, its learner state (which only training
        reads, and training is past it) goes."""
        named = {c["path"] for c in self.store.checkpoints(a.job_id)}
        oldest_kept = version - self.keep_checkpoints + 1
        keep = set(named)
        for v in self.in_use(a.adapter_key, oldest_kept):
            found = self.store.version_row(a.adapter_key, v)
            if found is None or not found[1]:
                continue
            ckpt, export = found
            keep.add(export)
            if ckpt != export:  # a full-parameter version's export is its checkpoint
                self._delete_step_files(a, ckpt, named)
        for ckpt, export in self.store.drop_versions_below(a.adapter_key, oldest_kept, keep=keep):
            self._delete_step_files(a, ckpt, named)
            self._delete_step_files(a, export, named)

    def in_use(self, adapter_key: str, below: int) -> set[int]:
        """The adapter's versions older than ``below`` that a client holds, or that were handed out
        or sampled within ``sampler_keep_s`` (older uses are forgotten here)."""
        cutoff = time.monotonic() - self.sampler_keep_s
        handed_since = time.time() - self.sampler_keep_s
        self.holds.forget_handouts(adapter_key, handed_since)
        with self._used_lock:
            uses = self._used.get(adapter_key, {})
            for v in [v for v, t in uses.items() if t < cutoff]:
                del uses[v]
            recent = {v for v in uses if v < below}
            if not uses:
                self._used.pop(adapter_key, None)
        return recent | {v for v in self.holds.held(adapter_key, handed_since) if v < below}

    def hold(self, tenant: str, holder: str, path: str) -> tuple[str, int]:
        """The tenant's ``holder`` holds the version at model path ``path`` (one it may read):
        it is not pruned until the holder is released, or holds ``max_held_versions`` newer ones
        (its oldest hold is released then, and pruned as any version). (adapter key, version)."""
        key, version, _, _ = self.resolve(tenant, path)
        if not key:
            raise ConfigError("the base model has no versions to hold: name a saved version's model path")
        released = self.holds.hold(tenant, check_name("holder", holder), key, version, self.max_held_versions)
        for adapter, old in released:
            log.info(
                "%s of tenant %s holds %d newer versions (max_held_versions): its hold on %s version %d is released",
                holder,
                tenant,
                self.max_held_versions,
                adapter,
                old,
            )
        for adapter in sorted({adapter for adapter, _ in released}):
            if (a := self.store.adapter(adapter)) is not None:
                self.prune(a, a.version)
        return key, version

    def release(self, tenant: str, holder: str) -> int:
        """Drop the holds of the tenant's ``holder`` and prune what they kept; how many adapters
        they were on."""
        adapters = self.holds.release(tenant, check_name("holder", holder))
        for key in adapters:
            a = self.store.adapter(key)
            if a is not None:
                self.prune(a, a.version)
        return len(adapters)

    def _delete_step_files(self, a: AdapterRow, path: str, named: set[str]) -> bool:
        """Delete the per-step checkpoint or export at ``path`` if it is this adapter's and no name
        (save_state's, a named sampler save's) stands on it; whether it was deleted."""
        try:
            ref = self.stored(path, 0)
        except ConfigError:  # "" (never exported), or nothing this runtime made
            return False
        named_checkpoint = ref.kind == "checkpoint" and bool(ref.name)  # save_state's: kept
        if ref.adapter != a.adapter_key or named_checkpoint or path in named:
            return False
        shutil.rmtree(under(self.root, ref.relative_path), ignore_errors=True)
        return True

    def delete_checkpoint(self, row: JobRow, name: str, actor: str, event: str = "checkpoint_delete") -> bool:
        """Forget the job's checkpoint ``name`` (a save_state name, or ``sampler-NAME``) and delete
        its files; whether they were deleted. A named sampler save's version becomes one like any
        other: pruned now when it is older than the kept ones. A save_state checkpoint's files stay
        while an adapter's kept version was loaded from them (a restart reloads from there).
        ``actor`` did it, as ``event`` (the audit log's)."""
        found = self.store.checkpoint(row.job_id, name)
        if found is None:
            raise ConfigError(f"job {row.job_id} has no checkpoint {name!r} (polytinker checkpoints list names them)")
        path, version = found
        self.store.delete_checkpoint(row.job_id, name)
        self.audit.checkpoint(event, actor, row, name, version)
        if name.startswith(SAMPLER_NAME_PREFIX):
            a = self.store.adapter(adapter_key(row.tenant, row.job_id, row.agent))
            if a is None:
                return False
            self.prune(a, a.version)
            return self.store.version_row(a.adapter_key, version) is None
        if self.store.checkpoint_in_use(path):
            return False
        ref = self.stored(path, 0)
        shutil.rmtree(under(self.root, ref.relative_path), ignore_errors=True)
        return True

    def drop_learner_state(self, row: JobRow) -> int:
        """A finished LoRA job's per-step learner checkpoints (weights and optimizer state: three
        times its exports' size), which nothing reads once it can train no more; its exports stay
        sampleable and its named checkpoints stay. How many were deleted."""
        if row.kind == JobKind.FULL_RL:
            return 0  # a full-parameter version's export is its checkpoint
        a = self.store.adapter(adapter_key(row.tenant, row.job_id, row.agent))
        if a is None:
            return 0
        named = {c["path"] for c in self.store.checkpoints(row.job_id)}
        return sum(self._delete_step_files(a, ckpt, named) for ckpt in self.store.version_checkpoints(a.adapter_key))

    def expire(self, now: float) -> None:
        """Delete the named checkpoints whose TTL has run out, as their owner would."""
        for job_id, name in self.store.expired_checkpoints(now):
            row = self.store.job(job_id)
            try:
                if row is None:
                    self.store.delete_checkpoint(job_id, name)
                    continue
                self.delete_checkpoint(row, name, EXPIRY_ACTOR, "checkpoint_expire")
                self.store.log_event(job_id, "expired", f"checkpoint {name}: its ttl ran out")
            except Exception:  # one bad row must not keep the others alive
                log.exception("expiring checkpoint %s of job %s failed", name, job_id)

    def checkpoint_name(self, row: JobRow, path: str) -> tuple[str, str]:
        """(job, name) of what load_state names: a name of this job's, or ``polytinker-ckpt://JOB/NAME``
        of one of the tenant's jobs; never a filesystem path."""
        job_id, name = row.job_id, path
        checkpoint = CheckpointPath.parse(path)
        if checkpoint is not None:
            job_id, name = checkpoint.job_id, checkpoint.name
        if job_id != row.job_id and not self.store.checkpoint_public(job_id, name):
            self.jobs.get(row.tenant, job_id)  # the tenant's own jobs' checkpoints, or published ones (AuthError)
        try:
            return job_id, check_name("checkpoint name", name)
        except ConfigError:
            raise ConfigError(
                f"load_state({path!r}): pass a name given to save_state, or the {CKPT_PREFIX}JOB/NAME path it"
                " returned (never a filesystem path)"
            ) from None

    def resolve(self, tenant: str, path: str) -> tuple[str, int, WeightsRef | None, bool]:
        """(adapter key, version, its export, full parameters?) of a tenant's model path;
        ('', 0, None, False) for the base model."""
        if not path:
            return "", 0, None, False
        parsed = ModelPath.parse(path)
        job_id, agent, version = parsed.job_id, parsed.agent, parsed.version
        job = self.store.job(job_id)
        owner = tenant
        if job is not None and job.tenant != tenant and self.store.version_public(job_id, version, SAMPLER_NAME_PREFIX):
            owner = job.tenant  # a published version: read as its owner's
        key = adapter_key(owner, job_id, agent)  # another tenant's unpublished path resolves to nothing here
        a = self.store.adapter(key)
        found = self.store.version_row(key, version) if a is not None else None
        if found is None or not found[1]:
            raise AuthError(f"no saved weights {path!r} for this tenant (save_weights_for_sampler makes them)")
        self.used(key, version)
        return key, version, self.stored(found[1], version), job is not None and job.kind == JobKind.FULL_RL

    def info(self, tenant: str, path: str) -> tuple[JobRow, bool]:
        """The job that saved the weights at ``path`` (a checkpoint or a model path) and whether
        they are published; AuthError, as for a path that names nothing, when they are another
        tenant's and not published."""
        checkpoint = CheckpointPath.parse(path)
        if checkpoint is not None:
            job = self.store.job(checkpoint.job_id)
            public = self.store.checkpoint_public(checkpoint.job_id, checkpoint.name)
            if job is None or (job.tenant != tenant and not public):
                raise AuthError(f"no checkpoint {path!r} for this tenant")
            if self.store.checkpoint(checkpoint.job_id, checkpoint.name) is None:
                raise ConfigError(f"job {checkpoint.job_id} has no checkpoint {checkpoint.name!r}")
            return job, public
        self.resolve(tenant, path)  # the version exists and this tenant may read it
        parsed = ModelPath.parse(path)
        job = self.store.job(parsed.job_id)
        assert job is not None
        return job, self.store.version_public(parsed.job_id, parsed.version, SAMPLER_NAME_PREFIX)

    def publish(self, row: JobRow, name: str, public: bool) -> bool:
        """Let every tenant read the job's checkpoint ``name``, or only its owner; whether it was
        public before."""
        was = self.store.checkpoint_public(row.job_id, name)
        if not self.store.set_checkpoint_public(row.job_id, name, public):
            raise ConfigError(f"job {row.job_id} has no checkpoint {name!r} (polytinker checkpoints list names them)")
        return was

    def copy_into(self, tenant: str, path: str, copy: JobRow, expires_s: float | None) -> str:
        """Copy the weights at ``path`` (a checkpoint or a version the tenant may read: the caller
        checked with ``info``) into the job ``copy`` as a named checkpoint of the same kind, and
        answer the copy's path. Files are hard-linked where the filesystem allows (no bytes
        duplicated; deleting the source leaves the copy whole), copied otherwise."""
        key = adapter_key(copy.tenant, copy.job_id, copy.agent)
        self.store.ensure_adapter(key, copy.tenant, copy.job_id, copy.agent)
        checkpoint = CheckpointPath.parse(path)
        if checkpoint is not None:
            found = self.store.checkpoint(checkpoint.job_id, checkpoint.name)
            assert found is not None  # info found it
            stored_path, version = found
            target = WeightsRef(key, version, "checkpoint", checkpoint.name)
            _link_tree(under(self.root, self.stored(stored_path, version).relative_path), self._fresh(target))
            self.store.add_checkpoint(copy.job_id, checkpoint.name, target.relative_path, version, expires_s)
            return str(CheckpointPath(copy.job_id, checkpoint.name))
        _, version, export, full = self.resolve(tenant, path)
        assert export is not None
        # A full-parameter version's export is its checkpoint: the copy's is too.
        target = WeightsRef(key, version, "checkpoint" if full else "export")
        _link_tree(under(self.root, export.relative_path), self._fresh(target))
        self.store.record_version(key, version, target.relative_path if full else "", target.relative_path)
        source = ModelPath.parse(path).job_id
        names = [c["name"] for c in self.store.checkpoints(source) if c["version"] == version]
        name = next((n for n in names if n.startswith(SAMPLER_NAME_PREFIX)), f"{SAMPLER_NAME_PREFIX}copy")
        self.store.add_checkpoint(copy.job_id, name, target.relative_path, version, expires_s)
        return str(ModelPath(copy.job_id, copy.agent, version))

    def size_of(self, path: str, version: int) -> int:
        """Bytes of the stored weights at ``path`` (a checkpoint or export this scheduler stored)
        on its disk; 0 where they are not (a remote learner's)."""
        try:
            where = under(self.root, self.stored(path, version).relative_path)
        except ConfigError:
            return 0
        return sum(f.stat().st_size for f in where.iterdir() if f.is_file()) if where.is_dir() else 0

    def _fresh(self, ref: WeightsRef) -> Path:
        where = under(self.root, ref.relative_path)
        if where.exists():
            raise ConfigError(f"{ref.relative_path} exists already")
        return where

    def stored_files(self, tenant: str, path: str) -> tuple[int, str, Any, bool, str]:
        """Saved weights the tenant may read, from the state root: (version, ``adapter_config.json``
        as text, the weights file as one uint8 array, full?, a learner checkpoint's ``meta.json``).
        A LoRA version's are its peft export's; a full-parameter version's and a ``save_state``
        checkpoint's (``polytinker-ckpt://JOB/NAME``), the learner checkpoint's weights and meta."""
        import numpy as np

        checkpoint = CheckpointPath.parse(path)
        if checkpoint is not None:
            job, _ = self.info(tenant, path)  # the tenant's own, or published
            found = self.store.checkpoint(job.job_id, checkpoint.name)
            assert found is not None  # info checked it
            stored_path, version = found
            where = under(self.root, self.stored(stored_path, version).relative_path)
            full, from_checkpoint = job.kind == JobKind.FULL_RL, True
        else:
            _, version, export, full = self.resolve(tenant, path)
            assert export is not None
            where, from_checkpoint = under(self.root, export.relative_path), full
        text = where / (_CHECKPOINT_META if from_checkpoint else "adapter_config.json")
        weights = where / (_CHECKPOINT_WEIGHTS if from_checkpoint else "adapter_model.safetensors")
        if not (text.is_file() and weights.is_file()):
            raise ConfigError(f"the files of {path} are not on the scheduler's machine (a remote learner has them)")
        data = np.fromfile(weights, dtype=np.uint8)
        if from_checkpoint:
            return version, "", data, full, text.read_text()
        return version, text.read_text(), data, False, ""


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of the directory ``src`` whose files are hard links (copies across
    filesystems), filled beside it and renamed into place, so a failed copy leaves nothing."""
    if not src.is_dir():
        raise ConfigError("the weights to copy are not on the scheduler's machine (a remote learner has them)")

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    tmp = dst.parent / f".{dst.name}.copy-{os.getpid()}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, tmp, copy_function=link)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# A learner checkpoint's files (polytinker.engine.learner.state, not imported here: it loads torch).
_CHECKPOINT_WEIGHTS = "weights.safetensors"
_CHECKPOINT_META = "meta.json"


__all__ = ["WeightsCatalog", "expiry"]
