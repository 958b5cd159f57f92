"""The scheduler's sampling calls: ``sched.sample`` and ``sched.compute_logprobs``, each read on
an engine.

A call reads a saved version by its model path (``polytinker://JOB/AGENT@VERSION``: the tenant's
own, or a published one; ``WeightsCatalog.resolve``) or the base model through its inference job.
It counts as activity of the job it belongs to (``JobManager.touch``, ``JobManager.running``: a
queued or paused inference job is answered "waiting"), is admitted under the tenant's sampling
bound (``Admission``) and goes to the engine routing picks (``JobManager.route``), which first gets
the version's tensors if it cannot read its export (``WeightPush``). An engine that dies under it:
the call goes at once to the one routing picks then. The tokens it read and sampled are counted
against its job (``UsageMeter``), and a read of a saved version is audited (``AuditLog``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError
from polytinker.model_path import ModelPath
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.audit import AuditLog
from polytinker.scheduler.service.broker import Broker
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.fb_batcher import Prepare
from polytinker.scheduler.service.jobs import JobManager
from polytinker.scheduler.service.load import Admission
from polytinker.scheduler.service.usage import UsageMeter
from polytinker.scheduler.service.weight_push import WeightPush
from polytinker.scheduler.service.weights import WeightsCatalog
from polytinker.scheduler.types import JobKind
from polytinker.transport import Request

R = TypeVar("R")


class SamplingCalls:
    """The sampling handlers (module docstring)."""

    def __init__(
        self,
        config: RuntimeConfig,
        broker: Broker,
        jobs: JobManager,
        weights: WeightsCatalog,
        admission: Admission,
        meter: UsageMeter,
        audit: AuditLog,
        tenant: Callable[[str], str],
    ) -> None:
        self.broker, self.jobs, self.weights, self.admission = broker, jobs, weights, admission
        self.meter, self.audit = meter, audit
        self._tenant = tenant  # the tenant of an API key (AuthError for none)
        self.push = WeightPush(config, broker, jobs)  # versions to engines that cannot read them

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {m.Sample: self.sample, m.ComputeLogprobs: self.compute_logprobs}

    def sample(self, msg: m.Sample) -> r.SampleReply:
        tenant = self._tenant(msg.api_key)
        key, version, export, full = self.weights.resolve(tenant, msg.model_path)
        self._sampling_job(tenant, msg)
        with self.admission.admit(tenant, "sample"):
            req = wm.EngineSample(
                key, version, export, msg.prompt_token_ids, msg.num_samples, msg.params, tenant, full, msg.request_key
            )
            out: r.SampleReply = self._read_on_an_engine(key, msg.base_model, req, self.push.prepare(key, export, full))
        self._sampled(tenant, msg, [msg.prompt_token_ids], [q.tokens for q in out.sequences])
        return out  # the engine's answer goes on to the client as it is

    def compute_logprobs(self, msg: m.ComputeLogprobs) -> r.LogprobsReply:
        tenant = self._tenant(msg.api_key)
        key, version, export, full = self.weights.resolve(tenant, msg.model_path)
        self._sampling_job(tenant, msg)
        with self.admission.admit(tenant, "sample"):
            req = wm.EngineLogprobs(key, version, export, msg.sequences, full=full, top_k=msg.top_k, tag=tenant)
            prepare = self.push.prepare(key, export, full)
            out: r.LogprobsReply = self._read_on_an_engine(key, msg.base_model, req, prepare)
        self._sampled(tenant, msg, msg.sequences, ())
        return out

    def _read_on_an_engine(self, key: str, base_model: str, req: Request[R], prepare: Prepare | None) -> R:
        """Send a sampling read to the engine routing picks; if that engine dies under it, at once to
        the one routing picks then (one that is there, which loads the adapter first)."""
        route = functools.partial(self.jobs.route, key or None, base_model)
        return self.broker.call(route(), req, prepare=prepare, elsewhere=route)

    def _sampled(self, tenant: str, msg: m.Sample | m.ComputeLogprobs, read: Any, sampled: Any) -> None:
        """A sampling call answered: the tokens it read and sampled counted against its job, and a
        saved version's read audited."""
        job_id = ModelPath.parse(msg.model_path).job_id if msg.model_path else msg.job_id
        self.meter.tokens(tenant, "sampling_prefill", read, msg.base_model, job_id)
        self.meter.tokens(tenant, "sampling_sample", sampled, msg.base_model, job_id)
        if msg.model_path:
            self.audit.sampled(tenant, msg.model_path)

    def _sampling_job(self, tenant: str, msg: m.Sample | m.ComputeLogprobs) -> None:
        """The job a sampling call belongs to, which the call counts as activity of. A base-model
        call names its inference job, which the policy admits and gates: queued or paused, the
        call is answered "waiting" (paused for idleness, the call resumes it). A model path names
        its training job (``WeightsCatalog.resolve`` checked it is the tenant's)."""
        if msg.model_path:
            self.jobs.touch(ModelPath.parse(msg.model_path).job_id)
            return
        if not msg.job_id:
            raise ConfigError(
                "a base-model call names its inference job: ServiceClient.create_sampling_client(base_model=...) "
                "makes one"
            )
        row, _ = self.jobs.running(tenant, msg.job_id)
        if row.kind != JobKind.INFERENCE:
            raise ConfigError(f"job {msg.job_id} is a {row.kind} job; a base-model call names an inference job")


__all__ = ["SamplingCalls"]
