"""The Tinker HTTP API (``/api/v1/...``), as the official ``tinker`` SDK speaks it.

Every call authenticates with ``X-API-Key`` (a key of this runtime's tenants; the SDK wants it
to start with ``tml-``). Calls that take time answer ``{"request_id": ...}`` at once; the SDK
then polls ``/api/v1/retrieve_future``, which waits up to ``long_poll_s`` and answers the result,
``{"type": "try_again"}``, or ``{"error": ..., "category": "user" | "server"}``.
``forward_backward`` arrives as protobuf (or as JSON, from SDK releases before 0.25: ``fb_json``),
and its result (and a sample's) goes back as protobuf, which every release from 0.22 on reads;
everything else is JSON. The routes over training runs, their checkpoints and the admin reads are
tinker_api_runs.py's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from polytinker.errors import ConfigError, NotBuiltError, OverloadedError
from polytinker.gateway import checks, fb_json
from polytinker.gateway.checks import Spec, check_body
from polytinker.gateway.downloads import SignedDownloads
from polytinker.gateway.errors import HttpError, error_body
from polytinker.gateway.futures import FutureTable
from polytinker.gateway.limits import InFlight
from polytinker.gateway.seq_ids import SeqIds, body_digest
from polytinker.gateway.tinker_api_runs import add_admin_routes, add_checkpoint_routes, add_run_routes
from polytinker.gateway.tinker_backend import Tenant, TinkerBackend
from polytinker.gateway.tinker_names import owner_of, to_tinker_path
from polytinker.gateway.tinker_render import failed, fb_render, sample_render
from polytinker.gateway.tinker_runs import TinkerRuns
from polytinker.gateway.tinker_weights import TinkerWeights
from polytinker.gateway.wire import api_key, read_body, read_json
from polytinker.scheduler.service.http_config import HttpConfig

PROTO = "application/x-protobuf"

# What the SDK reads at start (ClientConfigResponse): API keys, no JWT exchange; one
# forward_backward per call (the learner batches them itself); uncompressed bodies. Releases
# 0.22-0.24 send forward_backward as protobuf only where proto_write_fwdbwd says so, and forward
# through it only with fwd_via_fwdbwd too (0.25 on always do both, and ignore the two flags); the
# JSON bodies of any release are read as well (fb_json.py).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": False,
    "proto_write_fwdbwd": True,
    "fwd_via_fwdbwd": True,
    "proto_compress_fwdbwd": False,
    "fwdbwd_max_chunk_len": 100_000,
    "fwdbwd_max_chunk_bytes_count": 48_000_000,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}

log = logging.getLogger("polytinker.http")


@dataclass(frozen=True)
class TinkerApi:
    """What the routes share (tinker_api_runs.py's too): the backend and what reads and saves
    through it (runs, weights), the table of pending calls, and the limits."""

    backend: TinkerBackend
    futures: FutureTable
    runs: TinkerRuns
    weights: TinkerWeights
    long_poll_s: float
    max_body_bytes: int
    # Telemetry is accepted from any key of the runtime and dropped: small bodies, few at a time.
    max_telemetry_bytes: int
    uploads: InFlight  # telemetry uploads in progress, per key and in total
    seq_ids: SeqIds  # each run's calls by seq_id: a resend answered once

    def tenant(self, request: Request) -> Tenant:
        return self.backend.tenant(api_key(request))

    async def tenant_of(self, request: Request) -> Tenant:
        # A known key from memory (a thread waits behind blocking calls); a new one asks the scheduler, off the loop.
        known = self.backend.known_tenant(owner_of(api_key(request)))
        return known if known is not None else await asyncio.to_thread(self.tenant, request)

    async def json(self, request: Request, spec: Spec) -> dict[str, Any]:
        """The body as a JSON object whose fields ``spec`` names passed their checks (checks.py)."""
        return check_body(await read_json(request, self.max_body_bytes), spec)

    async def call(
        self,
        request: Request,
        op: Callable[[Tenant, dict[str, Any]], Future[Any]],
        render: Callable[[Any], Any],
        spec: Spec,
    ) -> dict[str, Any]:
        """A model's call that takes time: ``op(tenant, body)`` off the event loop, its future filed
        (``submit``) under the body's model id."""
        t = await self.tenant_of(request)
        body = await self.json(request, spec)

        async def run() -> dict[str, Any]:
            return await self.submit(t, await asyncio.to_thread(op, t, body), render, body.get("model_id"))

        digest = body_digest(request.url.path, body)
        return await self.seq_ids.once(t.owner, body.get("model_id"), body.get("seq_id"), digest, run)

    async def submit(
        self,
        t: Tenant,
        fut: Future[Any],
        render: Callable[[Any], Any],
        model_id: str | None = None,
        kind: str = "train",
    ) -> dict[str, Any]:
        """Answer a call that takes time: its request id (the SDK polls ``retrieve_future`` with it)."""
        out: dict[str, Any] = {"request_id": await self.futures.put(t.owner, fut, render, kind, model_id)}
        if model_id is not None:
            out["model_id"] = model_id
        return out


def tinker_router(
    backend: TinkerBackend, futures: FutureTable, config: HttpConfig, downloads: SignedDownloads
) -> APIRouter:
    """The Tinker API's routes, with the limits of ``config``; ``downloads`` holds the signed URLs."""
    r = APIRouter(prefix="/api/v1")
    api = TinkerApi(
        backend,
        futures,
        TinkerRuns(backend, downloads),
        TinkerWeights(backend),
        config.long_poll_s,
        config.max_body_bytes,
        config.max_telemetry_bytes,
        InFlight(config.max_telemetry_uploads_per_tenant, config.max_telemetry_uploads),
        SeqIds(per_run=config.seq_ids_per_run),
    )
    _add_service_routes(r, api)
    _add_model_routes(r, api)
    _add_training_routes(r, api)
    _add_weights_routes(r, api)
    add_run_routes(r, api)  # these three: tinker_api_runs.py
    add_checkpoint_routes(r, api)
    add_admin_routes(r, api)
    _add_sampling_routes(r, api)
    _add_future_routes(r, api)
    return r


def _add_service_routes(r: APIRouter, api: TinkerApi) -> None:
    """Health, the client's configuration, sessions and telemetry."""

    @r.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @r.post("/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        return CLIENT_CONFIG

    @r.post("/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict[str, Any]:
        return {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}

    @r.get("/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        await api.tenant_of(request)
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True, "max_context_length": None}
                for name in api.backend.base_models
            ]
        }

    @r.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.CREATE_SESSION)
        return {"type": "create_session", "session_id": api.backend.create_session(t, body)}

    @r.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.FINISH_SESSION)
        await asyncio.to_thread(api.backend.finish_session, t, session_id, body)
        return {}

    @r.post("/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        session_id = (await api.json(request, checks.HEARTBEAT))["session_id"]
        if not await asyncio.to_thread(api.backend.sessions.heartbeat, t.owner, session_id):
            # 410: the SDK stops heartbeating a session that has ended (closed, or silent too long).
            raise HttpError(410, f"session {session_id!r} has ended: a new ServiceClient starts another", "gone")
        return {"type": "session_heartbeat"}

    @r.post("/telemetry")
    async def telemetry(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        if not api.uploads.take(t.owner, 1):
            bounds = f"at most {api.uploads.per_key} per key, {api.uploads.total} over all keys"
            raise OverloadedError(f"too many telemetry uploads at once ({bounds}): try again soon", 1.0)
        try:  # read to its end, bounded, and dropped: nothing leaves this machine
            await read_body(request, api.max_telemetry_bytes)
        finally:
            api.uploads.give(t.owner, 1)
        return {"status": "accepted"}


def _add_model_routes(r: APIRouter, api: TinkerApi) -> None:
    """Creating a training model, its info, and unloading it."""

    @r.post("/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.CREATE_MODEL)
        return await api.submit(t, await asyncio.to_thread(api.backend.create_model, t, body), lambda out: out)

    @r.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.MODEL)
        return await asyncio.to_thread(api.backend.info, t, body["model_id"])

    @r.post("/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.MODEL)
        model_id = body["model_id"]
        tc = await asyncio.to_thread(api.backend.training_client, t, model_id)
        fut: Future[Any] = Future()
        try:
            await asyncio.to_thread(tc.finish)
            fut.set_result({"type": "unload_model", "model_id": model_id})
        except Exception as exc:
            fut.set_exception(exc)
        return await api.submit(t, fut, lambda out: out, model_id)


def _add_training_routes(r: APIRouter, api: TinkerApi) -> None:
    """``forward_backward`` and ``forward`` (a protobuf or JSON body) and ``optim_step``."""

    async def fb(request: Request, forward: bool) -> dict[str, Any]:
        t = await api.tenant_of(request)
        if request.headers.get("content-encoding"):
            raise NotBuiltError("compressed request bodies are not accepted (client config says so)")
        proto = PROTO in request.headers.get("content-type", "")
        body: bytes | dict[str, Any] = (
            await read_body(request, api.max_body_bytes) if proto else await read_json(request, api.max_body_bytes)
        )
        # Decoding and checking a batch takes time in proportion to it: off the event loop.
        req = await asyncio.to_thread(fb_json.fb_request, api.backend, t, body, forward)

        async def run() -> dict[str, Any]:
            fut = await asyncio.to_thread(api.backend.forward_backward, t, req)
            return await api.submit(t, fut, fb_render, req["model_id"])

        digest = body_digest(request.url.path, body)  # a resend is answered once (seq_ids.py)
        return await api.seq_ids.once(t.owner, req["model_id"], req.get("seq_id"), digest, run)

    @r.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        return await fb(request, forward=False)

    @r.post("/forward")
    async def forward(request: Request) -> dict[str, Any]:
        return await fb(request, forward=True)

    @r.post("/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        render = lambda out: {"metrics": dict(out.metrics)}  # noqa: E731  (Tinker's names already)
        return await api.call(request, api.backend.optim_step, render, checks.OPTIM_STEP)


def _add_weights_routes(r: APIRouter, api: TinkerApi) -> None:
    """Saving and loading state, weights for a sampler, and what a checkpoint holds."""

    @r.post("/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        render = lambda path: {"type": "save_weights", "path": to_tinker_path(path)}  # noqa: E731
        return await api.call(request, api.weights.save_state, render, checks.SAVE)

    @r.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        return await api.call(request, api.weights.save_for_sampler, _as_is, checks.SAVE)

    @r.post("/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        return await api.call(request, api.weights.save_external, _as_is, checks.SAVE_EXTERNAL)

    @r.post("/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return await api.call(request, api.weights.load_state, _as_is, checks.LOAD)

    @r.get("/weights_info")
    @r.post("/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.WEIGHTS_INFO) if request.method == "POST" else dict(request.query_params)
        return await asyncio.to_thread(api.weights.weights_info, t, str(body.get("tinker_path") or ""))


def _add_sampling_routes(r: APIRouter, api: TinkerApi) -> None:
    """Sampling sessions, a sampler's description, and ``asample``."""

    @r.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.CREATE_SAMPLER)
        return {
            "type": "create_sampling_session",
            "sampling_session_id": await asyncio.to_thread(api.backend.create_sampler, t, body),
        }

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        row = api.backend.sampler_row(t, sampler_id)
        return {
            "sampler_id": row.sampler_id,
            "base_model": row.base_model,
            "model_path": to_tinker_path(row.model_path) if row.model_path else None,
        }

    @r.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.ASAMPLE)  # num_samples among the rest: bounded before use
        out = await api.submit(t, await asyncio.to_thread(api.backend.sample, t, body), sample_render, kind="sample")
        # Each sequence's id, in the response's order (the SDK names its SampledSequences by them).
        out["sample_sequence_ids"] = [f"{out['request_id']}-{i}" for i in range(body.get("num_samples") or 1)]
        return out


def _add_future_routes(r: APIRouter, api: TinkerApi) -> None:
    """The long poll for a call's result (``retrieve_future``), and cancelling a call."""

    @r.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.REQUEST)
        request_id = body["request_id"]
        entry = api.futures.get(t.owner, request_id)
        if entry is None:
            return _unknown_request(api, t, request_id)
        if not await api.futures.wait(entry, api.long_poll_s):  # not done yet, or the gateway is stopping
            return JSONResponse(await asyncio.to_thread(_try_again, api, t, entry.model_id, request_id))
        api.futures.drop(request_id)
        exc = entry.future.exception() if not entry.future.cancelled() else ConfigError("the request was cancelled")
        if exc is not None:
            return JSONResponse(failed(exc))
        rendered = entry.render(entry.future.result())
        if isinstance(rendered, bytes):
            return Response(rendered, media_type=PROTO)
        return JSONResponse(rendered)

    @r.post("/cancel_future")
    async def cancel_future(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.REQUEST)
        return {"cancelled": api.futures.cancel(t.owner, body["request_id"])}


def _try_again(api: TinkerApi, t: Tenant, model_id: str | None, request_id: str) -> dict[str, Any]:
    """``try_again`` with the queue state the SDK reads (``TryAgainResponse``): ``paused_capacity``
    and the run's reason while the call waits for its job to run (``TinkerRuns.queue_state``),
    which the SDK logs as "paused. Reason: ..."; ``active`` otherwise."""
    out = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    if model_id is not None and not api.futures.closing.is_set():
        out |= api.runs.queue_state(t, model_id)
    return out


def _unknown_request(api: TinkerApi, t: Tenant, request_id: str) -> Response:
    """The answer for an id this gateway process does not hold. A call an earlier process filed
    and never answered (``serve`` restarted while it ran): a sample answers 410, on which the SDK
    sends it again (sampling has no side effects); any other call fails with what is known, since
    it may or may not have taken effect. Any other id: 404."""
    lost = api.backend.store.lost_request(t.owner, request_id)
    if lost is not None:
        log.warning("request %s (%s) was lost when the gateway restarted; its client is told so", request_id, lost)
    if lost == "sample":
        message = "the server restarted while this sample ran: send it again"
        return JSONResponse(error_body(message, "gone"), status_code=410)
    if lost is not None:
        return JSONResponse(failed(ConfigError(RESTARTED_MESSAGE)))
    return JSONResponse(error_body(f"unknown request id {request_id!r}", "not_found"), status_code=404)


RESTARTED_MESSAGE = (
    "polytinker serve restarted while this call ran, and whether it took effect is not known: the run"
    " goes on from its last completed step (a forward_backward not yet stepped is lost); to be sure,"
    " resume from a checkpoint (create_training_client_from_state)"
)


def _as_is(out: Any) -> Any:
    return out


__all__ = ["CLIENT_CONFIG", "TinkerApi", "tinker_router"]
