"""Reading requests at the gateway's edge: the API key, and bodies bounded in size and shape."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from polytinker.errors import ConfigError
from polytinker.scheduler.http.errors import HttpError

MAX_JSON_DEPTH = 32


def api_key(request: Request) -> str:
    """The caller's key: ``X-API-Key`` (the tinker SDK) or ``Authorization: Bearer`` (OpenAI clients)."""
    key = request.headers.get("x-api-key", "")
    if not key:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    return key


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused past ``max_bytes`` while it streams in (not after it is all in memory)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(413, f"the request body is larger than {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HttpError(413, f"the request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _depth_ok(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: bounded in size and nesting depth; ConfigError when it is not one."""
    raw = await read_body(request, max_bytes)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise ConfigError("the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise ConfigError("the request body must be a JSON object")
    if not _depth_ok(value, MAX_JSON_DEPTH):
        raise ConfigError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


__all__ = ["api_key", "read_body", "read_json"]
