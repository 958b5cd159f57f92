"""Token-for-token multi-turn on ``/v1/chat/completions``: an agent's answers come back as they
were sampled.

An agent sends its earlier answers back as assistant messages. Rendered again through the chat
template they are not the tokens the model sampled (whitespace, the order of text and tool
calls), so the next prompt would not extend the last one. The gateway remembers each answer it
gave: the messages (and tools) that led to it, its prompt ids and its sampled ids. When a request
holds an assistant message that is one of them, matched exactly, the new prompt is that answer's
prompt + sampled ids + the template's rendering of what follows it, so it extends the earlier call
token for token; the answer names the call it continues (``prompt_continues``).

A message matches an answer when the messages before it (and the tools) are those of the
answer's request, and either a tool call id is one the answer carried, or its content and tool
calls are the answer's exactly. Answers are kept per tenant (one tenant's messages never match
another's answers), least recently used first out, at most ``max_answers`` answers and
``max_tokens`` prompt + sampled tokens a tenant.

- ``Remembered``: one answer's ids and what it answered.
- ``AnswerMemory``: the bounded per-tenant memory.
- ``Continuations``: the prompt of a request (continued or rendered) and the answers to remember.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polytinker.gateway.openai_chat import Vocab, message_text
from polytinker.gateway.openai_types import Message


@dataclass(frozen=True)
class Remembered:
    """One answer (a choice) the gateway gave: the call's id, the base model whose tokens these
    are, the digest of the messages and tools it answered, and its prompt and sampled ids."""

    call_id: str
    base_model: str
    prefix: bytes
    prompt_ids: array[int]
    token_ids: array[int]
    tool_call_ids: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def reply_key(content: str | None, calls: Sequence[tuple[str, str]]) -> str:
    """What an assistant message says: its content ("" for none) and its calls' names and arguments."""
    return json.dumps([content or "", [list(c) for c in calls]], ensure_ascii=False)


def answer_key(prefix: bytes, reply: str) -> bytes:
    return hashlib.sha256(prefix + reply.encode("utf-8", "surrogatepass")).digest()


def prefix_digests(messages: Sequence[dict[str, Any]], tools: Any) -> list[bytes]:
    """``out[j]``: the digest of the tools and ``messages[:j]`` (j = 0 .. len(messages))."""
    h = hashlib.sha256(json.dumps(tools, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "replace"))
    out = [h.digest()]
    for m in messages:
        h.update(hashlib.sha256(json.dumps(m, sort_keys=True, ensure_ascii=False, default=str).encode()).digest())
        out.append(h.digest())
    return out


@dataclass
class _TenantAnswers:
    by_key: OrderedDict[bytes, Remembered] = field(default_factory=OrderedDict)
    by_call_id: dict[str, bytes] = field(default_factory=dict)
    tokens: int = 0


class AnswerMemory:
    """The answers of each tenant, least recently used first out: at most ``max_answers`` and
    ``max_tokens`` (prompt + sampled ids, over its answers) a tenant."""

    def __init__(self, max_answers: int, max_tokens: int) -> None:
        self.max_answers, self.max_tokens = max_answers, max_tokens
        self._tenants: dict[str, _TenantAnswers] = {}
        self._lock = threading.Lock()

    def remember(self, owner: str, key: bytes, answer: Remembered) -> None:
        if answer.size > self.max_tokens or self.max_answers < 1:
            return
        with self._lock:
            mine = self._tenants.setdefault(owner, _TenantAnswers())
            self._drop(mine, key)
            mine.by_key[key] = answer
            mine.tokens += answer.size
            for call_id in answer.tool_call_ids:
                mine.by_call_id[call_id] = key
            while len(mine.by_key) > self.max_answers or mine.tokens > self.max_tokens:
                self._drop(mine, next(iter(mine.by_key)))

    @staticmethod
    def _drop(mine: _TenantAnswers, key: bytes) -> None:
        old = mine.by_key.pop(key, None)
        if old is not None:
            mine.tokens -= old.size
            for call_id in old.tool_call_ids:
                if mine.by_call_id.get(call_id) == key:
                    del mine.by_call_id[call_id]

    def find(self, owner: str, key: bytes, call_ids: Sequence[str], prefix: bytes) -> Remembered | None:
        """The tenant's answer under ``key``, or the one that gave a tool call id of
        ``call_ids`` to the same messages (``prefix``); it becomes the most recently used."""
        with self._lock:
            mine = self._tenants.get(owner)
            if mine is None:
                return None
            found_key = key if key in mine.by_key else None
            for call_id in call_ids if found_key is None else ():
                k = mine.by_call_id.get(call_id)
                if k is not None and mine.by_key[k].prefix == prefix:
                    found_key = k
                    break
            if found_key is None:
                return None
            mine.by_key.move_to_end(found_key)
            return mine.by_key[found_key]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(m.by_key) for m in self._tenants.values())


@dataclass(frozen=True)
class Prompt:
    """A chat request's prompt ids; ``continues``: the id of the call it extends, if any."""

    ids: list[int]
    continues: str | None
    prefix: bytes  # the digest of the request's messages and tools: its answers' prefix


def _request_reply_key(msg: Message) -> str:
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
    return reply_key(message_text(msg.content), calls)


def _after_answer(vocab: Vocab, messages: list[dict[str, Any]], tools: Any, j: int, last_token: int) -> list[int]:
    """The ids the template writes after assistant message ``j`` up to the generation prompt, less
    the end-of-turn token the model sampled itself: the message's content is replaced by a
    marker, and what follows the marker is what follows the answer's sampled ids."""
    marker = f"<<polytinker-answer-{uuid.uuid4().hex}>>"
    probe = [*messages[:j], {"role": "assistant", "content": marker}, *messages[j + 1 :]]
    text = vocab.chat_text(probe, tools)
    if text.count(marker) != 1:
        raise ValueError("the chat template does not render an assistant message's content once")
    after = text[text.index(marker) + len(marker) :]
    if last_token in vocab.special_ids:
        end = vocab.token_text(last_token)
        after = after.removeprefix(end) if end else after
    return vocab.text_ids(after) if after else []


class Continuations:
    """The prompts of chat requests, continued where they hold an answer the gateway gave, and
    the memory of answers given."""

    def __init__(self, max_answers: int, max_tokens: int) -> None:
        self.memory = AnswerMemory(max_answers, max_tokens)

    def prompt(
        self,
        owner: str,
        base_model: str,
        req_messages: Sequence[Message],
        messages: list[dict[str, Any]],
        tools: Any,
        vocab: Vocab,
    ) -> Prompt:
        """The prompt of a request whose messages, as rendered, are ``messages`` (a system
        message of tools may come first, which ``req_messages`` lacks)."""
        digests = prefix_digests(messages, tools)
        shift = len(messages) - len(req_messages)
        for k in range(len(req_messages) - 1, -1, -1):
            msg = req_messages[k]
            if msg.role != "assistant":
                continue
            j = k + shift
            ids = [c.id for c in msg.tool_calls or () if c.id]
            found = self.memory.find(owner, answer_key(digests[j], _request_reply_key(msg)), ids, digests[j])
            if found is None or found.base_model != base_model or not found.token_ids:
                continue
            try:
                after = _after_answer(vocab, messages, tools, j, found.token_ids[-1])
            except ValueError:
                break
            return Prompt([*found.prompt_ids, *found.token_ids, *after], found.call_id, digests[-1])
        return Prompt(vocab.chat_prompt(messages, tools), None, digests[-1])

    def remember(
        self, owner: str, base_model: str, call_id: str, prompt: Prompt, sampled: Sequence[Any], choices: Sequence[Any]
    ) -> None:
        """Remember each choice of a call: ``sampled[i]`` (prompt ids and sampled sequence) and
        the message ``choices[i]`` answered."""
        for s, c in zip(sampled, choices, strict=True):
            message = c["message"]
            calls = message.get("tool_calls") or []
            reply = reply_key(message["content"], [(x["function"]["name"], x["function"]["arguments"]) for x in calls])
            answer = Remembered(
                call_id,
                base_model,
                prompt.prefix,
                array("i", s.prompt_ids),
                array("i", s.seq.tokens),
                tuple(x["id"] for x in calls),
            )
            self.memory.remember(owner, answer_key(prompt.prefix, reply), answer)


__all__ = ["AnswerMemory", "Continuations", "Prompt", "Remembered", "answer_key", "prefix_digests", "reply_key"]
