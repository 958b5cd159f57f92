"""The Tinker API's routes over what training leaves behind: training runs, their checkpoints and
sessions as the SDK's ``RestClient`` reads and changes them (tinker_runs.py does the work;
downloads.py holds the signed URLs of exported weights), and each tenant's audit log, usage and
storage as its ``AdminClient`` reads them (tinker_admin.py). ``tinker_router`` (tinker_api.py)
adds them beside the calls of training and sampling, with what every route shares (``TinkerApi``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from polytinker.errors import ConfigError
from polytinker.gateway import checks
from polytinker.gateway.errors import error_body
from polytinker.gateway.tinker_admin import TinkerAdmin
from polytinker.gateway.wire import ttl_of

if TYPE_CHECKING:
    from polytinker.gateway.tinker_api import TinkerApi


def add_run_routes(r: APIRouter, api: TinkerApi) -> None:
    """Training runs, checkpoints and sessions, as the SDK's RestClient reads them. Plain functions:
    FastAPI runs them on its thread pool, as they wait on the scheduler."""
    runs = api.runs

    @r.get("/training_runs")
    def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return runs.training_runs(api.tenant(request), _page(limit), _page(offset))

    @r.get("/training_runs/{run_id}")
    def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
        return runs.training_run(api.tenant(request), run_id)

    @r.get("/training_runs/{run_id}/checkpoints")
    def list_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return {"checkpoints": runs.checkpoints(api.tenant(request), run_id), "cursor": None}

    @r.get("/downloads/{token}/{file_name}")
    def download(token: str, file_name: str) -> Response:
        # A signed URL: the token is the capability, no key (downloads.py).
        data = runs.downloads.get(token, file_name)
        if data is None:
            return JSONResponse(error_body("unknown or expired download URL", "not_found"), status_code=404)
        return Response(data, media_type="application/octet-stream")

    @r.get("/checkpoints")
    def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return runs.user_checkpoints(api.tenant(request), _page(limit), _page(offset))

    @r.get("/sessions")
    def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return runs.sessions(api.tenant(request), _page(limit), _page(offset))

    @r.get("/sessions/{session_id}")
    def get_session(session_id: str, request: Request) -> dict[str, Any]:
        return runs.session(api.tenant(request), session_id)


def add_checkpoint_routes(r: APIRouter, api: TinkerApi) -> None:
    """What the SDK does to a run's checkpoints: copy, publish, delete, TTL, download URLs."""
    runs = api.runs

    @r.post("/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        body = await api.json(request, checks.COPY)
        token = request.headers.get("x-tinker-weights-access-token")
        return await asyncio.to_thread(runs.copy_weights, t, body, token)

    # Before the delete route below: its {checkpoint_id:path} would take ".../publish" too.
    @r.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    def publish_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        runs.publish(api.tenant(request), run_id, checkpoint_id, True)
        return {}

    @r.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    def unpublish_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        runs.publish(api.tenant(request), run_id, checkpoint_id, False)
        return {}

    @r.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        runs.delete_checkpoint(api.tenant(request), run_id, checkpoint_id)
        return {}

    @r.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        t = await api.tenant_of(request)
        ttl = ttl_of(await api.json(request, checks.SET_TTL))
        await asyncio.to_thread(runs.set_ttl, t, run_id, checkpoint_id, ttl)
        return {}

    @r.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    def external_weights_urls(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return runs.external_urls(api.tenant(request), run_id, checkpoint_id, str(request.base_url))


def add_admin_routes(r: APIRouter, api: TinkerApi) -> None:
    """What the SDK's AdminClient reads: each tenant's own audit log, usage and storage."""
    admin = TinkerAdmin(api.backend)

    @r.get("/audit")
    def audit_log(request: Request, event_type: str = "all", day: str | None = None) -> dict[str, Any]:
        return admin.audit_log(api.tenant(request), event_type, day)

    @r.get("/billing/usage/events")
    def usage_events(request: Request, starting_on: str, ending_before: str) -> dict[str, Any]:
        return admin.usage(api.tenant(request), starting_on, ending_before)

    @r.get("/billing/usage/checkpoints/current")
    def storage_usage(request: Request) -> dict[str, Any]:
        return admin.storage(api.tenant(request))


def _page(n: int) -> int:
    """A pagination bound from the query string: at least 0, at most 10000."""
    if n < 0:
        raise ConfigError("limit and offset must not be negative")
    return min(n, 10_000)


__all__ = ["add_admin_routes", "add_checkpoint_routes", "add_run_routes"]
