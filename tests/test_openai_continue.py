"""Multi-turn token for token on /v1 without a runtime: the gateway's memory of answers and its
matcher (with the tiny-random model's real tokenizer and chat template), and the client's
``merge_calls``. The same through the real ``openai`` client and a gateway is in test_http_openai.py."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from polytinker.client import RecordedCall, call_datum, merge_calls
from polytinker.errors import ConfigError
from polytinker.gateway.openai_chat import Vocab, chat_messages
from polytinker.gateway.openai_continue import AnswerMemory, Continuations, Remembered, answer_key, reply_key
from polytinker.gateway.openai_types import ChatRequest

TOOL: Any = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    from polytinker.engine.models import load_tokenizer

    found = Vocab(load_tokenizer("tiny-random"))
    assert found.has_template
    return found


def _remembered(call_id: str, prefix: bytes = b"p", size: int = 4, calls: tuple[str, ...] = ()) -> Remembered:
    return Remembered(call_id, "m", prefix, array("i", [1] * size), array("i", [2]), calls)


# --- the memory -------------------------------------------------------------------------------------
def test_memory_keeps_each_tenant_to_its_own_answers() -> None:
    memory = AnswerMemory(max_answers=8, max_tokens=1000)
    key = answer_key(b"p", reply_key("hi", []))
    memory.remember("alice", key, _remembered("a1", calls=("call_x",)))
    assert memory.find("alice", key, [], b"p") is not None
    assert memory.find("bob", key, [], b"p") is None
    assert memory.find("bob", b"other", ["call_x"], b"p") is None
    found = memory.find("alice", b"other", ["call_x"], b"p")
    assert found is not None and found.call_id == "a1"
    assert memory.find("alice", b"other", ["call_x"], b"another prefix") is None  # an id, other messages


def test_memory_drops_the_least_recently_used_past_either_cap() -> None:
    memory = AnswerMemory(max_answers=2, max_tokens=1000)
    for name in ("a", "b"):
        memory.remember("t", name.encode(), _remembered(name, calls=(f"id_{name}",)))
    assert memory.find("t", b"a", [], b"p") is not None  # a is used: b is now the oldest
    memory.remember("t", b"c", _remembered("c"))
    assert [memory.find("t", k, [], b"p") is not None for k in (b"a", b"b", b"c")] == [True, False, True]
    assert memory.find("t", b"?", ["id_b"], b"p") is None  # its tool call id went with it
    by_tokens = AnswerMemory(max_answers=100, max_tokens=12)
    for name in ("a", "b", "c"):
        by_tokens.remember("t", name.encode(), _remembered(name, size=5))  # 6 tokens each
    assert len(by_tokens) == 2 and by_tokens.find("t", b"a", [], b"p") is None
    by_tokens.remember("t", b"huge", _remembered("huge", size=50))  # over the cap alone: not kept
    assert len(by_tokens) == 2 and by_tokens.find("t", b"huge", [], b"p") is None


# --- the matcher ------------------------------------------------------------------------------------
def _request(messages: list[Any], tools: list[Any] | None = None) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": messages, "tools": tools})


def _answer(
    cont: Continuations, vocab: Vocab, messages: list[Any], text: str, call_id: str, tools: list[Any] | None = None
) -> tuple[list[int], list[int], dict[str, Any]]:
    """Ask for ``messages`` and remember ``text`` (+ end of turn) as the sampled answer."""
    req = _request(messages, tools)
    rendered, tmpl_tools = chat_messages(req, vocab)
    prompt = cont.prompt("alice", "m", req.messages, rendered, tmpl_tools, vocab)
    sampled = [*vocab.text_ids(text), vocab.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    seq = SimpleNamespace(tokens=sampled)
    message = {"role": "assistant", "content": text}
    cont.remember(
        "alice", "m", call_id, prompt, [SimpleNamespace(prompt_ids=prompt.ids, seq=seq)], [{"message": message}]
    )
    return prompt.ids, sampled, message


def _prompt(cont: Continuations, vocab: Vocab, messages: list[Any], owner: str = "alice", tools: Any = None) -> Any:
    req = _request(messages, tools)
    rendered, tmpl_tools = chat_messages(req, vocab)
    return cont.prompt(owner, "m", req.messages, rendered, tmpl_tools, vocab)


def test_an_answer_sent_back_continues_its_tokens_over_three_turns(vocab: Vocab) -> None:
    cont = Continuations(16, 1 << 16)
    # an answer the template would render differently: a trailing space and a newline it keeps
    history: list[Any] = [{"role": "user", "content": "Add 2 and 3."}]
    p1, s1, m1 = _answer(cont, vocab, history, "Let me  add.\n", "call-1", [TOOL])
    history += [m1, {"role": "tool", "content": "5", "tool_call_id": "x"}]
    p2, s2, m2 = _answer(cont, vocab, history, " It is 5. ", "call-2", [TOOL])
    assert p2[: len(p1) + len(s1)] == p1 + s1 and len(p2) > len(p1) + len(s1)
    history += [m2, {"role": "user", "content": "Thanks!"}]
    third = _prompt(cont, vocab, history, tools=[TOOL])
    assert third.continues == "call-2"
    assert third.ids[: len(p2) + len(s2)] == p2 + s2
    # what follows the last answer is the template's own text for the rest of the conversation
    assert (
        vocab.tokenizer.decode(third.ids[len(p2) + len(s2) :])
        == "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_nothing_matches_another_tenant_other_content_or_other_history(vocab: Vocab) -> None:
    cont = Continuations(16, 1 << 16)
    history: list[Any] = [{"role": "user", "content": "Hi"}]
    _, _, m1 = _answer(cont, vocab, history, "Hello!", "call-1")
    later = [*history, m1, {"role": "user", "content": "Bye"}]
    assert _prompt(cont, vocab, later).continues == "call-1"
    assert _prompt(cont, vocab, later, owner="mallory").continues is None
    edited = [*history, {"role": "assistant", "content": "Hello"}, later[-1]]
    plain = _prompt(cont, vocab, edited)
    assert plain.continues is None and plain.ids == vocab.chat_prompt(chat_messages(_request(edited), vocab)[0], None)
    other_history = [{"role": "user", "content": "Hey"}, m1, later[-1]]
    assert _prompt(cont, vocab, other_history).continues is None
    assert _prompt(cont, vocab, later, tools=[TOOL]).continues is None  # other tools: another prompt


def test_a_tool_call_answer_matches_by_its_call_id(vocab: Vocab) -> None:
    cont = Continuations(16, 1 << 16)
    history: list[Any] = [{"role": "user", "content": "Add 2 and 3."}]
    req = _request(history, [TOOL])
    rendered, tmpl_tools = chat_messages(req, vocab)
    prompt = cont.prompt("alice", "m", req.messages, rendered, tmpl_tools, vocab)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    seq = SimpleNamespace(tokens=vocab.text_ids(text))
    call = {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    cont.remember("alice", "m", "c1", prompt, [SimpleNamespace(prompt_ids=prompt.ids, seq=seq)], [{"message": message}])
    reformatted = {**call, "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}  # the agent re-dumped them
    back = [
        *history,
        {"role": "assistant", "tool_calls": [reformatted]},
        {"role": "tool", "content": "5", "tool_call_id": "call_abc"},
    ]
    found = _prompt(cont, vocab, back, tools=[TOOL])
    assert found.continues == "c1" and found.ids[: len(prompt.ids) + len(seq.tokens)] == prompt.ids + seq.tokens
    # ended by length, without an end-of-turn token: the template's end of turn comes after it
    assert vocab.tokenizer.decode(found.ids[len(prompt.ids) + len(seq.tokens) :]).startswith(
        "<|im_end|>\n<|im_start|>tool"
    )


# --- merging recorded calls -------------------------------------------------------------------------
def _call(prompt: list[int], tokens: list[int], continues: str | None = None) -> dict[str, Any]:
    lp = [-0.5] * len(tokens)
    return {"prompt_token_ids": prompt, "token_ids": tokens, "token_logprobs": lp, "prompt_continues": continues}


def test_calls_that_continue_each_other_merge_into_one_datum() -> None:
    calls = [
        _call([1, 2, 3], [4, 5]),
        _call([1, 2, 3, 4, 5, 6], [7], "c1"),
        _call([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11]),
    ]
    (datum,) = merge_calls(calls, [1.0, -2.0, 3.0])
    tokens = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].data[-1]]
    assert tokens == list(range(1, 12))
    inputs = {k: v.data for k, v in datum.loss_fn_inputs.items()}
    # targets 2..11: prompt 2,3 | sampled 4,5 | shown 6 | sampled 7 | shown 8,9 | sampled 10,11
    assert inputs["weights"] == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert inputs["advantages"] == [0, 0, 1, 1, 0, -2, 0, 0, 3, 3]
    assert inputs["logprobs"] == [0, 0, -0.5, -0.5, 0, -0.5, 0, 0, -0.5, -0.5]


def test_a_call_that_does_not_continue_starts_a_new_datum() -> None:
    calls = [_call([1, 2], [3]), _call([1, 2, 9], [4]), _call([1, 2, 9, 4, 5], [6])]
    datums = merge_calls(calls, 1.0, weight=0.25)
    assert [d.model_input.to_ints() for d in datums] == [[1, 2], [1, 2, 9, 4, 5]]
    assert datums[1].loss_fn_inputs["weights"].data == [0, 0, 0.25, 0, 0.25]  # targets 2 9 | 4 | 5 | 6
    assert call_datum(calls[0], 2.0).loss_fn_inputs["advantages"].data == [0.0, 2.0]


def test_recorded_calls_are_read_from_openai_objects_and_checked() -> None:
    choice = SimpleNamespace(model_extra=_call([1, 2], [3, 4], "chatcmpl-1"))
    response = SimpleNamespace(choices=[choice])
    assert RecordedCall.of(response) == RecordedCall((1, 2), (3, 4), (-0.5, -0.5), "chatcmpl-1")
    with pytest.raises(ConfigError, match="2 choices"):
        RecordedCall.of(SimpleNamespace(choices=[choice, choice]))
    with pytest.raises(ConfigError, match="token_ids"):
        RecordedCall.of({"content": "hi"})
    with pytest.raises(ConfigError, match="token_logprobs"):
        RecordedCall.of({**_call([1], [2]), "token_logprobs": []})
    with pytest.raises(ConfigError, match="advantages"):
        merge_calls([_call([1], [2])], [1.0, 2.0])
    with pytest.raises(ConfigError, match="finite"):
        merge_calls([_call([1], [2])], float("nan"))
