"""``ServiceClient``: the entry point of the client API (Tinker's names and semantics).

``ServiceClient(address)`` (or Tinker's ``base_url=``, a ``tcp://`` or ``ipc://`` address) talks to
a running scheduler (``polytinker serve``); ``ServiceClient()`` with no address (and no
``$POLYTINKER_SCHEDULER``) starts a ``LocalRuntime`` for the script on first use, with the base
model the first ``create_*`` call names, and stops it at ``close()`` (``_local_runtime.py``:
without ``runtime_config``, the persistent default runtime this user's scripts share).
``ServiceClient(inproc=True)`` starts an ``InprocRuntime`` instead: the same scheduler, engine and
learner as objects in this process, no sockets (one process to step through with a debugger).
The API key comes from ``api_key=`` or ``$POLYTINKER_API_KEY`` (a local runtime makes its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polytinker.client._connection import Connection
from polytinker.client._future import APIFuture, submit
from polytinker.client._local_runtime import connect_local_runtime
from polytinker.client._lora import LORA_KINDS, lora_fields, lora_modules, lora_options
from polytinker.client.export import adapter_files, export_weights
from polytinker.client.sampling_client import SamplingClient
from polytinker.client.training_client import TrainingClient
from polytinker.errors import ConfigError, PolytinkerError, TransportError
from polytinker.model_path import CKPT_PREFIX, CheckpointPath
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.types import JobKind, JobState
from polytinker.transport import ClientCurve
from polytinker.types import GetServerCapabilitiesResponse, SupportedModel

ADDRESS_ENV = "POLYTINKER_SCHEDULER"
API_KEY_ENV = "POLYTINKER_API_KEY"


def scheduler_address(address: str | None, base_url: str | None) -> str | None:
    """The scheduler address of ``address`` or Tinker's ``base_url`` (one of them, or both the same)."""
    if base_url is not None and base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"base_url={base_url!r} is an HTTP address: polytinker's ServiceClient talks ZeroMQ to a "
            "scheduler (tcp:// or ipc://). For HTTP, use the official tinker SDK against "
            "`polytinker serve --http` (docs/tinker.md)"
        )
    if base_url is not None and not base_url.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"base_url must be a tcp:// or ipc:// scheduler address, got {base_url!r}")
    if address and base_url and address != base_url:
        raise ConfigError(f"address {address!r} and base_url {base_url!r} differ: pass one")
    return address or base_url


class ServiceClient:
    """Creates training and sampling clients, and lists and controls this tenant's jobs."""

    def __init__(
        self,
        address: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        runtime_config: RuntimeConfig | None = None,
        curve: ClientCurve | None = None,
        timeout_s: float = 600.0,
        job_wait_s: float = 600.0,
        inproc: bool = False,
    ) -> None:
        given = scheduler_address(address, base_url)
        if inproc and given:
            raise ConfigError(f"inproc=True runs its own runtime in this process: pass no address, not {given!r}")
        self._address = given or (None if inproc else os.environ.get(ADDRESS_ENV)) or None
        self._inproc = inproc
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
        """The LocalRuntime (or InprocRuntime) this client started (None when it talks to a remote scheduler)."""
        return self._runtime

    def _connection(self, base_model: str | None = None) -> Connection:
        with self._lock:
            if self._closed:
                raise TransportError("this ServiceClient is closed")
            if self._conn is None:
                self._conn, self._runtime = connect_local_runtime(
                    self._runtime_config, base_model, self._inproc, self._timeout_s, self._job_wait_s
                )
                self._api_key = self._conn.api_key
            return self._conn

    def _create(self, kind: str, base_model: str, request_key: str = "", **fields: Any) -> dict[str, Any]:
        """A job; its ``request_key`` (one made here if none is given) is the same on each resend
        of the call, so a scheduler that restarts mid-call answers with one job, not two."""
        conn = self._connection(base_model)
        msg = m.CreateJob(conn.api_key, kind, base_model, request_key=request_key or uuid.uuid4().hex, **fields)
        job = conn.ask(msg).job
        self._created.append(job["job_id"])
        return job

    def _admitted(self, job: dict[str, Any]) -> dict[str, Any]:
        """The job, unless the policy rejected it. A queued job is fine: its calls wait until it runs."""
        if job["state"] == JobState.REJECTED:
            raise ConfigError(f"job {job['job_id']} was rejected: {job['reason']}")
        return job

    # --- Tinker's constructors -----------------------------------------------------------------------
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: Mapping[str, str] | None = None,
        *,
        agent: str = "default",
        alpha: int | None = None,
        target_modules: tuple[str, ...] = (),
        priority: int = 0,
        steps: int = 0,
        kind: str = "lora_rl",
        max_staleness: int = 0,
        request_key: str = "",
    ) -> TrainingClient:
        """A job training a fresh LoRA adapter (rank ``rank``) for ``agent`` on ``base_model``.
        ``seed``: of the adapter's initialisation (None: 0); ``train_attn`` / ``train_mlp`` /
        ``train_unembed``: LoRA on the attention (q, k, v, o) / MLP (gate, up, down) projections /
        the unembedding (``lm_head``), as Tinker's defaults say all three, unless ``target_modules``
        names the modules (``user_metadata`` is accepted and not kept). ``kind``: ``lora_rl`` (samples too)
        or ``sft`` (no engine); ``steps``: declared length; ``max_staleness``: how many steps the
        script samples ahead of training (0: sync), which the scheduler's policy plans with.
        ``request_key``: this creation's key (one is made if none is given): a creation repeated
        with the same key and arguments gets the job the first made, not another one."""
        if kind not in LORA_KINDS:
            raise ConfigError(f"kind must be 'lora_rl' or 'sft' for a LoRA training client, got {kind!r}")
        lora = lora_fields(rank, alpha, seed, lora_modules(train_mlp, train_attn, train_unembed, tuple(target_modules)))
        fields = {"agent": agent, "priority": priority, "steps": steps, "max_staleness": max_staleness}
        job = self._create(kind, base_model, request_key, **fields, **lora)
        return TrainingClient(self._connection(), self._admitted(job), lora)

    async def create_lora_training_client_async(self, base_model: str, rank: int = 32, **kw: Any) -> TrainingClient:
        return await asyncio.to_thread(self.create_lora_training_client, base_model, rank, **kw)

    def create_training_client(
        self,
        base_model: str,
        *,
        agent: str = "default",
        priority: int = 0,
        steps: int = 0,
        max_staleness: int = 0,
        request_key: str = "",
    ) -> TrainingClient:
        """A job training every weight of ``base_model`` (a learner group to itself); ``request_key``
        as ``create_lora_training_client``'s."""
        fields = {"agent": agent, "priority": priority, "steps": steps, "max_staleness": max_staleness}
        job = self._create(JobKind.FULL_RL, base_model, request_key, **fields)
        return TrainingClient(self._connection(), self._admitted(job))

    def create_training_client_from_state(
        self, path: str, user_metadata: Mapping[str, str] | None = None, *, optimizer: bool = False, **kw: Any
    ) -> TrainingClient:
        """A new job shaped like the one that saved checkpoint ``path`` (``polytinker-ckpt://JOB/NAME``,
        from ``save_state``: its base model, kind, agent and LoRA rank), holding the checkpoint's
        weights (and with ``optimizer`` its optimizer state). ``kw``: the ``create_*`` keywords
        (``priority``, ``steps``, ...)."""
        path = str(path)
        checkpoint = CheckpointPath.parse(path)
        if checkpoint is None or not checkpoint.job_id:
            raise ConfigError(f"pass a path that save_state gave ({CKPT_PREFIX}JOB/NAME), got {path!r}")
        source = self.weights_info(path)  # the tenant's own checkpoint, or a published one
        kw.setdefault("agent", source.agent)
        if source.kind == JobKind.FULL_RL:
            tc = self.create_training_client(source.base_model, **kw)
        else:
            tc = self.create_lora_training_client(
                source.base_model, **lora_options(source.kind, source.lora or {}), **kw
            )
        (tc.load_state_with_optimizer(path) if optimizer else tc.load_state(path)).result()
        return tc

    def create_training_client_from_state_with_optimizer(
        self, path: str, user_metadata: Mapping[str, str] | None = None, **kw: Any
    ) -> TrainingClient:
        """``create_training_client_from_state`` with the checkpoint's optimizer state too (a resumed run)."""
        return self.create_training_client_from_state(path, user_metadata, optimizer=True, **kw)

    async def create_training_client_from_state_async(self, path: str, **kw: Any) -> TrainingClient:
        return await asyncio.to_thread(self.create_training_client_from_state, path, **kw)

    async def create_training_client_from_state_with_optimizer_async(self, path: str, **kw: Any) -> TrainingClient:
        return await asyncio.to_thread(self.create_training_client_from_state_with_optimizer, path, **kw)

    def attach_training_client(self, job_id: str) -> TrainingClient:
        """A TrainingClient on one of this tenant's existing jobs (made by another process, or by
        this one before a restart); ``close()`` leaves the job alone."""
        found = self.get_job(job_id)
        return TrainingClient(self._connection(), found["job"], found.get("lora"))

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None, *, priority: int = 0
    ) -> SamplingClient:
        """Sample a saved adapter version (``model_path``), or the base model: an inference job
        that every call of the client names (the policy gates and accounts it; ``close()``
        finishes it, and the scheduler pauses it when idle)."""
        if model_path:
            conn = self._connection(base_model)
            return SamplingClient(conn, base_model or self._model_of(conn), str(model_path))
        if not base_model:
            raise ConfigError("create_sampling_client needs model_path or base_model")

        def reopen() -> str:
            return str(self._admitted(self._create(JobKind.INFERENCE, base_model, priority=priority))["job_id"])

        return SamplingClient(self._connection(), base_model, job_id=reopen(), reopen=reopen)

    async def create_sampling_client_async(
        self, model_path: str | None = None, base_model: str | None = None, *, priority: int = 0
    ) -> SamplingClient:
        return await asyncio.to_thread(self.create_sampling_client, model_path, base_model, priority=priority)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The base model this runtime serves (trainable and sampleable). With no address, this
        starts the local runtime (with its configured model)."""
        model = self._model_of(self._connection())
        return GetServerCapabilitiesResponse([SupportedModel(model_name=model, trainable=True, sampleable=True)])

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return await asyncio.to_thread(self.get_server_capabilities)

    def _model_of(self, conn: Connection) -> str:
        return conn.ask(m.RuntimeStatus(conn.api_key)).base_model

    # --- jobs ----------------------------------------------------------------------------------------
    def list_jobs(self, include_finished: bool = True) -> list[dict[str, Any]]:
        conn = self._connection()
        return conn.ask(m.ListJobs(conn.api_key, include_finished)).jobs

    def jobs_report(self, include_finished: bool = True) -> dict[str, Any]:
        """``{"jobs": [...], "load": {...}}``: the jobs with what this scheduler process saw of
        them (``calls``, ``in_flight``, ``idle_s``, for jobs it knows), and the tenant's load
        (calls ``in_flight``, ``completed``, ``failed``, ``refused``, ``waiting``; live ``jobs`` by state)."""
        conn = self._connection()
        reply = conn.ask(m.ListJobs(conn.api_key, include_finished))
        return {"jobs": reply.jobs, "load": reply.load}

    def get_job(self, job_id: str) -> dict[str, Any]:
        """The job (``job``), its ``adapter`` (agent, version, model_path), ``lora`` shape,
        ``checkpoints`` and last ``events``: ``JobQueryReply.as_dict()``."""
        conn = self._connection()
        return conn.ask(m.JobQuery(conn.api_key, job_id)).as_dict()

    def _action(self, job_id: str, action: str) -> dict[str, Any]:
        conn = self._connection()
        return conn.ask(m.JobAction(conn.api_key, job_id, action)).job

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "cancel")

    def pause_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "pause")

    def resume_job(self, job_id: str) -> dict[str, Any]:
        return self._action(job_id, "resume")

    def finish_job(self, job_id: str) -> dict[str, Any]:
        """Mark one of this tenant's jobs done (its resources go back; its saved weights stay)."""
        return self._action(job_id, "finish")

    def export_weights(
        self, model_path: str, out_dir: str | os.PathLike[str], *, merged: bool = False, overwrite: bool = False
    ) -> Path:
        """Write a saved version (``polytinker://JOB/AGENT@VERSION`` or a Tinker sampler path) or a
        ``save_state`` checkpoint (``polytinker-ckpt://JOB/NAME`` or ``tinker://JOB/weights/NAME``:
        its weights) as a peft adapter directory, or with ``merged`` as a whole Hugging Face model
        directory (``polytinker.client.export``); the tenant's own, or published ones."""
        return export_weights(self._connection(), model_path, out_dir, merged=merged, overwrite=overwrite)

    def export_files(self, model_path: str) -> dict[str, bytes]:
        """The peft adapter directory ``export_weights`` writes, as ``{file name: bytes}``."""
        return adapter_files(self._connection(), model_path)[0]

    def delete_checkpoint(self, job_id: str, name: str) -> bool:
        """Delete one of a job's named checkpoints, as ``get_job(job_id)["checkpoints"]`` lists it
        (a ``save_state`` name, or ``sampler-NAME`` for ``save_weights_for_sampler(NAME)``): its path
        stops resolving and its files go. True when the files were deleted; False when they stay
        because a kept version was loaded from them, or (a sampler save) the version is among the
        job's last ``keep_checkpoints``, which go when training moves past them."""
        conn = self._connection()
        msg = m.DeleteCheckpoint(conn.api_key, job_id, name)
        return conn.ask(msg).files_deleted

    def set_checkpoint_ttl(self, job_id: str, name: str, ttl_seconds: float | None) -> float | None:
        """Delete a job's named checkpoint (named as for ``delete_checkpoint``) ``ttl_seconds`` from
        now, or never (None); when it will be (a Unix time), or None."""
        conn = self._connection()
        msg = m.SetCheckpointTtl(conn.api_key, job_id, name, float(ttl_seconds or 0))
        return conn.ask(msg).expires_s

    def publish_checkpoint(self, job_id: str, name: str) -> bool:
        """Let every tenant of the runtime read one of a job's named checkpoints (named as for
        ``delete_checkpoint``): sample a published sampler save's path, load a published
        ``save_state`` checkpoint or start a job from it. Deleting it, its TTL and publishing stay
        the owner's. Whether it was published already."""
        return self._publish(job_id, name, True)

    def unpublish_checkpoint(self, job_id: str, name: str) -> bool:
        """Make a published checkpoint the owner's alone again (jobs that loaded it keep what they
        loaded); whether it was published."""
        return self._publish(job_id, name, False)

    def _publish(self, job_id: str, name: str, public: bool) -> bool:
        conn = self._connection()
        msg = m.PublishCheckpoint(conn.api_key, job_id, name, public)
        return conn.ask(msg).was_public

    def hold_weights(self, holder: str, model_path: str) -> int:
        """Keep the version at ``model_path`` (a ``polytinker://`` path the tenant may sample) from
        being pruned while ``holder`` (a name: letters, digits, ``_-.``) holds it, however far
        training moves on; how many versions the holder holds now. ``release_weights`` ends it."""
        conn = self._connection()
        msg = m.HoldWeights(conn.api_key, holder, str(model_path))
        return conn.ask(msg).held

    def release_weights(self, holder: str) -> int:
        """Drop every hold of ``holder``: versions past the job's last ``keep_checkpoints`` that
        nothing else keeps are pruned now. How many adapters it held versions of."""
        conn = self._connection()
        return conn.ask(m.HoldWeights(conn.api_key, holder)).held

    def weights_info(self, path: str) -> r.WeightsInfoReply:
        """What saved weights are (a ``polytinker-ckpt://`` checkpoint or a ``polytinker://``
        version, the tenant's own or a published one): the job that saved them, its kind, base
        model, agent and LoRA shape, and whether they are published."""
        conn = self._connection()
        return conn.ask(m.WeightsInfo(conn.api_key, str(path)))

    def copy_weights(self, path: str, *, ttl_seconds: float | None = None, request_key: str = "") -> APIFuture[str]:
        """Copy saved weights this tenant may read (its own, or published: a ``polytinker-ckpt://``
        checkpoint or a ``polytinker://`` version) into a new job of its own that holds them and
        does not train; a future for the copy's path, of the same kind. The copy outlives the
        source (its files are hard links where the filesystem allows); ``ttl_seconds`` deletes it
        then. A copied checkpoint resumes with ``create_training_client_from_state``.
        ``request_key``: this copy's key, as ``create_lora_training_client``'s (one is made if none
        is given): a copy made before a lost answer is not made twice."""
        conn = self._connection()
        msg = m.CopyCheckpoint(conn.api_key, str(path), float(ttl_seconds or 0), request_key or uuid.uuid4().hex)
        return submit(conn.pool, lambda: conn.ask(msg).path)

    def audit_log(self, day: datetime.date | str | None = None, event_type: str = "all") -> r.AuditLogReply:
        """This tenant's audit log of one UTC day (default today), oldest first: what it did to
        saved weights and what any tenant did to the weights it owns (``AuditEntry``: created,
        read and why, deleted, expired, published, TTL set). ``event_type`` is ``"all"`` or
        ``"checkpoints"`` (Tinker's other resources have no events here)."""
        conn = self._connection()
        msg = m.AuditLog(conn.api_key, "" if day is None else str(day), event_type)
        return conn.ask(msg)

    def usage(self, start_s: float, end_s: float) -> r.UsageReply:
        """This tenant's usage counts of the UTC hours starting in [start_s, end_s) (Unix times, at
        most 14 days apart): per hour, kind (``training``, ``sampling_prefill``, ``sampling_sample``
        tokens; ``checkpoint`` saves), base model and job."""
        conn = self._connection()
        return conn.ask(m.Usage(conn.api_key, float(start_s), float(end_s)))

    def storage_usage(self) -> r.StorageUsageReply:
        """How many named checkpoints this tenant keeps now, and their bytes on the scheduler's disk."""
        conn = self._connection()
        return conn.ask(m.StorageUsage(conn.api_key))

    def runtime_status(self) -> dict[str, Any]:
        """Workers, their statistics (batches, mixed batches, adapter loads) and learner switches."""
        conn = self._connection()
        return conn.ask(m.RuntimeStatus(conn.api_key)).as_dict()

    # --- lifecycle -----------------------------------------------------------------------------------
    def close(self, *, keep_jobs: bool = False) -> None:
        """Finish the jobs this client created that are still live (their resources go to others;
        their adapters, versions and checkpoints stay), close the connection, stop a local runtime.
        ``keep_jobs=True`` leaves them running (another process continues them)."""
        if not keep_jobs and self._conn is not None:
            for job_id in self._created:
                with contextlib.suppress(PolytinkerError):
                    self._conn.ask(m.JobAction(self._conn.api_key, job_id, "finish"))
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
