"""Reading requests at the gateway's edge: the API key, bodies bounded in size and shape, and the
values of a Tinker request that several calls read (a prompt's tokens, a TTL); and the one
spelling of times in answers (``iso_time``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import Request

from polytinker.errors import ConfigError, NotBuiltError
from polytinker.scheduler.http.errors import HttpError

MAX_JSON_DEPTH = 32


def iso_time(ts: float) -> str:
    """A Unix time as the Tinker API answers times: ISO 8601 in UTC."""
    return datetime.fromtimestamp(ts, UTC).isoformat()


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


def ttl_of(req: dict[str, Any]) -> int | None:
    """A request's ``ttl_seconds`` (None: kept); a ConfigError unless a positive whole number."""
    ttl = req.get("ttl_seconds")
    if ttl is None:
        return None
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl <= 0:
        raise ConfigError(f"ttl_seconds must be a positive number of seconds or null, got {ttl!r}")
    return ttl


def prompt_ints(prompt: Any) -> tuple[int, ...]:
    """Token ids of a Tinker ModelInput as JSON (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise ConfigError("prompt must be a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}")
    out: list[int] = []
    for chunk in prompt["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise NotBuiltError("only encoded_text prompt chunks are built (no images or audio)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in tokens):
            raise ConfigError("an encoded_text chunk's tokens must be a list of ints")
        out.extend(tokens)
    if not out:
        raise ConfigError("the prompt needs at least one token")
    return tuple(out)


__all__ = [
    "api_key",
    "prompt_ints",
    "read_body",
    "read_json",
    "ttl_of",
]
