"""Errors as the gateway's HTTP clients see them: a status, an error type, a message and an id.

A caller's mistake (a malformed body, an unknown model, a bad key, a feature not built) is a 4xx
with the message; anything else is a 500 that names only an error id, which the gateway's log
carries next to the traceback. The body has OpenAI's shape, which both the ``openai`` and the
``tinker`` SDK print: ``{"error": {"message", "type", "param", "code", "error_id"}}``.

A message never carries a path of the server's filesystem (``transport.protocol.scrub_paths``):
errors relayed from the scheduler or a worker may name the files they failed on, and those are
the runtime's, not the tenant's. ``tinker://`` and ``polytinker://`` names (the tenant's own) pass unchanged.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from polytinker.errors import (
    AuthError,
    ConfigError,
    JobNotRunning,
    NotBuiltError,
    OverloadedError,
    PolytinkerError,
    ProtocolError,
    RequestKeyReused,
    RequestTimeout,
    RuntimeDead,
    TransportError,
)
from polytinker.transport.protocol import scrub_paths

log = logging.getLogger("polytinker.http")


# Not in polytinker.errors: no polytinker caller ever catches it. The gateway raises it inside its
# own request handling and turns it into the HTTP error body at once; an HTTP client (the tinker
# or openai SDK) sees the status and the body, never this class.
class HttpError(PolytinkerError):
    """A request answered with ``status`` (413, 404, ...) and this message, raised at the edge."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str = "") -> None:
        super().__init__(message)
        self.status, self.kind, self.error_code = status, kind, code or kind


# (error class, HTTP status, error type, code); the first match wins. ValueError, TypeError and
# KeyError come from reading a request's fields (int("x"), a missing key): the caller's mistake.
_STATUS: tuple[tuple[type[BaseException], int, str, str], ...] = (
    (AuthError, 401, "authentication_error", "invalid_api_key"),
    (NotBuiltError, 400, "invalid_request_error", "not_built"),
    (OverloadedError, 429, "rate_limit_error", "overloaded"),
    (JobNotRunning, 409, "invalid_request_error", "job_not_running"),
    (RequestTimeout, 504, "server_error", "timeout"),
    # A request key reused for other fields: a conflict with the call that used it first, as a reused seq_id is.
    (RequestKeyReused, 409, "invalid_request_error", "request_key_reused"),
    (ConfigError, 400, "invalid_request_error", "invalid_request"),
    (ProtocolError, 400, "invalid_request_error", "invalid_request"),
    # A worker or the scheduler restarting, or the runtime stopped: the server's state, not the
    # caller's fault, and what an SDK retries (503).
    (RuntimeDead, 503, "server_error", "runtime_stopped"),
    (TransportError, 503, "server_error", "unavailable"),
    (KeyError, 400, "invalid_request_error", "invalid_request"),
    (ValueError, 400, "invalid_request_error", "invalid_request"),
    (TypeError, 400, "invalid_request_error", "invalid_request"),
)


def error_body(message: str, kind: str = "invalid_request_error", code: str = "") -> dict[str, Any]:
    """The error body every answer of the gateway uses (its message scrubbed of server paths)."""
    error = {
        "message": scrub_paths(message),
        "type": kind,
        "param": None,
        "code": code or kind,
        "error_id": uuid.uuid4().hex[:12],
    }
    return {"error": error}


def classify(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of ``exc``; a 500 is logged with its traceback under its error id."""
    if isinstance(exc, HttpError):
        return exc.status, error_body(str(exc), exc.kind, exc.error_code)
    for cls, status, kind, code in _STATUS:
        if isinstance(exc, cls):
            message = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            return status, error_body(message[:2000], kind, code)
    body = error_body("", "server_error", "internal_error")
    error_id = body["error"]["error_id"]
    body["error"]["message"] = f"internal error (error id {error_id}); the runtime's log has the details"
    log.error("internal error %s: %s", error_id, type(exc).__name__, exc_info=exc)
    return 500, body


def error_response(exc: BaseException) -> JSONResponse:
    """The answer to a request that raised ``exc`` (with ``retry-after`` when overloaded)."""
    status, body = classify(exc)
    headers = {"retry-after": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, OverloadedError) else None
    if status == 503:
        headers = {"retry-after": "2"}  # a worker or the scheduler restarts in seconds
    return JSONResponse(body, status_code=status, headers=headers)


__all__ = ["HttpError", "classify", "error_body", "error_response"]
