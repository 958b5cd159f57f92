"""What the Tinker SDK's ``RestClient`` reads back (training runs, their checkpoints, sessions)
and does to checkpoints (delete, TTL, publish, copy, external download URLs).

A training run is a polytinker job (its id is the ``RUN`` of ``tinker://RUN/...`` paths; the SDK's
model id names it too). The scheduler is the authority on which checkpoints a job has (its job
query lists them by name); the gateway adds what the SDK shows and the scheduler does not keep:
when each was saved through it, a named sampler save's path, and the user metadata the SDK sent.
Answers follow the SDK's types (``TrainingRun``, ``Checkpoint``, ``CheckpointsListResponse``,
``TrainingRunsResponse``, ``GetSessionResponse``, ``ListSessionsResponse``); times are ISO 8601.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from polytinker.errors import NotBuiltError
from polytinker.gateway.downloads import SignedDownloads, age_encrypt
from polytinker.gateway.errors import HttpError
from polytinker.gateway.store import ModelRow, SavedRow
from polytinker.gateway.tinker_backend import Tenant, TinkerBackend
from polytinker.gateway.tinker_names import (
    EXTERNAL_NAME_PREFIX,
    TINKER_PREFIX,
    external_path,
    run_request_key,
    to_tinker_path,
)
from polytinker.gateway.wire import iso_time, ttl_of
from polytinker.model_path import SAMPLER_NAME_PREFIX, CheckpointPath, ModelPath

log = logging.getLogger("polytinker.http")


class TinkerRuns:
    """The read side of the Tinker API over one gateway's backend."""

    def __init__(self, backend: TinkerBackend, downloads: SignedDownloads) -> None:
        self.backend = backend
        self.downloads = downloads  # the signed download URLs this gateway serves
        self._told: dict[str, str] = {}  # the last queue state logged per waiting run

    def _run_row(self, t: Tenant, run_id: str) -> ModelRow:
        """The tenant's run ``run_id`` (a job id or a model id); 404 for any other."""
        row = self.backend.store.model(t.owner, run_id)
        if row is None:
            raise HttpError(404, f"unknown training run {run_id!r}", "not_found")
        return row

    def _job(self, t: Tenant, row: ModelRow) -> dict[str, Any]:
        return t.service.get_job(row.job_id)

    def checkpoints(self, t: Tenant, run_id: str) -> list[dict[str, Any]]:
        """The run's checkpoints, oldest first: each training checkpoint the scheduler names, and
        each named sampler save; a sampler save of a version already listed appears once."""
        row = self._run_row(t, run_id)
        job = self._job(t, row)
        return self._checkpoints(row, job)

    def _checkpoints(self, row: ModelRow, job: dict[str, Any]) -> list[dict[str, Any]]:
        names = [str(n) for n in job.get("checkpoints", [])]
        expiry = job.get("checkpoint_expiry") or {}
        public = set(job.get("public_checkpoints") or ())
        sizes = job.get("checkpoint_bytes") or {}
        saved = {(s.kind, s.name): s for s in self.backend.store.saved(row.job_id)}
        created = float(job.get("job", {}).get("created_s") or self.backend.store.model_created(row.model_id))
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            sampler_name = name.removeprefix(SAMPLER_NAME_PREFIX)
            if name.startswith(_external_name("")):
                external = sampler_name.removeprefix(EXTERNAL_NAME_PREFIX)
                s = saved.get(("external", external))
                if s is None:
                    continue
                kind, path, when = "external", external_path(row.job_id, external), s.created
            elif name.startswith(SAMPLER_NAME_PREFIX):
                s = saved.get(("sampler", sampler_name))
                if s is None:  # saved by polytinker's own client: no tinker:// path names it
                    continue
                kind, path, when = "sampler", s.tinker_path, s.created
            else:
                s = saved.get(("training", name))
                kind, path = "training", f"{TINKER_PREFIX}{row.job_id}/weights/{name}"
                when = s.created if s is not None else created
            out.pop(path, None)  # the latest save of a path stands for it
            out[path] = {
                "checkpoint_id": path.removeprefix(f"{TINKER_PREFIX}{row.job_id}/"),
                "checkpoint_type": kind,
                "time": when,
                "tinker_path": path,
                "size_bytes": sizes.get(name),
                "public": name in public,
                "expires_at": iso_time(float(expiry[name])) if name in expiry else None,
            }
        listed = sorted(out.values(), key=lambda c: c["time"])
        return [{**c, "time": iso_time(c["time"])} for c in listed]

    def training_run(self, t: Tenant, run_id: str) -> dict[str, Any]:
        row = self._run_row(t, run_id)
        job = self._job(t, row)
        listed = self._checkpoints(row, job)
        last = {
            kind: next((c for c in reversed(listed) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")
        }
        metadata, _ = self.backend.store.metadata(row.model_id)
        updated = float(job.get("job", {}).get("updated_s") or self.backend.store.model_created(row.model_id))
        return {
            "training_run_id": row.job_id,
            "base_model": row.base_model,
            "model_owner": t.owner[:16],
            "is_lora": row.lora_rank > 0,
            "corrupted": False,
            "lora_rank": row.lora_rank or None,
            "last_request_time": iso_time(updated),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
            "user_metadata": metadata,
        }

    def training_runs(self, t: Tenant, limit: int, offset: int) -> dict[str, Any]:
        rows = self.backend.store.models(t.owner)
        page = rows[offset : offset + limit] if limit > 0 else []
        return {
            "training_runs": [self.training_run(t, r.job_id) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
        }

    def user_checkpoints(self, t: Tenant, limit: int, offset: int) -> dict[str, Any]:
        every = [c for r in self.backend.store.models(t.owner) for c in self.checkpoints(t, r.job_id)]
        every.sort(key=lambda c: c["time"], reverse=True)  # newest first, as Tinker lists them
        page = every[offset : offset + limit] if limit > 0 else []
        return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(every)}}

    def queue_state(self, t: Tenant, model_id: str) -> dict[str, str]:
        """The ``try_again`` fields of a call of run ``model_id`` not done yet: while its job waits
        to run (queued for capacity, being preempted, or paused), ``paused_capacity`` and the job's
        reason (``polytinker jobs`` shows the same: where it is in the queue and what it waits
        for); {} otherwise (the call runs), or when the scheduler cannot say now."""
        row = self.backend.store.model(t.owner, model_id)
        if row is None:
            return {}
        try:
            job = t.service.get_job(row.job_id).get("job") or {}
        except Exception:  # the poll answers "active" rather than fail over a status query
            return {}
        return queue_fields(model_id, job, self._told)

    def session(self, t: Tenant, session_id: str) -> dict[str, Any]:
        if self.backend.store.session_owner(session_id) != t.owner:
            raise HttpError(404, f"unknown session {session_id!r}", "not_found")
        runs = [r.job_id for r in self.backend.store.models(t.owner) if r.model_id.startswith(f"{session_id}:")]
        metadata, display_name = self.backend.store.metadata(session_id)
        return {
            "training_run_ids": runs,
            "sampler_ids": self.backend.store.session_samplers(session_id),
            "user_metadata": metadata,
            "display_name": display_name,
        }

    def sessions(self, t: Tenant, limit: int, offset: int) -> dict[str, Any]:
        every = self.backend.store.sessions(t.owner)
        return {"sessions": every[offset : offset + limit] if limit > 0 else []}

    def _named(
        self, t: Tenant, run_id: str, checkpoint_id: str
    ) -> tuple[ModelRow, list[tuple[str, str, str]], dict[str, Any]]:
        """The run, what ``checkpoint_id`` names there: (the scheduler's name, the gateway's kind
        and name) of each save it stands for (404 when none), and the run's job query. ``weights/NAME`` is a save_state
        name, ``sampler_weights/AGENT@V`` every named sampler save of that version, and
        ``external_weights/NAME`` a save_weights_external."""
        row = self._run_row(t, run_id)
        kind, _, name = checkpoint_id.partition("/")
        path = f"{TINKER_PREFIX}{row.job_id}/{checkpoint_id}"
        named: list[tuple[str, str, str]] = []
        if kind == "weights":
            named = [(name, "training", name)]
        elif kind == "sampler_weights":
            saved = [s for s in self.backend.store.saved(row.job_id) if s.kind == "sampler" and s.tinker_path == path]
            named = [(SAMPLER_NAME_PREFIX + s.name, s.kind, s.name) for s in saved]
        elif kind == "external_weights":
            named = [(_external_name(name), "external", name)]
        job = self._job(t, row)
        listed = set(job.get("checkpoints", []))
        named = [n for n in named if name and n[0] in listed]
        if not named:
            raise HttpError(404, f"run {row.job_id} has no checkpoint {checkpoint_id!r}", "not_found")
        return row, named, job

    def delete_checkpoint(self, t: Tenant, run_id: str, checkpoint_id: str) -> None:
        """Delete what ``checkpoint_id`` names (``_named``): the scheduler forgets the name and
        deletes the files (docs/client.md says when files outlive their name)."""
        row, named, _ = self._named(t, run_id, checkpoint_id)
        for scheduler_name, saved_kind, saved_name in named:
            t.service.delete_checkpoint(row.job_id, scheduler_name)
            self.backend.store.delete_saved(row.job_id, saved_kind, saved_name)

    def set_ttl(self, t: Tenant, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """Delete what ``checkpoint_id`` names ``ttl_seconds`` from now, or never (None)."""
        row, named, _ = self._named(t, run_id, checkpoint_id)
        for scheduler_name, _, _ in named:
            t.service.set_checkpoint_ttl(row.job_id, scheduler_name, ttl_seconds)

    def publish(self, t: Tenant, run_id: str, checkpoint_id: str, public: bool) -> None:
        """Let every tenant read what ``checkpoint_id`` names (its ``tinker://`` path then samples,
        loads and starts training runs for them), or only the owner again. Asking for the state it
        is in already succeeds: Tinker answers 409 there, which its SDK retries for five minutes."""
        row, named, _ = self._named(t, run_id, checkpoint_id)
        for scheduler_name, _, _ in named:
            (t.service.publish_checkpoint if public else t.service.unpublish_checkpoint)(row.job_id, scheduler_name)

    def copy_weights(self, t: Tenant, req: dict[str, Any], access_token: str | None) -> dict[str, Any]:
        """``copy_weights``: the weights at ``source_path`` (the tenant's own, or published) copied
        into a new run of the tenant's that cannot be trained on; the copy's ``tinker://`` path.
        polytinker has no projects: ``destination_project_id`` is kept in the run's metadata."""
        if access_token:
            raise NotBuiltError("weights access tokens are not built: the owner publishes the checkpoint instead")
        source = str(req.get("source_path") or "")
        path = self.backend.polytinker_path(source)
        session_id = req.get("session_id")
        if session_id:
            self.backend.check_session(t, str(session_id))
        info = self.backend.source(t, path)
        key = run_request_key(str(session_id), req.get("model_seq_id")) if session_id else ""  # a resend: one copy
        copied = t.service.copy_weights(path, ttl_seconds=ttl_of(req), request_key=key).result()
        checkpoint = CheckpointPath.parse(copied)
        job_id = checkpoint.job_id if checkpoint is not None else ModelPath.parse(copied).job_id
        model_id = f"{session_id}:train:{int(req.get('model_seq_id') or 0)}" if session_id else job_id
        rank = int((info.lora or {}).get("rank", 0))
        self.backend.store.add_model(ModelRow(model_id, t.owner, job_id, info.base_model, rank))
        metadata = {"copied_from": source}
        if req.get("destination_project_id"):
            metadata["project_id"] = str(req["destination_project_id"])
        self.backend.store.set_metadata(model_id, metadata)
        tinker_path = to_tinker_path(copied)
        saved_kind, name = ("training", checkpoint.name) if checkpoint is not None else ("sampler", "copy")
        if checkpoint is None:  # a sampler save: named as the source's was (the scheduler's sampler-NAME)
            listed = t.service.get_job(job_id).get("checkpoints") or []
            name = next((n.removeprefix(SAMPLER_NAME_PREFIX) for n in listed), name)
        self.backend.store.add_saved(SavedRow(job_id, saved_kind, name, tinker_path, time.time()))
        return {"tinker_path": tinker_path}

    def external_urls(self, t: Tenant, run_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """Signed URLs of an ``external_weights/NAME`` checkpoint's files (the peft adapter
        directory), valid for ``downloads.ttl_s``, as ``ExternalWeightsUrlsResponse``."""
        if not checkpoint_id.startswith("external_weights/"):
            raise HttpError(404, f"{checkpoint_id!r} is not an external weights checkpoint", "not_found")
        row, _, _ = self._named(t, run_id, checkpoint_id)  # 404 unless the run has it
        name = checkpoint_id.partition("/")[2]
        found = next((s for s in self.backend.store.saved(row.job_id) if (s.kind, s.name) == ("external", name)), None)
        if found is None:
            raise HttpError(404, f"run {row.job_id} has no external weights {checkpoint_id!r}", "not_found")
        files = age_encrypt(t.service.export_files(found.tinker_path), self.backend.store.recipients(row.job_id, name))
        token, expires = self.downloads.put(t.owner, files)
        root = f"{base_url.rstrip('/')}/api/v1/downloads/{token}"
        return {"urls": {f: f"{root}/{f}" for f in files}, "expires": iso_time(expires)}


WAITING_STATES = ("queued", "preempting", "paused")  # a call of a job in these waits for it to run


def queue_fields(model_id: str, job: dict[str, Any], told: dict[str, str]) -> dict[str, str]:
    """The ``try_again`` fields for a call of run ``model_id`` whose job is ``job`` (its public
    row): ``paused_capacity`` with a reason while the job waits to run, {} while it runs. A change
    of what the run waits for is logged once (``told``: the last one logged per run)."""
    state = str(job.get("state") or "")
    if state not in WAITING_STATES:
        told.pop(model_id, None)
        return {}
    why = str(job.get("reason") or "waiting to run")
    reason = f"training run {job.get('job_id', model_id)} is {why if why.startswith(state) else f'{state}: {why}'}"
    if told.get(model_id) != reason:
        if len(told) > 10_000:  # runs that ended while waiting are never popped: bounded here
            told.clear()
        told[model_id] = reason
        log.info("calls of %s wait: %s", model_id, reason)
    return {"queue_state": "paused_capacity", "queue_state_reason": reason}


def _external_name(name: str) -> str:
    """The scheduler's name of ``save_weights_external(name)``: a named sampler save."""
    return SAMPLER_NAME_PREFIX + EXTERNAL_NAME_PREFIX + name


__all__ = ["WAITING_STATES", "TinkerRuns", "queue_fields"]
