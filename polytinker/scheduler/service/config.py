"""Configuration of the scheduler service and the runtime it launches: one frozen dataclass each.

- ``EngineWorkerConfig``: one inference engine (id, backend, adapter slots, batching).
- ``LearnerWorkerConfig``: one learner group (id, data-parallel size, micro-batch).
- ``TenantConfig``: a tenant and its API key (or the file holding it).
- ``JobDefaults``: what the policy is told a job of each kind needs, when the client says nothing.
- ``HttpConfig`` (``http_config.py``, re-exported here): the HTTP gateway, ``[http]``.
- ``ClusterConfig`` (``cluster.py``, re-exported here): what places the workers, ``[cluster]``.
- ``RuntimeConfig``: the whole runtime: address, state directory, model, workers, tenants, limits.

``RuntimeConfig.from_toml(path)`` reads a ``runtime.toml`` (see docs/scheduler-service.md);
``to_dict``/``from_dict`` carry a config across a process boundary as plain data.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytinker.engine.types import UNEMBED_MODULE
from polytinker.engine.worker.config import (
    BackendName,
    EngineWorkerConfig,
    LearnerWorkerConfig,
    check_id,
)
from polytinker.engine.worker.server import WorkerPlan
from polytinker.errors import ConfigError
from polytinker.scheduler.service.cluster import ClusterConfig
from polytinker.scheduler.service.http_config import HttpConfig, host_port, read_toml
from polytinker.tables import from_table


@dataclass(frozen=True)
class TenantConfig:
    name: str
    # The tenant's name; jobs and adapters are owned by it.
    api_key: str = ""
    # Its API key (at least 16 characters); or set api_key_file or curve_public_key instead.
    api_key_file: str = ""
    # A file whose first line is the API key (keeps keys out of the TOML file).
    curve_public_key: str = ""
    # A client Curve key (Z85, 40 characters): requests admitted with it and no API key are this
    # tenant's (the key must also be in curve_clients_dir to be admitted at all).
    weight: float = 1.0
    # Fair-share weight: 2 gets twice the resource-time of 1.

    def __post_init__(self) -> None:
        check_id("TenantConfig.name", self.name)
        if sum(map(bool, (self.api_key, self.api_key_file, self.curve_public_key))) != 1:
            raise ConfigError(f"tenant {self.name!r}: set exactly one of api_key, api_key_file and curve_public_key")
        if self.api_key and len(self.api_key) < 16:
            raise ConfigError(f"tenant {self.name!r}: api_key must have at least 16 characters")
        if self.curve_public_key and len(self.curve_public_key) != 40:
            raise ConfigError(f"tenant {self.name!r}: curve_public_key must be a 40-character Z85 key (a .key file's)")
        if not self.weight > 0:
            raise ConfigError(f"tenant {self.name!r}: weight must be > 0")

    def credential(self) -> str:
        """What identifies the tenant: its API key, or ``curve:<key>`` for a Curve-key tenant."""
        return f"curve:{self.curve_public_key}" if self.curve_public_key else self.key()

    def key(self) -> str:
        if self.curve_public_key:
            raise ConfigError(f"tenant {self.name!r} authenticates by Curve key; it has no API key")
        if self.api_key:
            return self.api_key
        try:
            key = Path(self.api_key_file).expanduser().read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ConfigError(f"tenant {self.name!r}: cannot read an API key from {self.api_key_file}: {exc}") from exc
        if len(key) < 16:
            raise ConfigError(f"tenant {self.name!r}: the key in {self.api_key_file} is shorter than 16 characters")
        return key


@dataclass(frozen=True)
class JobDefaults:
    learner_mem_gb: float = 1.0
    # Learner memory a LoRA job declares (adapter + optimizer state + activations).
    full_learner_mem_gb: float = 4.0
    # Learner memory a full-parameter job declares (it gets a learner group to itself anyway).
    engine_mem_gb: float = 0.5
    # Engine memory (KV-cache share) a job that samples declares.
    step_s: float = 1.0
    # Learner seconds per step a job declares (orders jobs by size in the policy).
    sample_s: float = 1.0
    # Engine seconds per step a job declares.
    steps: int = 1000
    # Steps a job declares when its client does not say.

    def __post_init__(self) -> None:
        values = (self.learner_mem_gb, self.full_learner_mem_gb, self.engine_mem_gb, self.step_s, self.sample_s)
        if min(values) <= 0 or self.steps < 1:
            raise ConfigError("JobDefaults: memory and seconds must be > 0 and steps >= 1")


@dataclass(frozen=True)
class RuntimeConfig:
    """One runtime: a scheduler plus the engines and learner groups it starts or admits."""

    model: str = "smollm2-135m-instruct"
    # Base model of every engine and learner (a preset, local directory or hub id).
    address: str = "tcp://127.0.0.1:0"
    # Where the scheduler listens; port 0 picks a free port (fixed at start, kept across restarts).
    state_dir: str = ""
    # SQLite job table, checkpoints and exported adapters; empty: a fresh temporary directory.
    engines: tuple[EngineWorkerConfig, ...] = (EngineWorkerConfig(),)
    # The inference engines.
    learners: tuple[LearnerWorkerConfig, ...] = (LearnerWorkerConfig(),)
    # The learner groups.
    tenants: tuple[TenantConfig, ...] = ()
    # Tenants and their API keys; empty: one tenant "local" with a generated key.
    jobs: JobDefaults = field(default_factory=JobDefaults)
    # What jobs declare to the policy by default.
    http: HttpConfig = field(default_factory=HttpConfig)
    # The HTTP front door ([http] address = "127.0.0.1:8000"); off by default.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # What places the engines and learners the runtime starts ([cluster] backend = "ray"): docs/cluster.md.
    worker_token: str = ""
    # Shared secret workers present when they register; empty: generated at start (local workers get it).
    curve_secret_file: str = ""
    # The scheduler's Curve `.key_secret`; with it the scheduler may bind a public address.
    curve_clients_dir: str = ""
    # Directory of `.key` files of the clients and workers admitted (needed with curve_secret_file).
    max_inflight_samples: int = 192
    # Sample requests in flight at once (each holds a handler thread while the engine works);
    # more are answered "overloaded, retry after N s".
    max_inflight_train: int = 32
    # Training calls (forward_backward, optim_step, ...) in flight at once; likewise bounded.
    max_inflight_per_tenant: int = 128
    # In-flight requests of one tenant, so one tenant cannot take every slot.
    handler_threads: int = 256
    # Threads serving requests; more than the two bounds above together, so refusals, job
    # queries and worker registrations are always answered at once.
    max_queued_jobs: int = 10_000
    # Jobs waiting for resources at once; a submission beyond it is answered "overloaded, retry after N s".
    max_queued_per_tenant: int = 1_000
    # Waiting jobs of one tenant at once (the same answer beyond it).
    retry_after_s: float = 1.0
    # The wait an overloaded answer suggests.
    worker_heartbeat_s: float = 2.0
    # Workers re-register this often (a restarted scheduler learns of them within one interval).
    worker_silence_s: float = 60.0
    # A worker whose connection stays open but that answers nothing (no heartbeat, no
    # re-registration) for this long counts as gone: its machine vanished. A worker whose process
    # exits is seen at once (its connection closes; a local runtime's supervisor reports it), so
    # this only has to outlast a slow one: on a saturated machine a live worker in a long torch
    # step can be silent for tens of seconds, and 3-6 s limits declared live workers dead mid-step.
    worker_retry_s: float = 60.0
    # How long a request waits for a dead worker to come back (restart) before it fails.
    request_timeout_s: float = 300.0
    # Longest a single forwarded request (a sample batch, a training step) may take.
    job_idle_pause_s: float = 3600.0
    # A running job that gets no call for this long is paused (its client likely died) and its
    # resources freed; its next call resumes it.
    inference_idle_s: float = 60.0
    # An inference job (a base-model sampler) with no call for this long is paused: it holds no
    # state, so its next call resumes it at once; one idle-paused for job_idle_pause_s more is
    # finished (its client is gone). A queued one that no client asks for this long is paused too.
    slot_reclaim_idle_s: float = 5.0
    # A placed job with no call for this long (and none in flight) gives up its resources (an
    # adapter slot, engine memory, a learner share) when a queued job that some client is asking
    # for cannot start without them: it is paused as idle (its weights, versions and checkpoints
    # stay) and its next call queues it again. Which one goes: the policy's choice, tenants over
    # their fair share first, then the longest idle; never one of higher priority than the waiting
    # job. Nothing is taken while no one waits. Above the client's 2 s cap on retrying a "waiting"
    # answer, so a job just started for a waiting client is called before it could count as idle.
    keep_finished_inference: int = 32
    # Finished inference jobs kept in the job table per tenant (the newest); older ones are deleted.
    finished_inference_keep_s: float = 3600.0
    # Finished inference jobs are deleted from the job table this long after they finished.
    keep_checkpoints: int = 2
    # Per-step checkpoints kept per adapter (named save_state checkpoints are always kept).
    sampler_keep_s: float = 600.0
    # An older version's sampler weights (its export) stay sampleable while they were handed out
    # (save_weights_for_sampler) or sampled within this long, past keep_checkpoints: an evaluator
    # or async RL samples a few steps behind. A hand-out's time is in the state (a restart keeps
    # its window); a sample's is counted in the scheduler process. Versions a client holds (the HTTP gateway holds each
    # live session's samplers) stay however old, up to max_held_versions per holder; 0: only those
    # and the last keep_checkpoints.
    max_held_versions: int = 64
    # Versions one holder (a Tinker session, whose samplers hold theirs) holds at most; past it, its
    # oldest hold is released (logged) and that version is kept as any other is (above).
    learner_slice_idle_s: float = 2.0
    # A job holding a shared learner group between steps loses its turn after this idle time.
    learner_batch_window_s: float = 0.02
    # How long a LoRA forward_backward waits for other agents' calls to the same learner before it
    # goes; those that meet run in one pass over their adapters (0: only calls already waiting).
    learner_batch_max: int = 8
    # At most this many calls per batched pass (1: every call alone).
    worker_threads: int = 0
    # torch threads of each engine and learner rank this runtime starts as a local process. 0:
    # $OMP_NUM_THREADS when set, else the cores this runtime may run on (its CPU affinity), shared
    # by a learner group's ranks (engine and learner take turns in a training loop: each gets them
    # all); N: N each. Each also starts with OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=1000 unless
    # the environment sets either: threads that wait for work spin briefly, then sleep instead of
    # holding cores that other processes need (engine.worker.server.omp_wait_env; measured:
    # docs/benchmarks.md, "contention.py" and "engine.py").
    start_timeout_s: float = 180.0
    # How long a local runtime waits for its workers to load their models and register.
    max_restarts: int = 5
    # A local runtime restarts its scheduler, engines and learners after a crash, up to this many
    # times within restart_window_s; one more and it stops everything and fails (serve exits
    # non-zero): it cannot serve its jobs without any of them. 0: the first crash stops it.
    restart_window_s: float = 120.0
    # The window max_restarts counts restarts in.
    colocate: bool = False
    # One process per pair of a local engine and a local learner group (in the order declared),
    # holding one copy of the base model for both: the engine samples and the learner trains LoRA
    # adapters on the same tensors, taking turns, and a new version reaches the engine in memory
    # (polytinker.engine.worker.colocated). hf engines and one-rank learner groups only; a
    # full-parameter job is refused. Off by default (docs/benchmarks.md, "colocate.py").

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("RuntimeConfig.model must name a model (a preset, directory or hub id)")
        if not self.engines and not self.learners:
            raise ConfigError("RuntimeConfig needs at least one engine or learner")
        ids = [e.engine_id for e in self.engines] + [g.learner_id for g in self.learners]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"RuntimeConfig: engine and learner ids must be unique, got {ids}")
        self.cluster.check_workers(set(ids), bool(self.curve_secret_file))
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"RuntimeConfig: tenant names must be unique, got {names}")
        if bool(self.curve_secret_file) != bool(self.curve_clients_dir):
            raise ConfigError("RuntimeConfig: set curve_secret_file and curve_clients_dir together")
        bounds = (
            "max_inflight_samples",
            "max_inflight_train",
            "max_inflight_per_tenant",
            "keep_checkpoints",
            "keep_finished_inference",
            "max_queued_jobs",
            "max_queued_per_tenant",
            "learner_batch_max",
        )
        for name in bounds:
            if getattr(self, name) < 1:
                raise ConfigError(f"RuntimeConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "retry_after_s",
            "job_idle_pause_s",
            "inference_idle_s",
            "slot_reclaim_idle_s",
            "finished_inference_keep_s",
            "worker_heartbeat_s",
            "worker_silence_s",
            "worker_retry_s",
            "request_timeout_s",
            "learner_slice_idle_s",
            "start_timeout_s",
            "restart_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RuntimeConfig.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.handler_threads <= self.max_inflight_samples + self.max_inflight_train:
            raise ConfigError(
                f"RuntimeConfig.handler_threads ({self.handler_threads}) must exceed max_inflight_samples + "
                f"max_inflight_train ({self.max_inflight_samples + self.max_inflight_train}), so refusals and "
                "registrations are always answered; raise it or lower the bounds"
            )
        for name in ("sampler_keep_s", "learner_batch_window_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"RuntimeConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name, least in (("max_held_versions", 1), ("worker_threads", 0), ("max_restarts", 0)):
            value = getattr(self, name)  # worker_threads 0: fit to the cores
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"RuntimeConfig.{name} must be a whole number >= {least}, got {value!r}")
        if self.worker_token and len(self.worker_token) < 16:
            raise ConfigError("RuntimeConfig.worker_token must have at least 16 characters")
        if self.colocate:
            self.colocated_pairs()  # refuses what cannot be colocated, when the config is read

    def colocated_pairs(self) -> list[tuple[EngineWorkerConfig, LearnerWorkerConfig]]:
        """With ``colocate``, the local engines and learner groups paired in the order declared
        (each pair one process); refuses a config whose workers cannot pair."""
        engines, learners = [e for e in self.engines if e.local], [g for g in self.learners if g.local]
        where = "RuntimeConfig.colocate = true"
        if self.cluster.backend != "local" or len(engines) != len(learners) or not engines:
            raise ConfigError(
                f"{where} pairs each local engine with a local learner group in one process of this machine:"
                f" declare as many of each (got {len(engines)} and {len(learners)}), with [cluster] backend"
                f" 'local' (got {self.cluster.backend!r})"
            )
        for e, g in zip(engines, learners, strict=True):
            if e.backend != "hf" or g.world_size != 1:
                raise ConfigError(
                    f"{where}: engine {e.engine_id} must use the hf backend (vLLM's model cannot share its"
                    f" tensors) and learner {g.learner_id} one rank (got {e.backend!r}, world_size {g.world_size})"
                )
        return list(zip(engines, learners, strict=True))

    def check_servable_full(self) -> None:
        """Refuse a full-parameter job now where every learner group is colocated."""
        if self.colocate:
            raise ConfigError(
                "this runtime colocates its engines and learners (colocate = true in the runtime config), which"
                " train LoRA adapters only: a full-parameter job needs its own copy of the model; run it on a"
                " runtime with colocate = false"
            )

    def worker_plan(self, worker_id: str) -> WorkerPlan:
        """What the engine or learner group ``worker_id`` of this runtime is built from."""
        workers = {e.engine_id: e for e in self.engines} | {g.learner_id: g for g in self.learners}
        if worker_id not in workers:
            raise ConfigError(f"no engine or learner {worker_id!r} in the runtime config; declared: {sorted(workers)}")
        return WorkerPlan(self.model, self.state_dir, workers[worker_id], self.worker_heartbeat_s)

    @property
    def state_path(self) -> Path:
        if not self.state_dir:
            raise ConfigError("RuntimeConfig.state_dir is empty; the runtime fills it in at start")
        return Path(self.state_dir).expanduser()

    @property
    def local_address(self) -> str:
        """Where processes on this machine reach the scheduler: its address, or with Curve a Unix socket."""
        if not self.curve_secret_file:
            return self.address
        return f"ipc://{self.state_path / 'scheduler.sock'}"

    def check_servable_lora(self, rank: int, target_modules: Sequence[str]) -> None:
        """Refuse a LoRA RL job now, not at its first sample, when some engine cannot serve its
        adapter: its samples may go to any engine (a hot adapter gets replicas)."""
        vllm = [e.engine_id for e in self.engines if e.backend == "vllm"]
        if UNEMBED_MODULE in target_modules and vllm:  # vLLM serves no LoRA on lm_head
            raise ConfigError(
                f"LoRA on {UNEMBED_MODULE} (train_unembed) is served by the hf engine backend only, and engines"
                f" {vllm} are vllm: pass train_unembed=False (or target_modules without {UNEMBED_MODULE})"
            )
        limits = {e.engine_id: e.max_lora_rank() for e in self.engines}
        short = {engine: limit for engine, limit in limits.items() if limit is not None and rank > limit}
        if short:
            raise ConfigError(
                f"LoRA rank {rank} is above what vllm engines serve here (max_lora_rank {short}): "
                f"pass rank <= {min(short.values())}, or raise [engines.vllm] max_lora_rank in the runtime config"
            )

    def api_key(self) -> str:
        """The API key of the first tenant that has one (the generated ``local`` tenant unless configured)."""
        for tenant in self.tenants:
            if not tenant.curve_public_key:
                return tenant.key()
        raise ConfigError("every tenant authenticates by Curve key: the runtime has no API key to offer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RuntimeConfig:
        """Build from plain data (a parsed TOML file or ``to_dict()``); unknown keys and values of
        the wrong type are errors naming the field (``polytinker.tables``)."""
        return from_table(cls, raw, "")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> RuntimeConfig:
        return cls.from_dict(read_toml(path))


__all__ = [
    "BackendName",
    "ClusterConfig",
    "EngineWorkerConfig",
    "HttpConfig",
    "JobDefaults",
    "LearnerWorkerConfig",
    "RuntimeConfig",
    "TenantConfig",
    "check_id",
    "host_port",
]
