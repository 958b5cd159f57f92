"""What the Tinker API's calls do, in terms of polytinker's own client API.

The gateway is a client of the scheduler like any other: for each API key it holds one
``ServiceClient`` to the scheduler (which authenticates the key and stays the one authority on
tenants, jobs and priorities), and it turns each Tinker call into the polytinker call that does
the same thing. A Tinker training run (model id) is a polytinker job; ``tinker://`` paths name
the job and a checkpoint or sampler version in it, so they stay valid across gateway restarts
(the calls that save and load weights are tinker_weights.py's):

    tinker://JOB/weights/NAME           <->  polytinker-ckpt://JOB/NAME   (save_state / load_state)
    tinker://JOB/sampler_weights/A@V    <->  polytinker://JOB/A@V         (save_weights_for_sampler)
    tinker://JOB/external_weights/NAME   ->  a named sampler save ``external.NAME`` of the job's
                                             version, whose peft files the gateway serves
                                             (save_weights_external, get_external_weights_urls)
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytinker.client._convert import to_datum
from polytinker.client.sampling_client import SamplingClient
from polytinker.client.service_client import ServiceClient
from polytinker.client.training_client import TrainingClient
from polytinker.engine.types import Datum
from polytinker.errors import AuthError, ConfigError, NotBuiltError
from polytinker.gateway.checks import check_tokens, served_base_model, vocab_size
from polytinker.gateway.errors import HttpError
from polytinker.gateway.sessions import Sessions
from polytinker.gateway.store import GatewayStore, ModelRow, SamplerRow
from polytinker.gateway.tinker_names import from_tinker_path, named_sampler, owner_of, run_request_key, to_tinker_path
from polytinker.gateway.wire import prompt_ints
from polytinker.model_path import TINKER_PREFIX, from_tinker
from polytinker.scheduler.service.replies import WeightsInfoReply
from polytinker.transport import ClientCurve
from polytinker.types import SamplingParams as TinkerSamplingParams
from polytinker.types import split_stop


@dataclass
class Tenant:
    """One API key's view: its ServiceClient and the polytinker clients made for its calls."""

    owner: str
    service: ServiceClient
    training: dict[str, TrainingClient] = field(default_factory=dict)  # by job id
    samplers: dict[str, SamplingClient] = field(default_factory=dict)  # by sampler id
    lock: threading.Lock = field(default_factory=threading.Lock)


def tinker_datum(d: dict[str, Any]) -> Datum:
    """A polytinker datum from a decoded and checked Tinker datum (``tokens`` and ``loss_fn_inputs``):
    the client library's conversion (``to_datum``), so both front doors read Tinker's datums alike."""
    return to_datum({"model_input": d["tokens"].tolist(), "loss_fn_inputs": d["loss_fn_inputs"]})


class TinkerBackend:
    """The Tinker API's operations over one scheduler. Each returns at once; calls that take time
    return a ``concurrent.futures.Future`` that the route files under a request id."""

    def __init__(
        self,
        scheduler_address: str,
        state_dir: Path,
        *,
        curve: ClientCurve | None = None,
        base_models: tuple[str, ...] = (),
        default_max_tokens: int = 256,
        tokenizer_ids: dict[str, str] | None = None,
        session_timeout_s: float = 180.0,
    ) -> None:
        self.address, self.curve = scheduler_address, curve
        self.base_models = base_models
        self.default_max_tokens = default_max_tokens
        self.tokenizer_ids = dict(tokenizer_ids or {})
        self.store = GatewayStore(Path(state_dir) / "gateway.sqlite")
        # Calls made of several client calls run here (tinker_weights.py's too); bounded, so a
        # burst of requests queues rather than starting a thread each.
        self.pool = ThreadPoolExecutor(32, thread_name_prefix="polytinker-http")
        self._tenants: dict[str, Tenant] = {}
        self._lock = threading.Lock()
        self.sessions = Sessions(self.store, self.known_tenant, session_timeout_s)  # started by the Gateway

    def close(self) -> None:
        self.sessions.stop()
        with self._lock:
            tenants, self._tenants = list(self._tenants.values()), {}
        for t in tenants:
            t.service.close(keep_jobs=True)  # the jobs outlive the gateway: a restarted one serves them
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    # --- tenants -------------------------------------------------------------------------------------
    def tenant(self, api_key: str) -> Tenant:
        """The tenant of ``api_key``; AuthError when the scheduler does not know the key."""
        if not api_key:
            raise AuthError("no API key: pass a key of this runtime (the tinker SDK: TINKER_API_KEY; openai: api_key=)")
        owner = owner_of(api_key)
        with self._lock:
            found = self._tenants.get(owner)
        if found is not None:
            return found
        service = ServiceClient(self.address, api_key=api_key, curve=self.curve, job_wait_s=3600.0)
        try:
            service.list_jobs(include_finished=False)  # the scheduler checks the key
        except Exception:
            service.close(keep_jobs=True)
            raise
        with self._lock:
            return self._tenants.setdefault(owner, Tenant(owner, service))

    def known_tenant(self, owner: str) -> Tenant | None:
        """The tenant of a key this gateway has seen since it started, or None."""
        with self._lock:
            return self._tenants.get(owner)

    def create_session(self, t: Tenant, req: dict[str, Any]) -> str:
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.store.add_session(session_id, t.owner)
        display_name = req.get("display_name")
        if req.get("user_metadata") or display_name:
            self.store.set_metadata(session_id, _str_dict(req.get("user_metadata")), display_name and str(display_name))
        return session_id

    def _own_session(self, t: Tenant, session_id: str) -> None:
        if self.store.session_owner(session_id) != t.owner:
            raise ConfigError(f"unknown session {session_id!r}")

    def check_session(self, t: Tenant, session_id: str) -> None:
        """A session of the tenant's that takes calls."""
        self._own_session(t, session_id)
        if self.store.session_finished(session_id):
            raise ConfigError(f"session {session_id!r} is finished: a new ServiceClient starts another")

    def finish_session(self, t: Tenant, session_id: str, req: dict[str, Any]) -> None:
        """``ServiceClient.close(status)``: the session takes no more calls, its training runs'
        jobs finish (their adapter slots go to other runs; their saved weights stay) and its
        samplers' holds go (``Sessions``)."""
        self._own_session(t, session_id)
        reason = req.get("reason")
        status = str((reason if isinstance(reason, dict) else {}).get("type") or "success")[:32]
        detail = req.get("detail")
        self.sessions.finish(t, session_id, status, None if detail is None else str(detail)[:1000])

    # --- models --------------------------------------------------------------------------------------
    def model(self, t: Tenant, model_id: str) -> ModelRow:
        row = self.store.model(t.owner, model_id)
        if row is None:
            raise ConfigError(f"unknown model {model_id!r}: create_model (a training client) makes one")
        return row

    def training_client(self, t: Tenant, model_id: str) -> TrainingClient:
        row = self.model(t, model_id)
        with t.lock:
            tc = t.training.get(row.job_id)
            if tc is None:
                tc = t.training[row.job_id] = t.service.attach_training_client(row.job_id)
        return tc

    def create_model(self, t: Tenant, req: dict[str, Any]) -> Future[dict[str, Any]]:
        """``req`` is checked (checks.CREATE_MODEL); what the fields mean together is checked here,
        before the job is asked for."""
        session_id = req["session_id"]
        self.check_session(t, session_id)
        model_id = f"{session_id}:train:{req.get('model_seq_id') or 0}"
        key = run_request_key(session_id, req.get("model_seq_id"))  # a resent create_model: the same job
        base_model = self._base_model(req.get("base_model"))
        lora = req.get("lora_config")
        optimizer = (req.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise NotBuiltError(f"optimizer_config.type {optimizer!r} is not built (adamw is)")
        mlp, attn, unembed = ((lora or {}).get(k) is not False for k in ("train_mlp", "train_attn", "train_unembed"))
        if lora is not None and not (mlp or attn or unembed):
            raise ConfigError("lora_config: train_mlp, train_attn and train_unembed are all false: nothing to train")

        def run() -> dict[str, Any]:
            if lora is None:
                tc = t.service.create_training_client(base_model, request_key=key)
                rank = 0
            else:
                rank = lora["rank"]
                seed = lora.get("seed") or 0
                tc = t.service.create_lora_training_client(
                    base_model, rank, seed, train_mlp=mlp, train_attn=attn, train_unembed=unembed, request_key=key
                )
            self.add_run(t, model_id, tc, base_model, rank, req.get("user_metadata"))
            return {"model_id": model_id, "type": "create_model"}

        return self.pool.submit(run)

    def add_run(self, t: Tenant, model_id: str, tc: TrainingClient, base_model: str, rank: int, metadata: Any) -> None:
        """File a new run (``create_model``, or ``load_state`` into a new run): its model id and
        job, the user metadata the SDK sent with it, and its training client."""
        self.store.add_model(ModelRow(model_id, t.owner, tc.job_id, base_model, rank))
        if metadata:
            self.store.set_metadata(model_id, _str_dict(metadata))
        with t.lock:
            t.training[tc.job_id] = tc

    def _base_model(self, name: Any) -> str:
        return served_base_model(self.base_models, name)

    def info(self, t: Tenant, model_id: str) -> dict[str, Any]:
        row = self.model(t, model_id)
        return {
            "type": "get_info",
            "model_id": row.model_id,
            "model_data": {
                "arch": "llama",
                "model_name": row.base_model,
                "tokenizer_id": self.tokenizer_ids.get(row.base_model, row.base_model),
            },
            "is_lora": row.lora_rank > 0,
            "lora_rank": row.lora_rank or None,
            "model_name": row.base_model,
        }

    # --- training ------------------------------------------------------------------------------------
    def forward_backward(self, t: Tenant, req: dict[str, Any]) -> Future[Any]:
        """``req["datums"]``: the call's data as polytinker datums (``tinker_datum``)."""
        tc = self.training_client(t, req["model_id"])
        data = req["datums"]
        if req["forward_only"]:  # the learner scores the loss as forward_backward would, without a gradient
            return tc.forward(data, req["loss_fn"], req["loss_fn_config"])
        return tc.forward_backward(data, req["loss_fn"], req["loss_fn_config"])

    def optim_step(self, t: Tenant, req: dict[str, Any]) -> Future[Any]:
        tc = self.training_client(t, str(req.get("model_id", "")))
        params = req.get("adam_params") or req.get("optim_params") or {}
        if req.get("optimizer_params") is not None:
            raise NotBuiltError("only the Adam optimizer is built (optimizer_params of another kind was sent)")
        return tc.optim_step(params)

    # --- saved weights (tinker_weights.py saves and loads them) --------------------------------------
    def source(self, t: Tenant, path: str) -> WeightsInfoReply:
        """What the scheduler says of saved weights the tenant names (its own, or published ones);
        404 for weights it may not read, as for ones that do not exist (the key itself is good)."""
        try:
            return t.service.weights_info(path)
        except AuthError as exc:
            raise HttpError(404, str(exc), "not_found") from None

    def sampler_path(self, tinker_path: str) -> str:
        """The ``polytinker://`` path of a sampler path: ``tinker://JOB/sampler_weights/AGENT@V``,
        or a named save's ``tinker://JOB/sampler_weights/NAME`` (ConfigError if the job has none)."""
        named = named_sampler(tinker_path)
        if named is None:
            return from_tinker_path(tinker_path, "sampler_weights")
        found = self.store.sampler_name(*named)
        if found is None:
            raise ConfigError(f"no sampler weights {tinker_path!r}: save_weights_for_sampler(name) makes them")
        return found

    def polytinker_path(self, tinker_path: str) -> str:
        """The polytinker path of a ``tinker://`` path of saved weights (named sampler saves too)."""
        return self.sampler_path(tinker_path) if named_sampler(tinker_path) else from_tinker(tinker_path)

    # --- sampling ------------------------------------------------------------------------------------
    def create_sampler(self, t: Tenant, req: dict[str, Any]) -> str:
        session_id = str(req.get("session_id", ""))
        self.check_session(t, session_id)
        tinker_path = req.get("model_path")
        if tinker_path:
            path = self.sampler_path(str(tinker_path))
            base_model = self.source(t, path).base_model
            t.service.hold_weights(session_id, path)  # sampleable while the session lives
        else:
            path, base_model = "", self._base_model(req.get("base_model"))
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.store.add_sampler(SamplerRow(sampler_id, t.owner, base_model, path))
        self.store.add_sampler_session(sampler_id, session_id)
        return sampler_id

    def sampler_row(self, t: Tenant, sampler_id: str) -> SamplerRow:
        row = self.store.sampler(t.owner, sampler_id)
        if row is None:
            raise ConfigError(f"unknown sampling session {sampler_id!r}")
        return row

    def sampling_client(
        self, t: Tenant, req: dict[str, Any], check: Callable[[str], None] | None = None
    ) -> SamplingClient:
        """The client of the request's sampling session, or of its model_path / base_model;
        ``check(base_model)`` runs before a client is made or used."""
        sampler_id = req.get("sampling_session_id")
        base: str | None
        if sampler_id:
            row = self.sampler_row(t, str(sampler_id))
            key, path, base = row.sampler_id, row.model_path, row.base_model
        elif req.get("model_path"):
            path = self.sampler_path(str(req["model_path"]))
            key, base = path, None  # looked up once, when its client is made
        else:
            base = self._base_model(req.get("base_model"))
            key, path = f"base:{base}", ""
        with t.lock:
            sc = t.samplers.get(key)
        base = base or (sc.base_model if sc is not None else self.source(t, path).base_model)
        if check is not None:
            check(base)
        if sc is None:
            sc = t.service.create_sampling_client(model_path=path or None, base_model=base)
            with t.lock:
                sc = t.samplers.setdefault(key, sc)
        return sc

    def sampling_params(self, p: dict[str, Any]) -> TinkerSamplingParams:
        """Tinker's sampling parameters as the SDK sent them (polytinker's client reads their
        meanings: ``top_k=-1`` none, ``stop`` a string, strings or token ids, ``[]`` not even EOS);
        ``max_tokens=None``: the gateway's default. ``max_tokens=0`` was refused at the door
        (checks.SAMPLING): the SDK wants one sequence per sample, and ``max_tokens=1`` scores a
        prompt in one prefill."""
        if not isinstance(p, dict):
            raise ConfigError("sampling_params must be an object")
        # Tinker's fields only: ``choices`` is polytinker's client's own, not part of the HTTP API.
        known = {f.name for f in dataclasses.fields(TinkerSamplingParams)} - {"choices"}
        try:
            params = TinkerSamplingParams(**{k: v for k, v in p.items() if k in known})
        except TypeError as exc:  # a value of the wrong type where the checks compare numbers
            raise ConfigError(f"sampling_params: {exc}") from None
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.default_max_tokens)
        return params

    def sample(self, t: Tenant, req: dict[str, Any]) -> Future[Any]:
        """A ``SampleResponse`` of polytinker's client: the sequences and, as asked, the prompt's
        logprobs and its top-k ones (one scoring pass for both). ``req`` passed checks.ASAMPLE;
        its token ids are checked against the sampler's base model before a client is made."""
        for unsupported in ("topk_sample_logprobs", "prompt_alt_tokens_k", "prompt_logprobs_last_n"):
            if req.get(unsupported):
                raise NotBuiltError(f"{unsupported} is not built in polytinker (prompt_logprobs and topk are)")
        if req.get("target_prompt_logprobs") is not None:
            raise NotBuiltError("target_prompt_logprobs is not built in polytinker (prompt_logprobs is)")
        tokens = prompt_ints(req.get("prompt"))
        params = self.sampling_params(req.get("sampling_params") or {})
        stop_ids = split_stop(params.stop)[1]

        def in_vocabulary(base_model: str) -> None:
            vocab = vocab_size(base_model)
            check_tokens(tokens, "prompt.tokens", vocab)
            check_tokens(stop_ids, "sampling_params.stop", vocab)

        sc = self.sampling_client(t, req, in_vocabulary)
        num, top_k = req.get("num_samples") or 1, req.get("topk_prompt_logprobs") or 0
        want_prompt = bool(req.get("prompt_logprobs"))
        # One client call, answered by its own future: a pool thread held for the whole of each
        # sample would let one tenant's samples in flight hold up every other tenant's.
        return sc.sample(tokens, num, params, want_prompt, top_k)


def _str_dict(d: Any) -> dict[str, str]:
    """User metadata as Tinker keeps it: string keys and values."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError("user_metadata must be an object")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in d.items()}


__all__ = ["TINKER_PREFIX", "Tenant", "TinkerBackend", "from_tinker_path", "owner_of", "to_tinker_path"]
