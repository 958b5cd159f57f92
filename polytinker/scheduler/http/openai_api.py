"""OpenAI-compatible inference: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

An agent written with the ``openai`` package talks to the scheduler through these routes
(docs/openai.md). ``model`` names a base model or an adapter version
(``tinker://JOB/sampler_weights/AGENT@V``); the client's ``api_key`` is a tenant's key of the
runtime. Besides OpenAI's fields each choice carries ``prompt_token_ids``, ``token_ids`` and
``token_logprobs`` (the sampler's), so every call an agent makes is training data as it stands.

Requests are decoded into pydantic models at the edge; a malformed one is a 400 in OpenAI's
error shape, never a traceback. Sampling runs on the client's futures (``asyncio.wrap_future``),
tokenizing on worker threads: nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polytinker.engine.models import load_tokenizer
from polytinker.errors import (
    AuthError,
    ConfigError,
    JobNotRunning,
    NotBuiltError,
    OverloadedError,
    PolytinkerError,
    ProtocolError,
    RequestTimeout,
)
from polytinker.scheduler.service.messages import SamplingMsg

if TYPE_CHECKING:
    from polytinker.scheduler.client._connection import SampledSequence
    from polytinker.scheduler.client.sampling_client import SamplingClient
    from polytinker.scheduler.http.tinker_backend import Tenant, TinkerBackend

log = logging.getLogger("polytinker.http")


# --- requests ---------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields of newer API versions are ignored, as by vLLM


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1, max_length=1000)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): -1 or 0 is none
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # extension (vLLM's)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class _Part(_Body):
    type: str
    text: str | None = None


class _FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class _ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Body):
    type: Literal["function"] = "function"
    function: _FunctionDef


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[_Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


# --- errors -----------------------------------------------------------------------------------------
class _HttpError(PolytinkerError):
    """A request answered with ``status`` and OpenAI's error body (raised and caught in this module)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str = "") -> None:
        super().__init__(message)
        self.status, self.kind, self.error_code = status, kind, code or kind


def _error(status: int, message: str, kind: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(exc: BaseException) -> JSONResponse:
    """The answer to a request that raised ``exc``: a 4xx with its message for the caller's
    mistakes, else a 500 naming an error id whose traceback is in the log."""
    if isinstance(exc, _HttpError):
        return _error(exc.status, str(exc), exc.kind, exc.error_code)
    if isinstance(exc, AuthError):
        return _error(401, str(exc), "authentication_error", "invalid_api_key")
    if isinstance(exc, NotBuiltError):
        return _error(400, str(exc), "invalid_request_error", "not_built")
    if isinstance(exc, ConfigError | ProtocolError):
        return _error(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, OverloadedError):
        retry = {"retry-after": str(max(1, round(exc.retry_after_s)))}
        return _error(429, str(exc), "rate_limit_error", "overloaded", retry)
    if isinstance(exc, JobNotRunning):
        return _error(409, str(exc), "invalid_request_error", "job_not_running")
    if isinstance(exc, RequestTimeout):
        return _error(504, str(exc), "server_error", "timeout")
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s in an OpenAI API call", error_id, exc_info=exc)
    return _error(
        500,
        f"internal error (error id {error_id}); the gateway's log has the details",
        "server_error",
        "internal_error",
    )


def _validation_message(exc: ValidationError) -> str:
    parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False)[:5]]
    return "invalid request: " + "; ".join(parts)


async def _read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, refused past ``max_bytes`` while it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _HttpError(413, f"the request body is larger than {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _HttpError(413, f"the request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    try:
        value = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise _HttpError(400, "the request body is not JSON") from None
    if not isinstance(value, dict):
        raise _HttpError(400, "the request body must be a JSON object")
    return value


def _api_key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not key:
        raise AuthError("no API key: pass a key of this runtime as the openai client's api_key (Authorization: Bearer)")
    return key


# --- tokens -----------------------------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes-to-unicode map, inverted: the characters of a byte-level BPE token to its bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # the rest map to 256, 257, ... in order
    pairs = [(b, b) for b in printable] + [(b, 256 + k) for k, b in enumerate(others)]
    return {chr(c): b for b, c in pairs}


_BYTE_DECODER = _byte_decoder()


class Vocab:
    """A base model's tokenizer behind a lock (one HF tokenizer is not safe across threads), with
    what the routes ask of it: chat prompts, prompt ids and each sampled token's bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.lock = tokenizer, threading.Lock()
        self.size = len(tokenizer)
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.has_template = bool(template)
        self.template_tools = "tools" in template  # the template renders the tool list itself
        self.template_tool_calls = "tool_calls" in template
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        limit = getattr(tokenizer, "model_max_length", 0)
        self.context = int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else 0

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        if not self.has_template:
            raise ConfigError("this model has no chat template: use /v1/completions with a prompt string")
        with self.lock:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # the template rejects the conversation (roles, order)
                raise ConfigError(f"the model's chat template refused the messages: {str(exc)[:500]}") from None
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return [int(i) for i in self.tokenizer(text, add_special_tokens=True)["input_ids"]]

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's bytes (a byte-level BPE token may hold part of a UTF-8 character)."""
        with self.lock:
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            out = []
            for i, piece in zip(ids, pieces, strict=True):
                if self.byte_level and i not in self.special_ids and all(ch in _BYTE_DECODER for ch in piece):
                    out.append(bytes(_BYTE_DECODER[ch] for ch in piece))
                else:
                    out.append(str(self.tokenizer.decode([i])).encode("utf-8"))
            return out


class _Vocabs:
    """One Vocab per base model, loaded once."""

    def __init__(self) -> None:
        self._by_model: dict[str, Vocab] = {}
        self._lock = threading.Lock()

    def get(self, base_model: str) -> Vocab:
        with self._lock:  # loading twice at once would only waste time; one lock keeps it simple
            found = self._by_model.get(base_model)
            if found is None:
                found = self._by_model[base_model] = Vocab(load_tokenizer(base_model))
            return found


# --- chat prompts and tool calls --------------------------------------------------------------------
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _text(content: str | list[_Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text":
            raise NotBuiltError(f"message content parts of type {part.type!r} are not built (text parts are)")
    return "".join(p.text or "" for p in content)


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _tool_call_text(call: _ToolCall) -> str:
    body = {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """What a system message says about ``tools`` when the chat template does not render them."""
    listing = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, answer with a JSON object inside <tool_call></tool_call> tags, one per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )


def chat_messages(req: ChatRequest, vocab: Vocab) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render with the model's chat template."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tool_choice != "none" else []
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        d: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": _text(msg.content)}
        if msg.name:
            d["name"] = msg.name
        if msg.tool_call_id:
            d["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls and vocab.template_tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in msg.tool_calls
            ]
        elif msg.tool_calls:  # the template knows no tool calls: they go back as the model wrote them
            d["content"] = "\n".join([d["content"], *map(_tool_call_text, msg.tool_calls)]).lstrip("\n")
        out.append(d)
    if not tools or vocab.template_tools:
        return out, tools or None
    prompt = tools_prompt(tools)
    if out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _call(value: Any, names: frozenset[str]) -> dict[str, Any] | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    if not isinstance(args, dict):
        return None
    function = {"name": value["name"], "arguments": json.dumps(args)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``(content, tool_calls)`` when ``text`` calls tools named in ``names``, else None.

    A call is a JSON object ``{"name": ..., "arguments": {...}}`` (``parameters`` is read as
    ``arguments``; arguments may be a JSON string). Detected: one or more
    ``<tool_call>...</tool_call>`` blocks, each holding one call (the text around them is the
    content), or the whole text, stripped, being one call or a JSON list of calls."""
    blocks = TOOL_CALL_RE.findall(text)
    if blocks:
        calls = [_call(_json(b), names) for b in blocks]
        if not all(calls):
            return None
        content = TOOL_CALL_RE.sub("", text).strip() or None
        return content, [c for c in calls if c is not None]
    value = _json(text.strip())
    values = value if isinstance(value, list) and value else [value]
    calls = [_call(v, names) for v in values]
    if not all(calls):
        return None
    return None, [c for c in calls if c is not None]


# --- responses --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sampled:
    """One choice: the prompt it continues and the sampled sequence."""

    index: int
    prompt_ids: list[int]
    seq: SampledSequence


def _finish(seq: SampledSequence) -> str:
    return "length" if seq.stop_reason == "length" else "stop"


def _extension(s: _Sampled) -> dict[str, Any]:
    return {"prompt_token_ids": s.prompt_ids, "token_ids": list(s.seq.tokens), "token_logprobs": list(s.seq.logprobs)}


def _usage(sampled: list[_Sampled], prompts: list[list[int]]) -> dict[str, int]:
    prompt = sum(map(len, prompts))
    completion = sum(len(s.seq.tokens) for s in sampled)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(vocab: Vocab, seq: SampledSequence) -> dict[str, Any]:
    pieces = vocab.token_bytes(list(seq.tokens))
    content = [
        {"token": b.decode("utf-8", "replace"), "logprob": float(lp), "bytes": list(b), "top_logprobs": []}
        for b, lp in zip(pieces, seq.logprobs, strict=True)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(vocab: Vocab, seq: SampledSequence) -> dict[str, Any]:
    pieces = vocab.token_bytes(list(seq.tokens))
    offsets, text = [], b""
    for token_id, b in zip(seq.tokens, pieces, strict=True):
        offsets.append(len(text.decode("utf-8", "ignore")))
        if token_id not in vocab.special_ids:  # the text leaves special tokens out
            text += b
    return {
        "tokens": [b.decode("utf-8", "replace") for b in pieces],
        "token_logprobs": [float(x) for x in seq.logprobs],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _chat_choice(s: _Sampled, vocab: Vocab, want_logprobs: bool, tool_names: frozenset[str]) -> dict[str, Any]:
    parsed = parse_tool_calls(s.seq.text, tool_names) if tool_names else None
    message: dict[str, Any] = {"role": "assistant", "content": s.seq.text, "refusal": None}
    finish = _finish(s.seq)
    if parsed is not None:
        message["content"], message["tool_calls"] = parsed
        finish = "tool_calls"
    logprobs = _chat_logprobs(vocab, s.seq) if want_logprobs else None
    return {"index": s.index, "message": message, "logprobs": logprobs, "finish_reason": finish, **_extension(s)}


def _chat_chunks(head: dict[str, Any], choices: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The chunks of finished choices: per choice its role, its content (and tool calls), its end."""
    for c in choices:
        i, message = c["index"], c["message"]
        yield {
            **head,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        if delta or c["logprobs"]:
            yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}]}
        end = {k: v for k, v in c.items() if k not in ("message", "logprobs")}
        yield {**head, "choices": [{**end, "delta": {}, "logprobs": None}]}


def _completion_chunks(head: dict[str, Any], choices: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for c in choices:
        yield {
            **head,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}],
        }
        yield {**head, "choices": [{**c, "text": "", "logprobs": None}]}


def _sse(chunks: Iterator[dict[str, Any]], usage: dict[str, Any] | None, head: dict[str, Any]) -> StreamingResponse:
    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        if usage is not None:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


# --- the routes -----------------------------------------------------------------------------------
def _not_built(req: _Sampling) -> None:
    if req.frequency_penalty or req.presence_penalty:
        raise NotBuiltError("frequency_penalty and presence_penalty are not built (send 0 or leave them out)")
    if req.logit_bias:
        raise NotBuiltError("logit_bias is not built")


def _chat_not_built(req: ChatRequest) -> None:
    if req.top_logprobs:
        raise NotBuiltError("top_logprobs is not built: logprobs=true gives the sampled tokens' logprobs")
    if req.tool_choice not in (None, "auto", "none"):
        raise NotBuiltError("tool_choice 'required' or a named function is not built (auto and none are)")
    if req.response_format and req.response_format.get("type") != "text":
        raise NotBuiltError("response_format other than text (JSON mode, JSON schema) is not built")


def _completion_not_built(req: CompletionRequest) -> None:
    if req.echo:
        raise NotBuiltError("echo is not built (the response's prompt_token_ids hold the prompt)")
    if req.suffix:
        raise NotBuiltError("suffix (fill-in-the-middle) is not built")
    if req.best_of not in (None, 1, req.n):
        raise NotBuiltError("best_of is not built (leave it out, or equal to n)")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 16 or not all(stops) or any(len(s) > 1000 for s in stops):
        raise ConfigError("stop takes at most 16 non-empty strings of at most 1000 characters")
    return stops


def _head(kind: str, model: str) -> dict[str, Any]:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


def _include_usage(req: _Sampling) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


@dataclass(frozen=True)
class _Limits:
    default_max_tokens: int
    max_tokens: int
    n: int
    body_bytes: int


class _Routes:
    """What each route does; every public method answers errors in OpenAI's shape itself, so the
    router behaves the same in any app that includes it."""

    def __init__(self, backend: TinkerBackend, limits: _Limits) -> None:
        self.backend, self.limits = backend, limits
        self.vocabs = _Vocabs()
        self.created = int(time.time())

    # --- the request's parts ------------------------------------------------------------------------
    async def tenant(self, request: Request) -> Tenant:
        return await asyncio.to_thread(self.backend.tenant, _api_key(request))

    async def body(self, request: Request, kind: type[ChatRequest] | type[CompletionRequest]) -> Any:
        raw = await _read_json(request, self.limits.body_bytes)
        try:
            return kind.model_validate(raw)
        except ValidationError as exc:
            raise _HttpError(400, _validation_message(exc)) from None

    async def target(self, t: Tenant, model: str) -> tuple[SamplingClient, Vocab]:
        spec = {"model_path": model} if model.startswith("tinker://") else {"base_model": model}
        try:
            sc = await asyncio.to_thread(self.backend.sampling_client, t, spec)
        except (ConfigError, AuthError) as exc:
            raise _HttpError(404, f"model {model!r} is not served here: {exc}", code="model_not_found") from None
        return sc, await asyncio.to_thread(self.vocabs.get, sc.base_model)

    def params(self, req: _Sampling, max_tokens: int | None, choices: int) -> SamplingMsg:
        _not_built(req)
        if choices > self.limits.n:
            raise _HttpError(400, f"n is at most {self.limits.n} here (over all prompts of a call), got {choices}")
        tokens = max_tokens or self.limits.default_max_tokens
        if tokens > self.limits.max_tokens:
            raise _HttpError(400, f"max_tokens is at most {self.limits.max_tokens} here, got {tokens}")
        return SamplingMsg(
            max_tokens=tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            stop=_stops(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            seed=None if req.seed is None else req.seed % (1 << 63),
        )

    @staticmethod
    def check_prompt(vocab: Vocab, ids: list[int], p: SamplingMsg) -> None:
        if not ids:
            raise _HttpError(400, "the prompt needs at least one token")
        if any(not 0 <= i < vocab.size for i in ids):
            raise _HttpError(400, f"prompt token ids must be in 0..{vocab.size - 1}")
        if vocab.context and len(ids) + p.max_tokens > vocab.context:
            raise _HttpError(
                400,
                f"the prompt ({len(ids)} tokens) and max_tokens ({p.max_tokens}) exceed the "
                f"model's context of {vocab.context} tokens",
                code="context_length_exceeded",
            )

    @staticmethod
    async def sample(sc: SamplingClient, prompts: list[list[int]], n: int, p: SamplingMsg) -> list[_Sampled]:
        outs = await asyncio.gather(*(asyncio.wrap_future(sc.sample(ids, n, p)) for ids in prompts))
        return [
            _Sampled(k * n + j, ids, seq)
            for k, (ids, out) in enumerate(zip(prompts, outs, strict=True))
            for j, seq in enumerate(out.sequences)
        ]

    # --- routes -------------------------------------------------------------------------------------
    def model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "polytinker"}

    async def list_models(self, request: Request) -> Response:
        try:
            await self.tenant(request)
            return JSONResponse({"object": "list", "data": [self.model_entry(m) for m in self.backend.base_models]})
        except Exception as exc:
            return error_response(exc)

    async def get_model(self, model: str, request: Request) -> Response:
        try:
            await self.tenant(request)
            if model not in self.backend.base_models:
                raise _HttpError(404, f"model {model!r} is not a base model served here", code="model_not_found")
            return JSONResponse(self.model_entry(model))
        except Exception as exc:
            return error_response(exc)

    async def chat(self, request: Request) -> Response:
        try:
            return await self._chat(request)
        except Exception as exc:
            return error_response(exc)

    async def completions(self, request: Request) -> Response:
        try:
            return await self._completions(request)
        except Exception as exc:
            return error_response(exc)

    async def _chat(self, request: Request) -> Response:
        t = await self.tenant(request)
        req: ChatRequest = await self.body(request, ChatRequest)
        _chat_not_built(req)
        p = self.params(req, req.max_completion_tokens or req.max_tokens, req.n)
        sc, vocab = await self.target(t, req.model)
        messages, tools = chat_messages(req, vocab)
        prompt = await asyncio.to_thread(vocab.chat_prompt, messages, tools)
        self.check_prompt(vocab, prompt, p)
        sampled = await self.sample(sc, [prompt], req.n, p)
        names = frozenset(x.function.name for x in req.tools or []) if req.tool_choice != "none" else frozenset()
        choices = await asyncio.to_thread(lambda: [_chat_choice(s, vocab, bool(req.logprobs), names) for s in sampled])
        usage = _usage(sampled, [prompt])
        if req.stream:
            head = _head("chat.completion.chunk", req.model)
            return _sse(_chat_chunks(head, choices), usage if _include_usage(req) else None, head)
        return JSONResponse(
            {**_head("chat.completion", req.model), "choices": choices, "usage": usage, "prompt_token_ids": prompt}
        )

    async def _completions(self, request: Request) -> Response:
        t = await self.tenant(request)
        req: CompletionRequest = await self.body(request, CompletionRequest)
        _completion_not_built(req)
        many = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        raw: list[Any] = list(req.prompt) if many else [req.prompt]
        p = self.params(req, req.max_tokens, req.n * len(raw))
        sc, vocab = await self.target(t, req.model)
        prompts = [await asyncio.to_thread(vocab.encode, x) if isinstance(x, str) else list(x) for x in raw]
        for ids in prompts:
            self.check_prompt(vocab, ids, p)
        sampled = await self.sample(sc, prompts, req.n, p)

        def choice(s: _Sampled) -> dict[str, Any]:
            logprobs = _completion_logprobs(vocab, s.seq) if req.logprobs is not None else None
            return {
                "index": s.index,
                "text": s.seq.text,
                "logprobs": logprobs,
                "finish_reason": _finish(s.seq),
                **_extension(s),
            }

        choices = await asyncio.to_thread(lambda: [choice(s) for s in sampled])
        usage = _usage(sampled, prompts)
        head = _head("text_completion", req.model)
        if req.stream:
            return _sse(_completion_chunks(head, choices), usage if _include_usage(req) else None, head)
        out: dict[str, Any] = {**head, "choices": choices, "usage": usage}
        if len(prompts) == 1:
            out["prompt_token_ids"] = prompts[0]
        return JSONResponse(out)


def openai_router(
    backend: TinkerBackend,
    *,
    default_max_tokens: int = 256,
    max_tokens_limit: int = 4096,
    max_n: int = 16,
    max_body_bytes: int = 8 << 20,
) -> APIRouter:
    """The routes under ``/v1``. ``default_max_tokens``: a request's when it names none;
    ``max_tokens_limit`` and ``max_n``: the most a request may ask for (``n`` counts every
    choice of a call, over all its prompts); ``max_body_bytes``: the largest request body."""
    if min(default_max_tokens, max_tokens_limit, max_n, max_body_bytes) < 1 or default_max_tokens > max_tokens_limit:
        raise ConfigError("openai_router: limits must be >= 1 and default_max_tokens <= max_tokens_limit")
    routes = _Routes(backend, _Limits(default_max_tokens, max_tokens_limit, max_n, max_body_bytes))
    r = APIRouter(prefix="/v1")
    r.add_api_route("/models", routes.list_models, methods=["GET"], response_model=None)
    r.add_api_route("/models/{model:path}", routes.get_model, methods=["GET"], response_model=None)
    r.add_api_route("/chat/completions", routes.chat, methods=["POST"], response_model=None)
    r.add_api_route("/completions", routes.completions, methods=["POST"], response_model=None)
    return r


__all__ = ["ChatRequest", "CompletionRequest", "error_response", "openai_router", "parse_tool_calls"]
