"""Errors as the gateway's HTTP clients see them: a status, an error type, a message and an id.

A caller's mistake (a malformed body, an unknown model, a bad key, a feature not built) is a 4xx
with the message; anything else is a 500 that names only an error id, which the gateway's log
carries next to the traceback. The body has OpenAI's shape, which both the ``openai`` and the
``tinker`` SDK print: ``{"error": {"message", "type", "code", "error_id"}}``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from polytinker.errors import (
    AuthError,
    ConfigError,
    JobNotRunning,
    NotBuiltError,
    OverloadedError,
    PolytinkerError,
    ProtocolError,
)

log = logging.getLogger("polytinker.http")

# (error class, HTTP status, OpenAI-style type); the first match wins.
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (AuthError, 401, "authentication_error"),
    (NotBuiltError, 400, "not_built"),
    (OverloadedError, 429, "rate_limit_error"),
    (JobNotRunning, 409, "job_not_running"),
    (ConfigError, 400, "invalid_request_error"),
    (ProtocolError, 400, "invalid_request_error"),
    (ValueError, 400, "invalid_request_error"),
    (TypeError, 400, "invalid_request_error"),
    (KeyError, 400, "invalid_request_error"),
)


def user_error(message: str, kind: str = "invalid_request_error", code: str = "") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code or kind, "error_id": uuid.uuid4().hex[:12]}}


def classify(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of ``exc``; a 500 is logged with its traceback under its error id."""
    for cls, status, kind in _STATUS:
        if isinstance(exc, cls):
            message = str(exc) if not isinstance(exc, KeyError) else f"missing field {exc}"
            code = getattr(exc, "code", "") if isinstance(exc, PolytinkerError) else ""
            return status, user_error(message[:2000], kind, code or kind)
    body = user_error("", "server_error", "internal")
    error_id = body["error"]["error_id"]
    body["error"]["message"] = f"internal error (error id {error_id}); the runtime's log has the details"
    log.error("internal error %s: %s", error_id, type(exc).__name__, exc_info=exc)
    return 500, body


__all__ = ["classify", "user_error"]
