"""The OpenAI-compatible routes driven by the real ``openai`` client: a local runtime on the default
model (one engine, no learner), the router in a FastAPI app served by uvicorn on a thread.

The ``slow`` tests share one runtime (module fixture); the tool-call parser's tests need none."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polytinker.gateway.openai_api import parse_tool_calls

MODEL = "smollm2-135m-instruct"
KEY = "openai-test-key-0123456789"
HELLO: Any = [{"role": "user", "content": "Name three colours."}]
GREEDY: Any = {"model": MODEL, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a gateway with only the OpenAI routes, in front of a fresh runtime."""
    import uvicorn
    from fastapi import FastAPI

    from polytinker.gateway.openai_api import openai_router
    from polytinker.gateway.tinker_backend import TinkerBackend
    from polytinker.scheduler.service.config import EngineWorkerConfig, RuntimeConfig, TenantConfig
    from polytinker.scheduler.service.runtime import LocalRuntime

    state_dir = Path(tmp_path_factory.mktemp("openai-state"))
    cfg = RuntimeConfig(
        model=MODEL,
        state_dir=str(state_dir),
        tenants=(TenantConfig("agent", api_key=KEY),),
        engines=(EngineWorkerConfig(batch_window_s=0.01),),
        learners=(),
        start_timeout_s=240.0,
    )
    runtime = LocalRuntime(cfg).start()
    backend = TinkerBackend(runtime.local_address, state_dir, base_models=(MODEL,))
    app = FastAPI()
    app.include_router(openai_router(backend))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()
        backend.close()
        runtime.stop()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from polytinker.engine.models import load_tokenizer

    return load_tokenizer(MODEL)


def _no_traceback(exc: openai.APIStatusError) -> None:
    assert "Traceback" not in str(exc) and 'File "' not in str(exc), str(exc)
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body


@pytest.mark.slow
def test_models_lists_the_base_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.slow
def test_chat_completion_carries_content_usage_and_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.chat.completions.create(messages=HELLO, **GREEDY)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    extra = choice.model_extra or {}
    prompt_ids, token_ids = extra["prompt_token_ids"], extra["token_ids"]
    assert (out.model_extra or {})["prompt_token_ids"] == prompt_ids
    assert len(extra["token_logprobs"]) == len(token_ids) and all(lp <= 0 for lp in extra["token_logprobs"])
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), len(token_ids))
    assert out.usage.total_tokens == len(prompt_ids) + len(token_ids)
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
    rendered = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt_ids) == rendered
    again = client.chat.completions.create(messages=HELLO, **GREEDY)
    assert again.choices[0].message.content == choice.message.content  # greedy: the same answer


@pytest.mark.slow
def test_n_gives_that_many_choices(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content is not None and (c.model_extra or {})["token_ids"] for c in out.choices)
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(len((c.model_extra or {})["token_ids"]) for c in out.choices)


@pytest.mark.slow
def test_stop_cuts_the_text_before_the_stop_string(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(messages=HELLO, **GREEDY).choices[0].message.content or ""
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    out = client.chat.completions.create(messages=HELLO, stop=[stop, "\n\n\n"], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == full[: full.index(stop)]


@pytest.mark.slow
def test_logprobs_are_one_per_sampled_token(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.chat.completions.create(messages=HELLO, logprobs=True, **GREEDY)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries, extra = choice.logprobs.content, choice.model_extra or {}
    assert len(entries) == len(extra["token_ids"])
    assert [e.logprob for e in entries] == pytest.approx(extra["token_logprobs"])
    assert all(e.top_logprobs == [] and e.bytes is not None for e in entries)
    special = set(tokenizer.all_special_ids)
    text = b"".join(bytes(e.bytes or []) for e, t in zip(entries, extra["token_ids"], strict=True) if t not in special)
    assert text.decode("utf-8") == choice.message.content


@pytest.mark.slow
def test_streaming_sends_the_completion_in_chunks_and_ends(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(messages=HELLO, **GREEDY)
    stream = client.chat.completions.create(
        messages=HELLO, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].finish_reason == plain.choices[0].finish_reason
    assert (ends[0].model_extra or {})["token_ids"] == (plain.choices[0].model_extra or {})["token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


@pytest.mark.slow
def test_completions_take_text_or_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.completions.create(prompt="The capital of France is", logprobs=1, **GREEDY)
    choice = out.choices[0]
    extra = choice.model_extra or {}
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert extra["prompt_token_ids"] == tokenizer("The capital of France is")["input_ids"]
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is None
    assert len(choice.logprobs.tokens or []) == len(extra["token_ids"]) == len(choice.logprobs.token_logprobs or [])
    assert (choice.logprobs.text_offset or [])[0] == 0
    by_ids = client.completions.create(prompt=extra["prompt_token_ids"], **GREEDY)
    assert by_ids.choices[0].text == choice.text
    streamed = list(client.completions.create(prompt="The capital of France is", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    with pytest.raises(openai.BadRequestError, match="echo") as info:
        client.completions.create(prompt="Hi", echo=True, **GREEDY)
    _no_traceback(info.value)


@pytest.mark.slow
def test_tools_reach_the_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    """SmolLM2's template renders no tools: they are described in a system message instead."""
    tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool], **GREEDY
    )
    prompt = tokenizer.decode((out.choices[0].model_extra or {})["prompt_token_ids"])
    assert "get_weather" in prompt and "<tool_call>" in prompt
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"


@pytest.mark.slow
def test_a_bad_key_is_an_authentication_error(server: str) -> None:
    bad = openai.OpenAI(base_url=server, api_key="not-a-key-of-this-runtime", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(messages=HELLO, **GREEDY)
    _no_traceback(info.value)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n is at most"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"n": "2"}}, "n"),  # strict: a count is a number, not a string
        ({"extra_body": {"top_k": 10**30}}, "top_k"),
        ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ],
)
def test_a_malformed_request_is_a_bad_request(client: openai.OpenAI, kwargs: dict[str, Any], needle: str) -> None:
    args = {"messages": HELLO, **GREEDY, **kwargs}
    with pytest.raises(openai.BadRequestError, match=needle) as info:
        client.chat.completions.create(**args)
    _no_traceback(info.value)


@pytest.mark.slow
def test_unknown_models_bodies_and_sizes_are_refused_cleanly(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=4)
    _no_traceback(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tinker://nojob/sampler_weights/a@1", messages=HELLO, max_tokens=4)
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for body, status in [(b"{not json", 400), (b"[1, 2]", 400), (b"[" * 100_000, 400), (b" " * (9 << 20), 413)]:
        r = httpx.post(f"{server}/chat/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}


@pytest.mark.slow
def test_a_call_in_flight_does_not_hold_up_the_others(client: openai.OpenAI) -> None:
    """Sampling waits on a future, not on the event loop: a models list answers meanwhile."""
    done: list[Any] = []
    long = threading.Thread(
        target=lambda: done.append(
            client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, n=8, temperature=1.0)
        )
    )
    long.start()
    time.sleep(0.3)  # the long call is in the sampler by now
    start = time.monotonic()
    assert [m.id for m in client.models.list()] == [MODEL]
    waited_s = time.monotonic() - start
    alive = long.is_alive()
    long.join(120)
    assert len(done[0].choices) == 8
    assert waited_s < 1.0 and alive, f"models waited {waited_s:.2f} s; long call still running: {alive}"


def test_an_internal_error_answers_only_an_error_id() -> None:
    from polytinker.gateway.openai_api import error_response

    response = error_response(RuntimeError("secret detail of /home/x"))
    assert response.status_code == 500
    error = json.loads(bytes(response.body))["error"]
    assert "secret" not in error["message"] and "error id" in error["message"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")


# --- the tool-call parser (no model) ----------------------------------------------------------------
NAMES = frozenset({"get_weather", "add"})


def test_tool_call_blocks_become_tool_calls_and_the_rest_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse_tool_calls(text, NAMES)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}' and calls[0]["id"].startswith("call_")
    two = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "add"}</tool_call>'
    parsed = parse_tool_calls(two, NAMES)
    assert parsed is not None and parsed[0] is None
    assert [c["function"]["arguments"] for c in parsed[1]] == ['{"a": 1}', "{}"]


def test_a_bare_json_call_or_list_of_calls_is_a_tool_call() -> None:
    parsed = parse_tool_calls(' {"name": "add", "parameters": {"a": 1, "b": 2}} ', NAMES)
    assert parsed is not None and parsed[1][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    parsed = parse_tool_calls('[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {}}]', NAMES)
    assert parsed is not None and len(parsed[1]) == 2


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "unknown_tool", "arguments": {}}',
        '{"name": "add", "arguments": [1, 2]}',
        '<tool_call>{"name": "add", "arguments": {}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}',
        '{"answer": 4}',
        "[]",
    ],
)
def test_anything_else_stays_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) is None


# --- multi-turn, token for token --------------------------------------------------------------------
ADD_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def _tool_result(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
        return str(int(args.get("a", 0)) + int(args.get("b", 0)))
    except (ValueError, TypeError, AttributeError):
        return "error: add takes integers a and b"


@pytest.mark.slow
def test_a_three_turn_tool_agent_merges_into_one_datum_of_what_was_sampled(client: openai.OpenAI) -> None:
    """A plain openai-client agent: each answer goes back as the message object it was; tool
    calls get tool results, other answers a user turn. Turns 2 and 3 continue the call before
    token for token, so ``merge_calls`` makes one datum of the episode."""
    from polytinker.client import merge_calls

    messages: list[Any] = [
        {"role": "system", "content": "Use the add tool for arithmetic."},
        {"role": "user", "content": "What is 2 + 3? Call add."},
    ]
    answers: list[Any] = []
    concat: list[int] = []  # prompt 1 + completion 1 + the new tool or user tokens + completion 2 ...
    for _ in range(3):
        out = client.chat.completions.create(messages=messages, tools=[ADD_TOOL], seed=3, **GREEDY)
        choice = out.choices[0]
        extra = choice.model_extra or {}
        answers.append(out)
        concat += extra["prompt_token_ids"][len(concat) :] + extra["token_ids"]
        messages.append(choice.message)
        for call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "Now add 1 to that."})
    extras = [a.choices[0].model_extra or {} for a in answers]
    assert "prompt_continues" not in extras[0]
    assert [e["prompt_continues"] for e in extras[1:]] == [answers[0].id, answers[1].id]
    assert [(a.model_extra or {}).get("prompt_continues") for a in answers] == [None, answers[0].id, answers[1].id]
    (datum,) = merge_calls(answers, [1.0, -1.0, 0.5])
    tokens = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].data[-1]]
    assert tokens == concat
    for before, after in itertools.pairwise(extras):  # each prompt extends the call before
        n = len(before["prompt_token_ids"]) + len(before["token_ids"])
        assert after["prompt_token_ids"][:n] == before["prompt_token_ids"] + before["token_ids"]
    advantages = datum.loss_fn_inputs["advantages"].data
    assert sum(a == 1.0 for a in advantages) == len(extras[0]["token_ids"])
    assert sum(a == -1.0 for a in advantages) == len(extras[1]["token_ids"])
    assert sum(a == 0.5 for a in advantages) == len(extras[2]["token_ids"])
    # an answer the agent edits is no longer what was sampled: rendered as today, continuing nothing
    edited = [*messages[:2], {"role": "assistant", "content": "I will add them."}, {"role": "user", "content": "Go."}]
    out = client.chat.completions.create(messages=edited, tools=[ADD_TOOL], **GREEDY)
    assert "prompt_continues" not in (out.choices[0].model_extra or {})


@pytest.mark.slow
def test_a_polytinker_version_path_is_read_as_its_tinker_spelling(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="polytinker://nojob/agent@1", messages=HELLO, max_tokens=4)
    message = info.value.response.json()["error"]["message"]
    assert "nojob" in message and "base model" not in message, message
    with pytest.raises(openai.BadRequestError, match="polytinker://JOB/AGENT@VERSION") as bad:
        client.chat.completions.create(model="polytinker://nojob", messages=HELLO, max_tokens=4)
    assert "model" in str(bad.value)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=4)
    message = unknown.value.response.json()["error"]["message"]
    assert message.count("not served") == 1 and "polytinker://JOB/AGENT@VERSION" in message, message


@pytest.mark.slow
def test_tool_choice_none_describes_the_tools_and_reads_no_calls(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=[ADD_TOOL], tool_choice="none", **GREEDY
    )
    prompt = tokenizer.decode((out.choices[0].model_extra or {})["prompt_token_ids"])
    assert "Add two integers." in prompt
    assert out.choices[0].finish_reason != "tool_calls" and not out.choices[0].message.tool_calls
