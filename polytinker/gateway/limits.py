"""What one tenant may hold of the gateway at a time, so that no tenant's requests exhaust it for
the others: the bytes of request bodies in flight (every route) and uploads in progress (routes
that take them from anyone holding a key, such as telemetry).

``InFlight`` counts an amount per key and in total, each bounded. ``BodyBudget`` is the ASGI
middleware that charges each request's body to its API key: a body that declares its length is
charged at once, before any of it is read, and refused with a 429 (``retry-after``) when the key or
the gateway has too many bytes in flight; a body without a declared length is charged as it
arrives. What a request holds is given back when its answer is sent. The key is not checked
here (the routes authenticate): an unknown key only ever reaches the total.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from polytinker.errors import ConfigError, OverloadedError
from polytinker.gateway.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

RETRY_AFTER_S = 1.0  # what a refused caller is told to wait: a body in flight is usually seconds from done


class InFlight:
    """An amount held per key and in total, at most ``per_key`` and ``total``."""

    def __init__(self, per_key: int, total: int) -> None:
        if per_key <= 0 or total <= 0:
            raise ConfigError("InFlight: bounds must be > 0")
        self.per_key, self.total = per_key, total
        self._held: dict[str, int] = {}
        self._sum = 0
        self._lock = threading.Lock()

    def take(self, key: str, n: int) -> bool:
        """Hold ``n`` more for ``key`` if both bounds allow it; False (nothing held) if not."""
        with self._lock:
            mine = self._held.get(key, 0)
            if mine + n > self.per_key or self._sum + n > self.total:
                return False
            self._held[key] = mine + n
            self._sum += n
            return True

    def give(self, key: str, n: int) -> None:
        with self._lock:
            left = self._held.get(key, 0) - n
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
            self._sum -= n

    def held(self, key: str | None = None) -> int:
        with self._lock:
            return self._sum if key is None else self._held.get(key, 0)


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return ""


def scope_key(scope: Scope) -> str:
    """The API key a request names (``X-API-Key`` or ``Authorization: Bearer``), as ``wire.api_key``."""
    key = _header(scope, b"x-api-key")
    if not key:
        auth = _header(scope, b"authorization")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    return key


def too_busy(message: str) -> JSONResponse:
    """The 429 answer (as ``errors.error_response`` gives an OverloadedError)."""
    body = error_body(message, "rate_limit_error", "overloaded")
    return JSONResponse(body, status_code=429, headers={"retry-after": str(round(RETRY_AFTER_S))})


class BodyBudget:
    """ASGI middleware: request bodies charged to their API key in an ``InFlight`` of bytes."""

    def __init__(self, app: ASGIApp, *, budget: InFlight) -> None:
        self.app, self.budget = app, budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = scope_key(scope)
        declared = _header(scope, b"content-length")
        held = 0
        if declared.isdigit() and int(declared) <= self.budget.per_key:
            # Charged whole before a byte is read: a caller over its bound gets its 429 at once.
            # (A body declared larger than any key may hold is the route's to refuse: a 413.)
            held = int(declared)
            if held and not self.budget.take(key, held):
                await too_busy(self._refusal(key, held))(scope, receive, send)
                return
            try:
                await self.app(scope, receive, send)
            finally:
                self.budget.give(key, held)
            return
        charged = 0

        async def counted() -> Message:
            nonlocal charged
            message = await receive()
            n = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if n:
                if not self.budget.take(key, n):
                    raise OverloadedError(self._refusal(key, n), RETRY_AFTER_S)
                charged += n
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.budget.give(key, charged)

    def _refusal(self, key: str, n: int) -> str:
        if self.budget.held(key) + n > self.budget.per_key:
            return f"this key has too many request bytes in flight (at most {self.budget.per_key}): try again soon"
        total = self.budget.total
        return f"the gateway has too many request bytes in flight (at most {total} over all keys): try again soon"


__all__ = ["BodyBudget", "InFlight", "scope_key", "too_busy"]
