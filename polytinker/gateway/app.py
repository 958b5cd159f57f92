"""The HTTP front door: the Tinker API and OpenAI-compatible inference in front of one scheduler.

``Gateway(scheduler_address, state_dir, config)`` builds the FastAPI app and serves it with
uvicorn on its own thread; ``polytinker serve --http HOST:PORT`` runs one next to the scheduler
(and ``polytinker gateway`` alone, for a scheduler elsewhere). It is a client of the scheduler:
the scheduler authenticates every API key and decides every job; the gateway keeps only the
names the Tinker API needs (``gateway.sqlite``) and the results waiting to be polled.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polytinker.errors import ConfigError, PolytinkerError
from polytinker.gateway.downloads import SignedDownloads
from polytinker.gateway.errors import error_body, error_response
from polytinker.gateway.futures import FutureTable
from polytinker.gateway.limits import BodyBudget, InFlight
from polytinker.gateway.openai_api import openai_router
from polytinker.gateway.tinker_api import tinker_router
from polytinker.gateway.tinker_backend import TinkerBackend
from polytinker.scheduler.service.http_config import HttpConfig, host_port
from polytinker.transport import ClientCurve

log = logging.getLogger("polytinker.http")


def create_app(backend: TinkerBackend, config: HttpConfig) -> FastAPI:
    """The gateway's app, with the limits of ``config``."""
    app = FastAPI(title="polytinker", docs_url=None, redoc_url=None, openapi_url=None)
    # Request bytes in flight, in multiples of the largest body, per key and over all keys, so
    # that no tenant's uploads take all the memory bodies may.
    app.state.body_budget = InFlight(
        config.max_bodies_in_flight_per_tenant * config.max_body_bytes,
        config.max_bodies_in_flight * config.max_body_bytes,
    )
    app.add_middleware(BodyBudget, budget=app.state.body_budget)
    # Ids older than a result is kept are of no use to anyone: a client would have read them by now.
    backend.store.forget_requests_before(time.time() - config.future_ttl_s)
    futures = FutureTable(
        ttl_s=config.future_ttl_s, max_per_tenant=config.max_futures_per_tenant, journal=backend.store
    )
    app.state.futures = futures
    app.state.downloads = SignedDownloads(
        max_per_tenant=config.max_download_urls_per_tenant,
        max_tenant_bytes=config.max_download_bytes_per_tenant,
        max_entries=config.max_download_urls,
        max_bytes=config.max_download_bytes,
    )
    app.include_router(tinker_router(backend, futures, config, app.state.downloads))
    app.include_router(openai_router(backend, default_max_tokens=config.default_max_tokens))

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    # The caller's errors by class (Starlette re-raises what reaches the catch-all Exception
    # handler, so the server logs it as a crash); everything else through the catch-all.
    for cls in (PolytinkerError, ValueError, TypeError, KeyError, Exception):
        app.add_exception_handler(cls, answer)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), "not_found" if exc.status_code == 404 else "http_error"),
            status_code=exc.status_code,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {exc.errors()[:3]}"), status_code=400)

    return app


class Gateway:
    """The app served by uvicorn on a daemon thread; ``address`` is where it listens."""

    def __init__(
        self,
        scheduler_address: str,
        state_dir: Path | str,
        config: HttpConfig,
        *,
        base_models: tuple[str, ...] = (),
        curve: ClientCurve | None = None,
        tokenizer_ids: dict[str, str] | None = None,
    ) -> None:
        import uvicorn

        self.config = config
        self.backend = TinkerBackend(
            scheduler_address,
            Path(state_dir),
            curve=curve,
            base_models=base_models,
            default_max_tokens=config.default_max_tokens,
            tokenizer_ids=tokenizer_ids,
            session_timeout_s=config.session_timeout_s,
        )
        host, port = host_port(config.address or "127.0.0.1:0")
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.url = f"http://{self.address}"
        self.app = create_app(self.backend, config)
        self._futures: FutureTable = self.app.state.futures
        server_config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(server_config)
        self._thread = threading.Thread(target=self._run, name="polytinker-http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self) -> Gateway:
        self._thread.start()
        for _ in range(500):
            if self._server.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self._server.started:
            raise ConfigError(f"the HTTP gateway did not start on {self.address}")
        self.backend.sessions.start()  # ends sessions whose client went silent (sessions.py)
        log.info("HTTP gateway (Tinker API, OpenAI-compatible) at %s", self.url)
        return self

    def stop(self) -> None:
        # First stop answering results: the long polls end at once, and a call the stop cuts off is
        # never reported as failed; its id stays in the store, so a restarted gateway says it was lost.
        self._futures.closing.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        self._futures.close()  # the request journal's last writes, before its store closes
        self.backend.close()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["Gateway", "HttpConfig", "create_app"]
