"""OpenAI-compatible inference: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

An agent written with the ``openai`` package talks to the scheduler through these routes
(docs/openai.md). ``model`` names a base model or an adapter version
(``tinker://JOB/sampler_weights/AGENT@V`` or ``polytinker://JOB/AGENT@V``); the client's
``api_key`` is a tenant's key of the runtime. Besides OpenAI's fields each choice carries
``prompt_token_ids``, ``token_ids`` and ``token_logprobs`` (the sampler's), so every call an agent
makes is training data as it stands. A chat call that sends back an answer the gateway gave
continues that answer's tokens (``prompt_continues``; openai_continue.py).

Requests are decoded into pydantic models at the edge; a malformed one is a 400 in OpenAI's
error shape, never a traceback. Sampling runs on the client's futures (``asyncio.wrap_future``),
tokenizing on worker threads: nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from polytinker.engine.models import served_name
from polytinker.engine.types import SamplingParams
from polytinker.errors import AuthError, ConfigError, NotBuiltError
from polytinker.gateway.errors import HttpError, error_response
from polytinker.gateway.openai_chat import Vocab, Vocabs, chat_messages, parse_tool_calls
from polytinker.gateway.openai_continue import Continuations
from polytinker.gateway.openai_types import ChatRequest, CompletionRequest, SamplingFields
from polytinker.gateway.wire import api_key, read_json
from polytinker.model_path import MODEL_PREFIX, TINKER_PREFIX, ModelPath

if TYPE_CHECKING:
    from polytinker.client._connection import SampledSequence
    from polytinker.client.sampling_client import SamplingClient
    from polytinker.gateway.tinker_backend import Tenant, TinkerBackend

log = logging.getLogger("polytinker.http")


def _validation_message(exc: ValidationError) -> str:
    parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False)[:5]]
    return "invalid request: " + "; ".join(parts)


# --- responses --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sampled:
    """One choice: the prompt it continues and the sampled sequence."""

    index: int
    prompt_ids: list[int]
    seq: SampledSequence


def _finish(seq: SampledSequence) -> str:
    return "length" if seq.stop_reason == "length" else "stop"


def _extension(s: _Sampled, continues: str | None = None) -> dict[str, Any]:
    out = {"prompt_token_ids": s.prompt_ids, "token_ids": list(s.seq.tokens), "token_logprobs": list(s.seq.logprobs)}
    return {**out, "prompt_continues": continues} if continues else out


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


def _chat_choice(
    s: _Sampled, vocab: Vocab, want_logprobs: bool, tool_names: frozenset[str], continues: str | None
) -> dict[str, Any]:
    parsed = parse_tool_calls(s.seq.text, tool_names) if tool_names else None
    message: dict[str, Any] = {"role": "assistant", "content": s.seq.text, "refusal": None}
    finish = _finish(s.seq)
    if parsed is not None:
        message["content"], message["tool_calls"] = parsed
        finish = "tool_calls"
    logprobs = _chat_logprobs(vocab, s.seq) if want_logprobs else None
    return {
        "index": s.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        **_extension(s, continues),
    }


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
def _not_built(req: SamplingFields) -> None:
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


def _include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


_VERSION_SPELLINGS = "tinker://JOB/sampler_weights/AGENT@VERSION or polytinker://JOB/AGENT@VERSION"


def _model_spec(model: str) -> dict[str, str]:
    """What ``model`` names: a ``tinker://`` sampler path, a ``polytinker://JOB/AGENT@V`` version
    (the spelling polytinker's own clients return: the same version as its Tinker spelling), or a
    base model."""
    if model.startswith(TINKER_PREFIX):
        return {"model_path": model}
    if model.startswith(MODEL_PREFIX):
        try:
            return {"model_path": ModelPath.parse(model).tinker}
        except ConfigError:
            raise HttpError(400, f"model {model!r} is not a version: write {_VERSION_SPELLINGS}") from None
    return {"base_model": model}


@dataclass(frozen=True)
class _Limits:
    default_max_tokens: int
    max_tokens: int
    n: int
    body_bytes: int
    memory_answers: int
    memory_tokens: int


class _Routes:
    """What each route does; every public method answers errors in OpenAI's shape itself, so the
    router behaves the same in any app that includes it."""

    def __init__(self, backend: TinkerBackend, limits: _Limits) -> None:
        self.backend, self.limits = backend, limits
        self.vocabs = Vocabs()
        self.continuations = Continuations(limits.memory_answers, limits.memory_tokens)
        self.created = int(time.time())

    # --- the request's parts ------------------------------------------------------------------------
    async def tenant(self, request: Request) -> Tenant:
        return await asyncio.to_thread(self.backend.tenant, api_key(request))

    async def body(self, request: Request, kind: type[ChatRequest] | type[CompletionRequest]) -> Any:
        raw = await read_json(request, self.limits.body_bytes)
        try:
            return kind.model_validate(raw)
        except ValidationError as exc:
            raise HttpError(400, _validation_message(exc)) from None

    async def target(self, t: Tenant, model: str) -> tuple[SamplingClient, Vocab]:
        spec = _model_spec(model)
        try:
            sc = await asyncio.to_thread(self.backend.sampling_client, t, spec)
        except (ConfigError, AuthError) as exc:
            if "model_path" in spec:
                raise HttpError(404, f"model {model!r} is not served here: {exc}", code="model_not_found") from None
            raise HttpError(
                404,
                f"model {model!r} is not served here: /v1/models lists the base models "
                f"{list(self.backend.base_models)}; an adapter version is {_VERSION_SPELLINGS}",
                code="model_not_found",
            ) from None
        return sc, await asyncio.to_thread(self.vocabs.get, sc.base_model)

    def params(self, req: SamplingFields, max_tokens: int | None, choices: int) -> SamplingParams:
        _not_built(req)
        if choices > self.limits.n:
            raise HttpError(400, f"n is at most {self.limits.n} here (over all prompts of a call), got {choices}")
        tokens = max_tokens or self.limits.default_max_tokens
        if tokens > self.limits.max_tokens:
            raise HttpError(400, f"max_tokens is at most {self.limits.max_tokens} here, got {tokens}")
        return SamplingParams(
            max_tokens=tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            stop=_stops(req.stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            seed=None if req.seed is None else req.seed % (1 << 63),
        )

    @staticmethod
    def check_prompt(vocab: Vocab, ids: list[int], p: SamplingParams) -> None:
        if not ids:
            raise HttpError(400, "the prompt needs at least one token")
        if any(not 0 <= i < vocab.size for i in ids):
            raise HttpError(400, f"prompt token ids must be in 0..{vocab.size - 1}")
        if any(not 0 <= i < vocab.size for i in p.stop_token_ids):
            raise HttpError(400, f"stop_token_ids must be in 0..{vocab.size - 1}")
        if vocab.context and len(ids) + p.max_tokens > vocab.context:
            raise HttpError(
                400,
                f"the prompt ({len(ids)} tokens) and max_tokens ({p.max_tokens}) exceed the "
                f"model's context of {vocab.context} tokens",
                code="context_length_exceeded",
            )

    @staticmethod
    async def sample(sc: SamplingClient, prompts: list[list[int]], n: int, p: SamplingParams) -> list[_Sampled]:
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
            if not any(served_name(m, model) for m in self.backend.base_models):  # by its name or its hub id
                raise HttpError(404, f"model {model!r} is not a base model served here", code="model_not_found")
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
        prompt = await asyncio.to_thread(
            self.continuations.prompt, t.owner, sc.base_model, req.messages, messages, tools, vocab
        )
        self.check_prompt(vocab, prompt.ids, p)
        sampled = await self.sample(sc, [prompt.ids], req.n, p)
        names = frozenset(x.function.name for x in req.tools or []) if req.tool_choice != "none" else frozenset()
        choices = await asyncio.to_thread(
            lambda: [_chat_choice(s, vocab, bool(req.logprobs), names, prompt.continues) for s in sampled]
        )
        head = _head("chat.completion.chunk" if req.stream else "chat.completion", req.model)
        self.continuations.remember(t.owner, sc.base_model, head["id"], prompt, sampled, choices)
        usage = _usage(sampled, [prompt.ids])
        if req.stream:
            return _sse(_chat_chunks(head, choices), usage if _include_usage(req) else None, head)
        top = {"prompt_token_ids": prompt.ids, **({"prompt_continues": prompt.continues} if prompt.continues else {})}
        return JSONResponse({**head, "choices": choices, "usage": usage, **top})

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
    memory_answers: int = 4096,
    memory_tokens: int = 1 << 22,
) -> APIRouter:
    """The routes under ``/v1``. ``default_max_tokens``: a request's when it names none;
    ``max_tokens_limit`` and ``max_n``: the most a request may ask for (``n`` counts every
    choice of a call, over all its prompts); ``max_body_bytes``: the largest request body;
    ``memory_answers`` and ``memory_tokens``: the chat answers a tenant's later calls may
    continue token for token, at most this many and this many prompt + sampled tokens a tenant
    (least recently used first out; openai_continue.py)."""
    limits = (default_max_tokens, max_tokens_limit, max_n, max_body_bytes, memory_answers, memory_tokens)
    if min(limits) < 1 or default_max_tokens > max_tokens_limit:
        raise ConfigError("openai_router: limits must be >= 1 and default_max_tokens <= max_tokens_limit")
    routes = _Routes(backend, _Limits(*limits))
    r = APIRouter(prefix="/v1")
    r.add_api_route("/models", routes.list_models, methods=["GET"], response_model=None)
    r.add_api_route("/models/{model:path}", routes.get_model, methods=["GET"], response_model=None)
    r.add_api_route("/chat/completions", routes.chat, methods=["POST"], response_model=None)
    r.add_api_route("/completions", routes.completions, methods=["POST"], response_model=None)
    return r


__all__ = ["ChatRequest", "CompletionRequest", "error_response", "openai_router", "parse_tool_calls"]
