"""Model paths: the names of saved weights, parsed here and nowhere else.

- ``ModelPath``: one saved version of an agent's weights, ``polytinker://JOB/AGENT@VERSION``
  (what ``save_weights_for_sampler`` answers and ``create_sampling_client`` takes). Its Tinker
  spelling is ``tinker://JOB/sampler_weights/AGENT@VERSION`` (``tinker`` / ``from_tinker``).
- ``CheckpointPath``: a checkpoint ``save_state`` wrote, ``polytinker-ckpt://JOB/NAME``; its Tinker
  spelling is ``tinker://JOB/weights/NAME``.
- ``MODEL_PREFIX`` (``polytinker://``), ``CKPT_PREFIX`` (``polytinker-ckpt://``) and
  ``TINKER_PREFIX`` (``tinker://``).
- ``SAMPLER_NAME_PREFIX``: a job lists its named ``save_weights_for_sampler(name)`` saves among
  its checkpoints as ``sampler-NAME``.

Paths travel as strings (in messages, in ``state.json``, over HTTP); each layer turns one into a
``ModelPath`` with ``ModelPath.parse`` where it needs its parts, and back with ``str()``. This
module imports nothing of polytinker but its errors, so that every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytinker.errors import ConfigError

MODEL_PREFIX = "polytinker://"
CKPT_PREFIX = "polytinker-ckpt://"
TINKER_PREFIX = "tinker://"
SAMPLER_NAME_PREFIX = "sampler-"
_TINKER_SAMPLER = "sampler_weights"
_TINKER_CHECKPOINT = "weights"


@dataclass(frozen=True)
class ModelPath:
    """``polytinker://JOB/AGENT@VERSION``: version ``version`` of agent ``agent``'s weights in job ``job_id``."""

    job_id: str
    agent: str
    version: int

    @classmethod
    def parse(cls, path: str) -> ModelPath:
        """The parts of ``polytinker://JOB/AGENT@VERSION`` (the prefix may be left out); a
        ``ConfigError`` when ``path`` has no job, agent and integer version."""
        body = path.removeprefix(MODEL_PREFIX)
        try:
            where, version = body.rsplit("@", 1)
            job_id, agent = where.split("/", 1)
            return cls(job_id, agent, int(version))
        except ValueError:
            raise ConfigError(f"model_path {path!r} is not {MODEL_PREFIX}JOB/AGENT@VERSION") from None

    @classmethod
    def from_tinker(cls, path: str) -> ModelPath:
        """The model path of Tinker's ``tinker://JOB/sampler_weights/AGENT@VERSION``; a
        ``ConfigError`` for any other path."""
        parts = path.removeprefix(TINKER_PREFIX).split("/") if path.startswith(TINKER_PREFIX) else []
        if len(parts) != 3 or parts[1] != _TINKER_SAMPLER or not parts[0] or not parts[2]:
            raise ConfigError(f"{path!r} is not a path of the form {TINKER_PREFIX}RUN/{_TINKER_SAMPLER}/AGENT@VERSION")
        return cls.parse(f"{MODEL_PREFIX}{parts[0]}/{parts[2]}")

    @property
    def tinker(self) -> str:
        """Tinker's spelling: ``tinker://JOB/sampler_weights/AGENT@VERSION``."""
        return f"{TINKER_PREFIX}{self.job_id}/{_TINKER_SAMPLER}/{self.agent}@{self.version}"

    def __str__(self) -> str:
        return f"{MODEL_PREFIX}{self.job_id}/{self.agent}@{self.version}"


@dataclass(frozen=True)
class CheckpointPath:
    """``polytinker-ckpt://JOB/NAME``: the checkpoint ``save_state`` saved as ``name`` in job ``job_id``."""

    job_id: str
    name: str

    @classmethod
    def parse(cls, path: str) -> CheckpointPath | None:
        """The parts of ``polytinker-ckpt://JOB/NAME``; None when ``path`` has not that prefix
        (the parts are checked where they are used: a job id against the tenant's jobs, a name
        with ``layout.check_name``)."""
        if not path.startswith(CKPT_PREFIX):
            return None
        job_id, _, name = path.removeprefix(CKPT_PREFIX).partition("/")
        return cls(job_id, name)

    @classmethod
    def from_tinker(cls, path: str) -> CheckpointPath:
        """The checkpoint path of Tinker's ``tinker://JOB/weights/NAME``; a ``ConfigError`` for
        any other path."""
        parts = path.removeprefix(TINKER_PREFIX).split("/") if path.startswith(TINKER_PREFIX) else []
        if len(parts) != 3 or parts[1] != _TINKER_CHECKPOINT or not parts[0] or not parts[2]:
            raise ConfigError(f"{path!r} is not a path of the form {TINKER_PREFIX}RUN/{_TINKER_CHECKPOINT}/NAME")
        return cls(parts[0], parts[2])

    @property
    def tinker(self) -> str:
        """Tinker's spelling: ``tinker://JOB/weights/NAME``."""
        return f"{TINKER_PREFIX}{self.job_id}/{_TINKER_CHECKPOINT}/{self.name}"

    def __str__(self) -> str:
        return f"{CKPT_PREFIX}{self.job_id}/{self.name}"


def from_tinker(path: str) -> str:
    """The polytinker path of a Tinker checkpoint (``tinker://JOB/weights/NAME``) or sampler
    (``tinker://JOB/sampler_weights/AGENT@VERSION``) path; a ``ConfigError`` for any other."""
    parts = path.removeprefix(TINKER_PREFIX).split("/") if path.startswith(TINKER_PREFIX) else []
    if len(parts) == 3 and parts[1] == _TINKER_CHECKPOINT:
        return str(CheckpointPath.from_tinker(path))
    return str(ModelPath.from_tinker(path))


__all__ = ["CKPT_PREFIX", "MODEL_PREFIX", "TINKER_PREFIX", "CheckpointPath", "ModelPath", "from_tinker"]
