"""The HTTP gateway against hostile and careless callers: bodies of the wrong types, counts in the
millions, NaNs, oversized and stalled uploads, one tenant crowding out another, a hostile tenant
beside a good one (who loses nothing and keeps her runs over a restart), and error messages
that would show the server's paths.

The unit tests drive the gateway's parts (the body checks, the byte budget middleware, error
classification). The ``slow`` tests drive a real ``polytinker serve --http`` (tests/_serve.py) with
the real ``tinker`` SDK and raw httpx bodies and sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from _http_raw import stalled
from _serve import KEY, KEY_BOB, MODEL, Serve

from polytinker.errors import ConfigError, NotBuiltError, OverloadedError, RemoteError
from polytinker.gateway import _proto, checks
from polytinker.gateway.errors import classify
from polytinker.gateway.limits import BodyBudget, InFlight
from polytinker.gateway.tinker_render import failed
from polytinker.gateway.wire import prompt_ints
from polytinker.transport.protocol import PATH_WORD, scrub_paths


# --- error messages carry no server paths -------------------------------------------------------------
def test_error_messages_carry_no_server_paths_but_keep_the_tenants_names() -> None:
    relayed = ConfigError("/srv/rt/state/adapters/team-a/job-x/agent/v1 is not a peft adapter directory")
    status, body = classify(relayed)
    assert status == 400 and "/srv" not in body["error"]["message"]
    assert body["error"]["message"] == f"{PATH_WORD} is not a peft adapter directory"
    kept = "tinker://job-1/weights/w1 and polytinker://job-1/default@3 and polytinker-ckpt://job-1/w1"
    assert scrub_paths(f"{kept}: see /var/lib/x/y.json.") == f"{kept}: see {PATH_WORD}."
    assert scrub_paths("use /v1/completions, 1/2 and/or x / y") == "use /v1/completions, 1/2 and/or x / y"
    assert scrub_paths("could not read '/home/u/.cache/m/config.json' (file:///etc/passwd)") == (
        f"could not read '{PATH_WORD}' ({PATH_WORD})"
    )
    # A call that failed after submission reaches the SDK through failed(): scrubbed as well.
    report = failed(ConfigError("/tmp/state/named/w1 is not a learner checkpoint"))
    assert report["category"] == "user" and "/tmp" not in report["error"]
    crash = failed(RemoteError("at /opt/polytinker/learner.py", code="handler"))
    assert crash["category"] == "server" and "/opt" not in crash["error"]


def test_a_restarting_runtime_is_a_503_the_sdk_retries_not_an_internal_error() -> None:
    from polytinker.errors import PeerDeadError, RuntimeDead, WorkerUnavailable
    from polytinker.gateway.errors import error_response

    for exc in (WorkerUnavailable("worker learner-0 is not available (waited 60 s)"), PeerDeadError("gone")):
        status, body = classify(exc)
        assert status == 503 and body["error"]["code"] == "unavailable"
        assert error_response(exc).headers["retry-after"] == "2"
        report = failed(exc)  # in a future: what happened, not an error id alone
        assert report["category"] == "server" and report["error"] == str(exc)
    assert classify(RuntimeDead("actor 'engine-0' is down"))[0] == 503


# --- request bytes in flight ----------------------------------------------------------------------------
def test_in_flight_bounds_each_key_and_the_total() -> None:
    budget = InFlight(per_key=10, total=15)
    assert budget.take("a", 10) and not budget.take("a", 1)  # a's bound
    assert budget.take("b", 5) and not budget.take("c", 1)  # the total's
    budget.give("a", 10)
    assert budget.take("c", 1) and budget.held() == 6 and budget.held("a") == 0


async def _drive(budget: InFlight, key: str, body: bytes, declared: bool) -> tuple[int, dict[str, str], int]:
    """One request through BodyBudget in front of an app that reads the whole body: (status,
    headers, the bytes the key held while the app read)."""
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            while (await receive()).get("more_body"):
                pass
        except OverloadedError:
            await send({"type": "http.response.start", "status": 429, "headers": []})
        else:
            seen.append(budget.held(key))
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    chunks = [body[i : i + 4] for i in range(0, len(body), 4)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    headers = [(b"x-api-key", key.encode())]
    if declared:
        headers.append((b"content-length", str(len(body)).encode()))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await BodyBudget(app, budget=budget)({"type": "http", "headers": headers}, receive, send)
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start.get("headers", [])}, (seen or [-1])[0]


def test_the_body_budget_refuses_a_key_over_its_bytes_and_gives_them_back() -> None:
    budget = InFlight(per_key=10, total=100)
    assert asyncio.run(_drive(budget, "alice", b"x" * 8, declared=True))[::2] == (200, 8)
    assert budget.held() == 0  # given back when the answer is sent
    budget.take("alice", 5)  # another body of alice's in flight
    status, headers, _ = asyncio.run(_drive(budget, "alice", b"x" * 8, declared=True))
    assert status == 429 and headers["retry-after"] == "1"  # refused before a byte is read
    assert asyncio.run(_drive(budget, "bob", b"x" * 8, declared=True))[0] == 200  # bob is not alice
    # Without a declared length, bytes are charged as they arrive, and refused past the bound.
    assert asyncio.run(_drive(budget, "alice", b"x" * 4, declared=False))[::2] == (200, 9)
    assert asyncio.run(_drive(budget, "alice", b"x" * 8, declared=False))[0] == 429
    assert budget.held("alice") == 5 and budget.held() == 5


# --- the body checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "body", "needle"),
    [
        (checks.CREATE_MODEL, {"session_id": "s", "base_model": MODEL, "lora_config": {"rank": 0}}, "lora_config.rank"),
        (
            checks.CREATE_MODEL,
            {"session_id": "s", "base_model": MODEL, "lora_config": {"rank": "8"}},
            "lora_config.rank",
        ),
        (checks.CREATE_MODEL, {"session_id": "s", "base_model": MODEL, "lora_config": {"rank": 5000}}, "1..1024"),
        (checks.CREATE_MODEL, {"session_id": "s", "base_model": MODEL, "lora_config": {"rank": True}}, "rank"),
        (checks.CREATE_MODEL, {"session_id": 7, "base_model": MODEL}, "session_id must be a string"),
        (checks.CREATE_MODEL, {"session_id": "s", "base_model": MODEL, "model_seq_id": -1}, "model_seq_id"),
        (
            checks.CREATE_MODEL,
            {"session_id": "s", "base_model": MODEL, "lora_config": {"rank": 4, "train_mlp": "no"}},
            "lora_config.train_mlp",
        ),
        (
            checks.CREATE_MODEL,
            {"session_id": "s", "base_model": MODEL, "user_metadata": {"k": "v" * 20_000}},
            "user_metadata.k",
        ),
        (checks.OPTIM_STEP, {"model_id": "m", "adam_params": {"learning_rate": math.nan}}, "adam_params.learning_rate"),
        # The SDK sends learning_rate=inf (or NaN) as null: refused, not taken as absent.
        (checks.OPTIM_STEP, {"model_id": "m", "adam_params": {"learning_rate": None}}, "adam_params.learning_rate"),
        (checks.OPTIM_STEP, {"model_id": "m", "adam_params": {"beta1": 1.0}}, "adam_params.beta1"),
        (checks.OPTIM_STEP, {"model_id": "m", "adam_params": {"eps": 0}}, "adam_params.eps"),
        (checks.OPTIM_STEP, {"model_id": ["m"]}, "model_id"),
        (checks.ASAMPLE, {"num_samples": 3_000_000}, "num_samples"),
        (checks.ASAMPLE, {"num_samples": 0}, "num_samples"),
        (checks.ASAMPLE, {"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        (checks.ASAMPLE, {"sampling_params": {"temperature": math.inf}}, "sampling_params.temperature"),
        (checks.ASAMPLE, {"sampling_params": {"temperature": None}}, "sampling_params.temperature"),
        (checks.ASAMPLE, {"sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (checks.ASAMPLE, {"sampling_params": {"seed": -1}}, "sampling_params.seed"),
        (checks.ASAMPLE, {"sampling_params": {"stop": [1, "x"]}}, "sampling_params.stop"),
        (checks.ASAMPLE, {"sampling_params": {"stop": [7] * 65}}, "sampling_params.stop"),
        (checks.ASAMPLE, {"sampling_params": {"stop": ["ok", ""]}}, "sampling_params.stop[1]"),
        (checks.ASAMPLE, {"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
        (checks.SAVE, {"model_id": "m", "ttl_seconds": 1.5}, "ttl_seconds"),
        (checks.SAVE_EXTERNAL, {"model_id": "m", "path": "x", "age_encryption_recipients": ["k"] * 11}, "recipients"),
        (checks.REQUEST, {"request_id": {"$gt": ""}}, "request_id"),
        (checks.FINISH_SESSION, {"reason": "done"}, "reason must be an object"),
    ],
)
def test_a_bad_field_is_refused_naming_it(spec: checks.Spec, body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        checks.check_body(body, spec)


def test_good_bodies_pass_the_checks() -> None:
    sdk_model = {
        "session_id": "s",
        "model_seq_id": 0,
        "base_model": MODEL,
        "lora_config": {"rank": 8, "seed": None, "train_unembed": True, "train_mlp": True, "train_attn": False},
        "optimizer_config": {"type": "adamw"},
        "user_metadata": {"experiment": "a", "nested": {"k": [1, 2]}},
        "type": "create_model",
    }
    checks.check_body(sdk_model, checks.CREATE_MODEL)
    params = {"max_tokens": None, "seed": 3, "stop": [2, 3], "temperature": 0, "top_k": -1, "top_p": 1}
    checks.check_body({"num_samples": 4, "sampling_params": params, "prompt_logprobs": True}, checks.ASAMPLE)
    checks.check_body({"model_id": "m", "adam_params": {"learning_rate": 1, "grad_clip_norm": 0.0}}, checks.OPTIM_STEP)


def test_prompts_and_losses_are_checked_before_they_are_used() -> None:
    assert prompt_ints({"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, {"tokens": [3]}]}) == (1, 2, 3)
    for prompt, needle in [
        ({"chunks": [{"tokens": [1, -2]}]}, r"prompt\.chunks\[0\]\.tokens\[1\]"),
        ({"chunks": [{"tokens": [1, 2.5]}]}, r"tokens\[1\]"),
        ({"chunks": [{"tokens": [True]}]}, r"tokens\[0\]"),
        ({"chunks": [{"tokens": [1]}] * 5000}, "chunks"),
        ({"chunks": []}, "at least one token"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            prompt_ints(prompt)
    with pytest.raises(NotBuiltError, match=r"chunks\[0\]"):
        prompt_ints({"chunks": [{"type": "image", "data": "..."}]})
    with pytest.raises(ConfigError, match="loss_fn must be one of"):
        checks.check_loss("no-such-loss", {})
    with pytest.raises(ConfigError, match=r"loss_fn_config\.beta"):
        checks.check_loss("dro", {"beta": math.nan})
    with pytest.raises(ConfigError, match=r"loss_fn_config\.beta must be a finite number"):
        checks.check_loss("dro", {"beta": None})
    with pytest.raises(ConfigError, match="loss_fn_config: unknown loss_fn_config keys"):
        checks.check_loss("ppo", {"nope": 1.0})
    with pytest.raises(NotBuiltError, match=r"loss_fn_config\.mode"):
        checks.check_loss("ppo", {"mode": "fast"})
    assert checks.check_loss("ppo", {"clip_low_threshold": 0.9}) == {"clip_low_threshold": 0.9}
    assert checks.check_loss("cross_entropy", {}) is None


def _fb_body(datums: list[dict[str, Any]], loss_fn: str = "cross_entropy") -> bytes:
    """A ForwardBackwardRequest as the SDK encodes it, from token lists and loss input arrays."""
    msg = _proto._CLASSES["ForwardBackwardRequest"](model_id="m", loss_fn=loss_fn)
    for d in datums:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(d["tokens"], dtype=np.int32).tobytes()
        for name, values in d["inputs"].items():
            arr = np.asarray(values)
            arr = arr.astype(np.int64 if arr.dtype.kind == "i" else np.float32)  # as the SDK sends them
            tensor = datum.loss_fn_inputs[name]
            tensor.dense = arr.tobytes()
            tensor.dtype = _proto.DTYPE_INT64 if arr.dtype.kind == "i" else _proto.DTYPE_FLOAT32
            tensor.shape.extend(arr.shape)
    return bytes(msg.SerializeToString())


def _checked(datums: list[dict[str, Any]], loss_fn: str = "cross_entropy", vocab: int = 100) -> None:
    req = _proto.decode_forward_backward(_fb_body(datums, loss_fn))
    rl_loss = None if loss_fn == "cross_entropy" else loss_fn
    for i, d in enumerate(req["data"]):
        checks.check_datum(d, i, vocab, rl_loss)


def test_each_datum_is_checked_and_named_by_its_index() -> None:
    good = {"tokens": [1, 2, 3], "inputs": {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)}}
    rl = {
        "tokens": [1, 2, 3],
        "inputs": {
            "target_tokens": np.array([2, 3, 4]),
            "advantages": np.ones(3, np.float32),
            "logprobs": -np.ones(3, np.float32),
        },
    }
    _checked([good, good])
    _checked([rl], "importance_sampling")
    no_logprobs = {"tokens": [1, 2, 3], "inputs": {"target_tokens": np.array([2, 3, 4]), "advantages": np.ones(3)}}
    nan = {**rl, "inputs": {**rl["inputs"], "advantages": np.array([0, np.nan, 1], np.float32)}}
    for datums, loss_fn, needle in [
        ([rl, rl, no_logprobs], "importance_sampling", r"data\[2\]\.loss_fn_inputs\.logprobs is missing"),
        ([rl, nan], "ppo", r"data\[1\]\.loss_fn_inputs\.advantages\[1\] must be a finite number"),
        ([{**good, "tokens": [1, 2, 300]}], "cross_entropy", r"data\[0\]\.model_input\[2\]"),
        ([{**good, "tokens": [1, -5, 3]}], "cross_entropy", r"data\[0\]\.model_input\[1\]"),
        ([{**good, "inputs": {"target_tokens": np.array([2, 3])}}], "cross_entropy", r"target_tokens must be one"),
        ([{**good, "inputs": {"target_tokens": np.ones(3, np.float32)}}], "cross_entropy", "integer tensor"),
        ([{**good, "inputs": {"weights": np.ones(3, np.float32)}}], "cross_entropy", r"target_tokens is missing"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            _checked(datums, loss_fn)


def test_forward_backward_counts_are_checked_before_anything_is_built() -> None:
    msg = _proto._CLASSES["ForwardBackwardRequest"](model_id="m", loss_fn="cross_entropy")
    for _ in range(100_001):
        msg.data.add()
    with pytest.raises(ConfigError, match=r"1\.\.100000 datums"):
        _proto.decode_forward_backward(bytes(msg.SerializeToString()))
    with pytest.raises(ConfigError, match=r"1\.\.100000 datums"):
        _proto.decode_forward_backward(b"")
    one = _proto._CLASSES["ForwardBackwardRequest"](model_id="m")
    tensor = one.data.add().loss_fn_inputs["weights"]
    tensor.dense, tensor.dtype = np.ones(4, np.float32).tobytes(), _proto.DTYPE_FLOAT32
    tensor.shape.extend([1 << 40, 1 << 40])
    with pytest.raises(ConfigError, match=r"data\[0\]\.loss_fn_inputs\.weights: the tensor's shape"):
        _proto.decode_forward_backward(bytes(one.SerializeToString()))


# --- a real serve ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("hostile-serve")) as s:
        yield s


@pytest.fixture(scope="module")
def tinker() -> Any:
    return pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def alice(serve: Serve, tinker: Any) -> Iterator[Any]:
    sc = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def alice_run(alice: Any) -> Any:
    return alice.create_lora_training_client(base_model=MODEL, rank=4).result()


def _post(serve: Serve, path: str, body: Any, key: str = KEY, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"X-API-Key": key, "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(serve.url + path, content=content, headers=headers, timeout=60, **kw)


def _refused(r: httpx.Response, needle: str, status: int = 400) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert needle in message, message
    assert "Traceback" not in r.text and "/polytinker/" not in r.text


@pytest.mark.slow
def test_hostile_tinker_bodies_are_400s_naming_the_field(serve: Serve, alice: Any, alice_run: Any) -> None:
    session = alice_run.model_id.partition(":")[0]
    model = alice_run.model_id
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sample = {"base_model": MODEL, "prompt": prompt, "sampling_params": {"max_tokens": 2}}
    cases: list[tuple[str, Any, str]] = [
        (
            "/api/v1/create_model",
            {"session_id": session, "base_model": MODEL, "lora_config": {"rank": 0}},
            "lora_config.rank",
        ),
        (
            "/api/v1/create_model",
            {"session_id": session, "base_model": MODEL, "lora_config": {"rank": 9999}},
            "lora_config.rank",
        ),
        ("/api/v1/create_model", {"session_id": [session], "base_model": MODEL}, "session_id"),
        (
            "/api/v1/create_model",
            {
                "session_id": session,
                "base_model": MODEL,
                "lora_config": {"rank": 4, "train_mlp": False, "train_attn": False, "train_unembed": False},
            },
            "nothing to train",
        ),
        (
            "/api/v1/create_model",
            {"session_id": session, "base_model": MODEL, "optimizer_config": {"type": "dimuon"}},
            "optimizer_config.type",
        ),
        (
            "/api/v1/optim_step",
            {"model_id": model, "adam_params": {"learning_rate": "fast"}},
            "adam_params.learning_rate",
        ),
        (
            "/api/v1/optim_step",
            b'{"model_id": "%s", "adam_params": {"learning_rate": NaN}}' % model.encode(),
            "adam_params.learning_rate",
        ),
        ("/api/v1/asample", {**sample, "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ("/api/v1/asample", {**sample, "prompt": {"chunks": [{"tokens": [1, 10**12]}]}}, "prompt.chunks[0].tokens[1]"),
        ("/api/v1/asample", {**sample, "prompt": {"chunks": [{"tokens": [1, 49152]}]}}, "prompt.tokens[1]"),
        ("/api/v1/asample", {**sample, "sampling_params": {"stop": [10**6]}}, "sampling_params.stop[0]"),
        ("/api/v1/asample", {**sample, "sampling_params": {"top_k": 10**30}}, "sampling_params.top_k"),
        ("/api/v1/asample", {**sample, "num_samples": "2"}, "num_samples"),
        ("/api/v1/save_weights", {"model_id": model, "ttl_seconds": 10**20}, "ttl_seconds"),
        ("/api/v1/save_weights_for_sampler", {"model_id": {"a": 1}}, "model_id"),
        ("/api/v1/load_weights", {"model_id": model, "path": 5, "optimizer": False}, "path"),
        ("/api/v1/retrieve_future", {"request_id": 12}, "request_id"),
        ("/api/v1/session_heartbeat", {}, "session_id"),
        (
            "/api/v1/create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": -3},
            "sampling_session_seq_id",
        ),
        ("/api/v1/create_session", {"tags": "x", "sdk_version": "1"}, "tags"),
    ]
    for path, body, needle in cases:
        _refused(_post(serve, path, body), needle)
    start = time.monotonic()
    _refused(_post(serve, "/api/v1/asample", {**sample, "num_samples": 3_000_000}), "num_samples")
    assert time.monotonic() - start < 5  # no 3,000,000 ids built first


@pytest.mark.slow
def test_the_sdk_gets_a_400_for_what_would_fail_after_submission(tinker: Any, alice: Any, alice_run: Any) -> None:
    from tinker import types

    with pytest.raises(tinker.BadRequestError, match=r"lora_config\.rank"):
        alice.create_lora_training_client(base_model=MODEL, rank=0).result()
    with pytest.raises(tinker.BadRequestError, match=r"lora_config\.rank"):
        alice.create_lora_training_client(base_model=MODEL, rank=4096).result()
    tokens = [1, 2, 3, 4]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.logprobs"):
        alice_run.forward_backward([datum], "importance_sampling").result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [1.0, math.nan, 1.0], "logprobs": [-1.0] * 3},
    )
    with pytest.raises(tinker.BadRequestError, match=r"data\[1\]\.loss_fn_inputs\.advantages\[1\]"):
        ok = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [1.0] * 3, "logprobs": [-1.0] * 3},
        )
        alice_run.forward_backward([ok, bad], "ppo").result()
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    with pytest.raises(tinker.BadRequestError, match=r"sampling_params\.max_tokens must be a whole number in 1\.\."):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=0)).result()
    assert len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=1)).result().sequences) == 2


@pytest.mark.slow
def test_hostile_openai_bodies_are_400s_naming_the_field(serve: Serve) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deep = "[" * 5000 + "]" * 5000
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]
    for body, needle in [
        ({**base, "n": "2"}, "n"),
        ({**base, "max_tokens": 0}, "max_tokens"),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % MODEL.encode(),
            "temperature",
        ),
        ({**base, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({**base, "top_k": 10**30}, "top_k"),
        ({**base, "model": 7}, "model"),
        ({**base, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ]:
        _refused(_post(serve, "/v1/chat/completions", body), needle)
    # Tool-call arguments nested past any template's patience: kept as text, never a 500.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": call}]
    r = _post(serve, "/v1/chat/completions", {**base, "messages": [*messages, {"role": "user", "content": "ok"}]})
    assert r.status_code in (200, 400), r.text


@pytest.mark.slow
def test_telemetry_needs_a_key_a_small_body_and_few_uploads_at_once(serve: Serve) -> None:
    batch = {"session_id": "s", "events": []}
    _refused(httpx.post(serve.url + "/api/v1/telemetry", json=batch, timeout=30), "no API key", 401)
    _refused(_post(serve, "/api/v1/telemetry", batch, key="tml-not-a-key-of-this-runtime"), "unknown API key", 401)
    assert _post(serve, "/api/v1/telemetry", batch).status_code == 200
    _refused(_post(serve, "/api/v1/telemetry", b" " * (2 << 20)), "larger than", 413)
    with _stalled(serve, "/api/v1/telemetry", KEY, 4, length=1000):  # alice's four uploads, hanging
        deadline = time.monotonic() + 10
        while (r := _post(serve, "/api/v1/telemetry", batch)).status_code != 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.headers["retry-after"] == "1"
        assert _post(serve, "/api/v1/telemetry", batch, key=KEY_BOB).status_code == 200  # bob is not held up
    _eventually_not_429(serve, "/api/v1/telemetry", batch)


@pytest.mark.slow
def test_a_tenant_with_too_many_bytes_in_flight_waits_and_others_do_not(serve: Serve) -> None:
    body = {"model_id": "nope"}
    # Two forward_backward bodies of the largest size, declared and hanging: all alice may have in flight.
    with _stalled(serve, "/api/v1/forward_backward", KEY, 2, length=256 << 20, kind="application/x-protobuf"):
        deadline = time.monotonic() + 10
        while (r := _post(serve, "/api/v1/get_info", body)).status_code != 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert "too many request bytes in flight" in r.json()["error"]["message"] and r.headers["retry-after"]
        other = _post(serve, "/api/v1/get_info", body, key=KEY_BOB)
        assert other.status_code == 400 and "unknown model" in other.text  # bob's call goes through
    _eventually_not_429(serve, "/api/v1/get_info", body)


@pytest.mark.slow
def test_one_tenants_download_urls_survive_another_signing_many(serve: Serve, tinker: Any, alice_run: Any) -> None:
    bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
    bob_run = bob.create_lora_training_client(base_model=MODEL, rank=4).result()
    bob_path = bob_run.save_weights_external("bobs").result().path
    bob_url = next(
        iter(
            tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
            .get_external_weights_urls(bob_path)
            .result()
            .urls.values()
        )
    )
    alice_path = alice_run.save_weights_external("alices").result().path
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    alice_urls = [next(iter(rest.get_external_weights_urls(alice_path).result().urls.values())) for _ in range(17)]
    assert httpx.get(bob_url, timeout=30).status_code == 200  # alice's 17 did not push bob's out
    assert httpx.get(alice_urls[0], timeout=30).status_code == 404  # her own oldest made room
    assert httpx.get(alice_urls[-1], timeout=30).status_code == 200
    bob.close("success").result()


@pytest.mark.slow
def test_a_relayed_error_names_no_server_path(serve: Serve, tinker: Any, alice: Any, alice_run: Any) -> None:
    path = alice_run.save_state("to-break").result().path
    meta = next(p for p in (serve.root / "state").rglob("meta.json") if "to-break" in str(p))
    meta.unlink()  # the checkpoint's files are broken behind the scheduler's back
    with pytest.raises(tinker.TinkerError) as info:
        alice.create_training_client_from_state(path).result()
    message = str(info.value)
    assert str(serve.root) not in message and "/state/" not in message, message
    assert PATH_WORD in message and "not a learner checkpoint" in message, message


# --- raw sockets: uploads that hang ------------------------------------------------------------------------
def _stalled(
    serve: Serve, path: str, key: str, count: int, *, length: int, kind: str = "application/json"
) -> contextlib.AbstractContextManager[None]:
    """``count`` requests that declare ``length`` bytes, send a few and hang until the block ends."""
    return stalled(serve.port, path, key, count, length=length, kind=kind)


def _eventually_not_429(serve: Serve, path: str, body: Any) -> None:
    """The key's bytes and uploads are given back once its hanging requests are gone."""
    deadline = time.monotonic() + 15
    while (r := _post(serve, path, body)).status_code == 429:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


# --- a hostile neighbour beside a good tenant, then a restart (last: it restarts serve) ----------------
ALICE_TOKENS = [1, 504, 3458, 314, 4154, 28, 216, 6464, 30, 2]


def _alice_run(service: Any, name: str) -> dict[str, Any]:
    """Alice's loop: three steps of cross entropy on one datum (seeded adapter), each followed by
    three concurrent greedy samples and a logprob score of its weights."""
    from tinker import types

    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    toks = ALICE_TOKENS
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
    )
    prompt = types.ModelInput.from_ints(toks[:4])
    out: dict[str, Any] = {"losses": [], "logprobs": [], "samples": 0, "paths": []}
    for step in range(3):
        out["losses"].append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler(f"{name}-{step}").result().path
        sampler = tc.create_sampling_client(path).result()
        calls = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=0)) for _ in range(3)]
        out["samples"] += sum(len(c.result().sequences) for c in calls)
        out["logprobs"].append(sampler.compute_logprobs(types.ModelInput.from_ints(toks)).result()[1:])
        out["paths"].append(path)
    out["model_id"] = tc.model_id
    return out


def _bob_bad_inputs(serve: Serve, tinker: Any, stop: Any) -> list[tuple[str, str]]:
    """Bob's bad inputs through the SDK and raw HTTP, in a loop until ``stop``: what each answered
    that was not a 4xx naming the expected field (an empty list is what the test wants)."""
    from tinker import types

    bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
    run = bob.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = bob.create_sampling_client(base_model=MODEL).result()
    hog = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1024, types.SamplingParams(max_tokens=16))

    def datum(**inputs: list[Any]) -> Any:
        base: dict[str, list[Any]] = {"target_tokens": [2, 3, 4], "advantages": [1.0] * 3, "logprobs": [-1.0] * 3}
        return types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={**base, **inputs})

    params = types.SamplingParams(max_tokens=2)
    sdk_calls: list[tuple[str, Any]] = [
        ("lora_config.rank", lambda: bob.create_lora_training_client(base_model=MODEL, rank=0).result()),
        ("target_tokens", lambda: run.forward_backward([datum(target_tokens=[2, 10**6, 4])], "ppo").result()),
        ("advantages", lambda: run.forward_backward([datum(advantages=[1.0, math.nan, 1.0])], "ppo").result()),
        ("logprobs", lambda: run.forward_backward([datum(logprobs=[-1.0, math.inf, -1.0])], "ppo").result()),
        ("learning_rate", lambda: run.optim_step(types.AdamParams(learning_rate=math.inf)).result()),
        ("tokens", lambda: sampler.sample(types.ModelInput.from_ints([1, 49152]), 1, params).result()),
        ("num_samples", lambda: sampler.sample(types.ModelInput.from_ints([1]), 10**6, params).result()),
        (
            "max_tokens",
            lambda: sampler.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=0)).result(),
        ),
    ]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    raw: list[tuple[str, Any]] = [
        ("num_samples", {"base_model": MODEL, "prompt": prompt, "num_samples": "9", "sampling_params": {}}),
        ("prompt", {"base_model": MODEL, "prompt": {"chunks": [{"tokens": [-5]}]}, "sampling_params": {}}),
        ("temperature", b'{"base_model": "%s", "sampling_params": {"temperature": NaN}}' % MODEL.encode()),
    ]
    wrong: list[tuple[str, str]] = []
    while not stop.is_set():
        for field, call in sdk_calls:
            try:
                call()
                wrong.append((field, "accepted"))
            except tinker.BadRequestError as exc:
                if field not in str(exc):
                    wrong.append((field, str(exc)))
            except Exception as exc:  # anything but a 400 is a failure of the door
                wrong.append((field, f"{type(exc).__name__}: {exc}"))
        for field, body in raw:
            r = _post(serve, "/api/v1/asample", body, key=KEY_BOB)
            if r.status_code != 400 or field not in r.text:
                wrong.append((field, f"{r.status_code} {r.text[:200]}"))
    with contextlib.suppress(Exception):
        hog.result(timeout=1)  # still running, most likely: closing the session ends it
    bob.close("success").result()
    return wrong


@pytest.mark.slow
def test_a_hostile_neighbour_costs_a_good_tenant_nothing_and_a_restart_keeps_her_runs(
    serve: Serve, tinker: Any
) -> None:
    """Alice's loop alone, then again while bob sends every bad input above (and keeps a
    1024-sample request in flight): every one of bob's calls is a 400 naming its field, alice's
    calls all succeed with the same losses and logprobs as alone, and after a restart of serve
    her runs are listed and her saved weights score the same."""
    import threading

    alone_client = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    alone = _alice_run(alone_client, "alone")
    stop = threading.Event()
    wrong: list[tuple[str, str]] = []
    bob = threading.Thread(target=lambda: wrong.extend(_bob_bad_inputs(serve, tinker, stop)))
    bob.start()
    try:
        time.sleep(2.0)  # bob's first bad calls and his hog are in before alice starts
        beside = _alice_run(tinker.ServiceClient(base_url=serve.url, api_key=KEY), "beside")
    finally:
        stop.set()
        bob.join(300)
    assert not bob.is_alive()
    assert wrong == [], wrong[:5]
    assert beside["samples"] == alone["samples"] == 18
    assert beside["losses"] == pytest.approx(alone["losses"], rel=1e-4)
    for mine, ref in zip(beside["logprobs"], alone["logprobs"], strict=True):
        assert mine == pytest.approx(ref, abs=1e-4)

    serve.stop()
    serve.start()
    fresh = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    listed = {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    for run in (alone, beside):
        assert rest.get_training_run(run["model_id"]).result().training_run_id in listed
    from tinker import types

    again = fresh.create_sampling_client(model_path=beside["paths"][-1]).result()
    scored = again.compute_logprobs(types.ModelInput.from_ints(ALICE_TOKENS)).result()[1:]
    assert scored == pytest.approx(beside["logprobs"][-1], abs=1e-3)
