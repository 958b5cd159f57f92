"""The Tinker API's names for what polytinker keeps: ``tinker://`` paths of checkpoints and sampler
versions (polytinker's ``polytinker-ckpt://`` and ``polytinker://`` paths, tinker_backend.py's
table), and the handle of a tenant in the gateway's tables."""

from __future__ import annotations

import hashlib

from polytinker.errors import ConfigError
from polytinker.model_path import MODEL_PREFIX, TINKER_PREFIX, CheckpointPath, ModelPath

EXTERNAL_NAME_PREFIX = "external."  # a save_weights_external(NAME) is the job's sampler save external.NAME


def owner_of(api_key: str) -> str:
    """The tenant's handle in the gateway's tables: a hash of its key (the key itself is not kept)."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def to_tinker_path(path: str) -> str:
    """The ``tinker://`` path of a polytinker checkpoint or sampler path."""
    checkpoint = CheckpointPath.parse(path)
    if checkpoint is not None:
        return checkpoint.tinker
    if path.startswith(MODEL_PREFIX):
        return ModelPath.parse(path).tinker
    raise ConfigError(f"{path!r} is not a polytinker path")


def from_tinker_path(path: str, kind: str) -> str:
    """The polytinker path of a ``tinker://JOB/weights/NAME`` (``kind="weights"``) or
    ``tinker://JOB/sampler_weights/AGENT@V`` (``kind="sampler_weights"``) path; ConfigError else."""
    return str(CheckpointPath.from_tinker(path) if kind == "weights" else ModelPath.from_tinker(path))


def external_path(job_id: str, name: str) -> str:
    """The ``tinker://`` path of the job's ``save_weights_external(name)``."""
    return f"{TINKER_PREFIX}{job_id}/external_weights/{name}"


__all__ = ["EXTERNAL_NAME_PREFIX", "TINKER_PREFIX", "external_path", "from_tinker_path", "owner_of", "to_tinker_path"]
