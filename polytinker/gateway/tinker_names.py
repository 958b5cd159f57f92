"""The Tinker API's names for what polytinker keeps: ``tinker://`` paths of checkpoints and sampler
versions (polytinker's ``polytinker-ckpt://`` and ``polytinker://`` paths, tinker_backend.py's
table; a named sampler save is ``tinker://JOB/sampler_weights/NAME``, which the gateway's store maps
to its version), and the handle of a tenant in the gateway's tables."""

from __future__ import annotations

import hashlib
import uuid

from polytinker.engine.worker.layout import check_name
from polytinker.errors import ConfigError
from polytinker.model_path import MODEL_PREFIX, SAMPLER_NAME_PREFIX, TINKER_PREFIX, CheckpointPath, ModelPath

SAMPLER_WEIGHTS = "sampler_weights"  # the middle part of a sampler path
EXTERNAL_NAME_PREFIX = "external."  # a save_weights_external(NAME) is the job's sampler save external.NAME


def owner_of(api_key: str) -> str:
    """The tenant's handle in the gateway's tables: a hash of its key (the key itself is not kept)."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def run_request_key(session_id: str, model_seq_id: object) -> str:
    """The scheduler's ``request_key`` of a new run (``create_model``, or ``load_state`` with no
    model): the SDK numbers a session's runs (``model_seq_id``, from 0), so each resend of one call
    carries the same key and gets the job its first copy made; with no number, one per request."""
    if isinstance(model_seq_id, int) and not isinstance(model_seq_id, bool) and model_seq_id >= 0:
        return hashlib.blake2b(f"{session_id}:train:{model_seq_id}".encode(), digest_size=16).hexdigest()
    return uuid.uuid4().hex


def to_tinker_path(path: str) -> str:
    """The ``tinker://`` path of a polytinker checkpoint or sampler path. A job's named sampler save
    (its checkpoint ``sampler-NAME``) is ``.../sampler_weights/NAME``, and an external one
    (``sampler-external.NAME``) ``.../external_weights/NAME``, as the SDK was answered when it saved."""
    checkpoint = CheckpointPath.parse(path)
    if checkpoint is not None:
        name = checkpoint.name.removeprefix(SAMPLER_NAME_PREFIX)
        if name == checkpoint.name:
            return checkpoint.tinker
        if name.startswith(EXTERNAL_NAME_PREFIX):
            return external_path(checkpoint.job_id, name.removeprefix(EXTERNAL_NAME_PREFIX))
        return named_sampler_path(checkpoint.job_id, name)
    if path.startswith(MODEL_PREFIX):
        return ModelPath.parse(path).tinker
    raise ConfigError(f"{path!r} is not a polytinker path")


def from_tinker_path(path: str, kind: str) -> str:
    """The polytinker path of a ``tinker://JOB/weights/NAME`` (``kind="weights"``) or
    ``tinker://JOB/sampler_weights/AGENT@V`` (``kind="sampler_weights"``) path; ConfigError else."""
    return str(CheckpointPath.from_tinker(path) if kind == "weights" else ModelPath.from_tinker(path))


def named_sampler_path(job_id: str, name: str) -> str:
    """Tinker's path of the job's ``save_weights_for_sampler(name)``: ``tinker://JOB/sampler_weights/NAME``."""
    return f"{TINKER_PREFIX}{job_id}/{SAMPLER_WEIGHTS}/{name}"


def named_sampler(path: str) -> tuple[str, str] | None:
    """(job, name) of a named sampler save's ``tinker://JOB/sampler_weights/NAME``; None for any
    other path (a version's ``.../sampler_weights/AGENT@V`` among them: names have no ``@``)."""
    parts = path.removeprefix(TINKER_PREFIX).split("/") if path.startswith(TINKER_PREFIX) else []
    if len(parts) != 3 or parts[1] != SAMPLER_WEIGHTS or not parts[0] or "@" in parts[2]:
        return None
    return parts[0], check_name("sampler name", parts[2])


def external_path(job_id: str, name: str) -> str:
    """The ``tinker://`` path of the job's ``save_weights_external(name)``."""
    return f"{TINKER_PREFIX}{job_id}/external_weights/{name}"


__all__ = [
    "EXTERNAL_NAME_PREFIX",
    "TINKER_PREFIX",
    "external_path",
    "from_tinker_path",
    "named_sampler",
    "named_sampler_path",
    "owner_of",
    "run_request_key",
    "to_tinker_path",
]
