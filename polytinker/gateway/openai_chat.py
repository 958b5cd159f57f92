"""Chat prompts and tool calls for the OpenAI-compatible routes: the model's chat template,
token bytes for logprobs, tools described to models whose template ignores them, and the tool
calls found in a completion (docs/openai.md says exactly which shapes are detected)."""

from __future__ import annotations

import json
import re
import threading
import uuid
from typing import Any

from polytinker.engine.models import load_tokenizer
from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway.openai_types import ChatRequest, ContentPart, ToolCall
from polytinker.gateway.wire import MAX_JSON_DEPTH, depth_ok


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
        return self.text_ids(self.chat_text(messages, tools))

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The chat template's rendering of ``messages``, with the generation prompt."""
        if not self.has_template:
            raise ConfigError("this model has no chat template: use /v1/completions with a prompt string")
        with self.lock:
            try:
                return str(
                    self.tokenizer.apply_chat_template(
                        messages, tools=tools, add_generation_prompt=True, tokenize=False
                    )
                )
            except Exception as exc:  # the template rejects the conversation (roles, order)
                raise ConfigError(f"the model's chat template refused the messages: {str(exc)[:500]}") from None

    def text_ids(self, text: str) -> list[int]:
        """The ids of template text (its special tokens written out; none added)."""
        with self.lock:
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def token_text(self, token_id: int) -> str:
        with self.lock:
            return str(self.tokenizer.decode([token_id]))

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


class Vocabs:
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


def message_text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text":
            raise NotBuiltError(f"message content parts of type {part.type!r} are not built (text parts are)")
    return "".join(p.text or "" for p in content)


def _arguments(raw: str) -> Any:
    """A tool call's arguments as JSON where they are JSON nested no deeper than a request may be
    (a chat template renders them, recursively); as the text otherwise."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    return value if depth_ok(value, MAX_JSON_DEPTH) else raw


def _tool_call_text(call: ToolCall) -> str:
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
    """The messages and tools to render with the model's chat template. With ``tool_choice="none"``
    the tools are described all the same (as OpenAI does); only the answer is not read for calls."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        d: dict[str, Any] = {
            "role": "system" if msg.role == "developer" else msg.role,
            "content": message_text(msg.content),
        }
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


__all__ = ["TOOL_CALL_RE", "Vocab", "Vocabs", "chat_messages", "message_text", "parse_tool_calls", "tools_prompt"]
