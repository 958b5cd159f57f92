"""Reading requests at the gateway's edge: the API key, bodies bounded in size and shape, and the
values of a Tinker request that several calls read (a prompt's tokens, a TTL); and the one
spelling of times in answers (``iso_time``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway.errors import HttpError
from polytinker.scheduler.service.messages import MAX_TTL_S

MAX_INT32 = (1 << 31) - 1

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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise HttpError(413, f"the request body is larger than {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the caller's doing, not a fault of the gateway: no traceback in the log
        raise HttpError(400, "the client went away before its request body was in") from None
    return b"".join(chunks)


def depth_ok(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests no deeper than ``limit``."""
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
    if not depth_ok(value, MAX_JSON_DEPTH):
        raise ConfigError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def ttl_of(req: dict[str, Any]) -> int | None:
    """A request's ``ttl_seconds`` (None: kept); a ConfigError unless a positive whole number of
    seconds the scheduler keeps (up to ten years)."""
    ttl = req.get("ttl_seconds")
    if ttl is None:
        return None
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 0 < ttl <= MAX_TTL_S:
        raise ConfigError(f"ttl_seconds must be null or a whole number of seconds in 1..{int(MAX_TTL_S)}, got {ttl!r}")
    return ttl


MAX_PROMPT_CHUNKS = 4096
MAX_PROMPT_TOKENS = 1 << 20  # well past any served model's context


def prompt_ints(prompt: Any) -> tuple[int, ...]:
    """Token ids of a Tinker ModelInput as JSON (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``):
    ints in 0..2**31-1 (the model's vocabulary is the caller's to check), counted before they are kept."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or len(chunks) > MAX_PROMPT_CHUNKS:
        raise ConfigError(
            "prompt must be a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}, "
            f"at most {MAX_PROMPT_CHUNKS} chunks"
        )
    out: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise NotBuiltError(f"prompt.chunks[{i}]: only encoded_text prompt chunks are built (no images or audio)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or len(out) + len(tokens) > MAX_PROMPT_TOKENS:
            raise ConfigError(
                f"prompt.chunks[{i}].tokens must be a list of token ids, at most {MAX_PROMPT_TOKENS} in all"
            )
        bad = next((j for j, x in enumerate(tokens) if type(x) is not int or not 0 <= x <= MAX_INT32), None)
        if bad is not None:
            raise ConfigError(f"prompt.chunks[{i}].tokens[{bad}] must be a token id (a whole number >= 0)")
        out.extend(tokens)
    if not out:
        raise ConfigError("prompt must hold at least one token")
    return tuple(out)


__all__ = [
    "MAX_JSON_DEPTH",
    "api_key",
    "depth_ok",
    "prompt_ints",
    "read_body",
    "read_json",
    "ttl_of",
]
