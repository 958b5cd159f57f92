"""``ServiceClient``: the entry point of the client API (Tinker's names and semantics).

``ServiceClient(address)`` talks to a running scheduler (``polytinker serve``);
``ServiceClient()`` with no address (and no ``$POLYTINKER_SCHEDULER``) starts a ``LocalRuntime``
for the script on first use, with the base model the first ``create_*`` call names, and stops it
at ``close()``; if it stops by itself (an actor stayed down), calls raise its ``RuntimeDead``.
The API key comes from ``api_key=`` or ``$POLYTINKER_API_KEY`` (a local runtime makes its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

from polytinker.errors import ConfigError, PolytinkerError, TransportError
from polytinker.scheduler.client._connection import Connection
from polytinker.scheduler.client.sampling_client import SamplingClient
from polytinker.scheduler.client.training_client import TrainingClient
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport import ClientCurve

ADDRESS_ENV = "POLYTINKER_SCHEDULER"
API_KEY_ENV = "POLYTINKER_API_KEY"


class ServiceClient:
    """Creates training and sampling clients, and lists and controls this tenant's jobs."""

    def __init__(
        self,
        address: str | None = None,
        *,
        api_key: str | None = None,
        runtime_config: RuntimeConfig | None = None,
        curve: ClientCurve | None = None,
        timeout_s: float = 600.0,
        job_wait_s: float = 600.0,
    ) -> None:
        self._address = address or os.environ.get(ADDRESS_ENV) or None
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or ""
        self._runtime_config = runtime_config
        self._curve, self._timeout_s, self._job_wait_s = curve, timeout_s, job_wait_s
        self._runtime: Any = None
        self._conn: Connection | None = None
        self._created: list[str] = []  # jobs this client made: finished at close() unless kept
        self._closed = False
        self._lock = threading.Lock()
        if self._address is not None:
            if not self._api_key and curve is None:
                raise ConfigError(
                    f"an API key is needed for {self._address}: pass api_key=, set {API_KEY_ENV}, or pass curve= "
                    "(a scheduler that knows your Curve key as a tenant's)"
                )
            self._conn = Connection(
                self._address, self._api_key, curve=curve, timeout_s=timeout_s, job_wait_s=job_wait_s
            )

    @property
    def runtime(self) -> Any:
        """The LocalRuntime this client started (None when it talks to a remote scheduler)."""
        return self._runtime

    def _connection(self, base_model: str | None = None) -> Connection:
        with self._lock:
            if self._closed:
                raise TransportError("this ServiceClient is closed")
            if self._conn is None:
                from polytinker.scheduler.service.runtime import LocalRuntime

                cfg = self._runtime_config or RuntimeConfig()
                if base_model:
                    cfg = dataclasses.replace(cfg, model=base_model)
                self._runtime = LocalRuntime(cfg).start()
                self._api_key = self._runtime.api_key
                self._conn = Connection(
                    self._runtime.local_address,
                    self._api_key,
                    timeout_s=self._timeout_s,
                    job_wait_s=self._job_wait_s,
                    check=self._runtime.check,
                )
            return self._conn

    def _create(self, kind: str, base_model: str, **fields: Any) -> dict[str, Any]:
        conn = self._connection(base_model)
        job: dict[str, Any] = conn.request("sched.create_job", m.CreateJob(conn.api_key, kind, base_model, **fields))[
            "job"
        ]
        self._created.append(job["job_id"])
        return job

    def _admitted(self, job: dict[str, Any]) -> dict[str, Any]:
        """The job, unless the policy rejected it. A queued job is fine: its calls wait until it runs."""
        if job["state"] == "rejected":
            raise ConfigError(f"job {job['job_id']} was rejected: {job['reason']}")
        return job

    # --- Tinker's constructors -----------------------------------------------------------------------
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        *,
        agent: str = "default",
        alpha: int | None = None,
        seed: int = 0,
        target_modules: tuple[str, ...] = (),
        priority: int = 0,
        steps: int = 0,
        kind: str = "lora_rl",
        max_staleness: int = 0,
    ) -> TrainingClient:
        """A job training a fresh LoRA adapter (rank ``rank``) for ``agent`` on ``base_model``.
        ``kind``: ``lora_rl`` (samples too) or ``sft`` (no engine); ``steps``: declared length;
        ``max_staleness``: how many steps the script samples ahead of training (0: sync), which
        the scheduler's policy plans with."""
        if kind not in ("lora_rl", "sft"):
            raise ConfigError(f"kind must be 'lora_rl' or 'sft' for a LoRA training client, got {kind!r}")
        job = self._create(
            kind,
            base_model,
            agent=agent,
            rank=rank,
            alpha=alpha or rank,
            seed=seed,
            target_modules=tuple(target_modules),
            priority=priority,
            steps=steps,
            max_staleness=max_staleness,
        )
        return TrainingClient(self._connection(), self._admitted(job))

    def create_training_client(
        self, base_model: str, *, agent: str = "default", priority: int = 0, steps: int = 0, max_staleness: int = 0
    ) -> TrainingClient:
        """A job training every weight of ``base_model`` (a learner group to itself)."""
        job = self._create(
            "full_rl", base_model, agent=agent, priority=priority, steps=steps, max_staleness=max_staleness
        )
        return TrainingClient(self._connection(), self._admitted(job))

    def attach_training_client(self, job_id: str) -> TrainingClient:
        """A TrainingClient on one of this tenant's existing jobs (made by another process, or by
        this one before a restart); ``close()`` leaves the job alone."""
        return TrainingClient(self._connection(), self.get_job(job_id)["job"])

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None, *, priority: int = 0
    ) -> SamplingClient:
        """Sample a saved adapter version (``model_path``), or the base model: an inference job
        that every call of the client names (the policy gates and accounts it; ``close()``
        finishes it, and the scheduler pauses it when idle)."""
        if model_path:
            conn = self._connection(base_model)
            return SamplingClient(conn, base_model or self._model_of(conn), model_path)
        if not base_model:
            raise ConfigError("create_sampling_client needs model_path or base_model")

        def reopen() -> str:
            return str(self._admitted(self._create("inference", base_model, priority=priority))["job_id"])

        return SamplingClient(self._connection(), base_model, job_id=reopen(), reopen=reopen)

    def _model_of(self, conn: Connection) -> str:
        reply = conn.request("sched.runtime_status", m.RuntimeStatus(conn.api_key))
        return str(reply.get("base_model", ""))

    # --- jobs ----------------------------------------------------------------------------------------
    def list_jobs(self, include_finished: bool = True) -> list[dict[str, Any]]:
        conn = self._connection()
        jobs: list[dict[str, Any]] = conn.request("sched.list_jobs", m.ListJobs(conn.api_key, include_finished))["jobs"]
        return jobs

    def jobs_report(self, include_finished: bool = True) -> dict[str, Any]:
        """``{"jobs": [...], "load": {...}}``: the jobs with what this scheduler process saw of
        them (``calls``, ``in_flight``, ``idle_s``, for jobs it knows), and the tenant's load
        (calls ``in_flight``, ``completed``, ``failed``, ``refused``, ``waiting``; live ``jobs`` by state)."""
        conn = self._connection()
        reply = conn.request("sched.list_jobs", m.ListJobs(conn.api_key, include_finished))
        return {"jobs": reply["jobs"], "load": reply.get("load", {})}

    def get_job(self, job_id: str) -> dict[str, Any]:
        conn = self._connection()
        return conn.request("sched.job_query", m.JobQuery(conn.api_key, job_id))

    def _action(self, job_id: str, action: str) -> dict[str, Any]:
        conn = self._connection()
        job: dict[str, Any] = conn.request("sched.job_action", m.JobAction(conn.api_key, job_id, action))["job"]
        return job

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "cancel")

    def pause_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "pause")

    def resume_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "resume")

    def export_weights(
        self, model_path: str, out_dir: str | os.PathLike[str], *, merged: bool = False, overwrite: bool = False
    ) -> Path:
        """Write a saved version (``polytinker://JOB/AGENT@VERSION`` or a Tinker sampler path) as a
        peft adapter directory, or with ``merged`` as a whole Hugging Face model directory
        (``polytinker.scheduler.client.export``)."""
        from polytinker.scheduler.client.export import export_weights

        return export_weights(self._connection(), model_path, out_dir, merged=merged, overwrite=overwrite)

    def runtime_status(self) -> dict[str, Any]:
        """Workers, their statistics (batches, mixed batches, adapter loads) and learner switches."""
        conn = self._connection()
        return conn.request("sched.runtime_status", m.RuntimeStatus(conn.api_key))

    # --- lifecycle -----------------------------------------------------------------------------------
    def close(self, *, keep_jobs: bool = False) -> None:
        """Finish the jobs this client created that are still live (their resources go to others;
        their adapters, versions and checkpoints stay), close the connection, stop a local runtime.
        ``keep_jobs=True`` leaves them running (another process continues them)."""
        if not keep_jobs and self._conn is not None:
            for job_id in self._created:
                with contextlib.suppress(PolytinkerError):
                    self._conn.request("sched.job_action", m.JobAction(self._conn.api_key, job_id, "finish"))
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            runtime, self._runtime = self._runtime, None
        if conn is not None:
            conn.close()
        if runtime is not None:
            runtime.stop()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ADDRESS_ENV", "API_KEY_ENV", "ServiceClient"]
