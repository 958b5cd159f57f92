"""Every tinker SDK release from 0.22 on, against ``polytinker serve --http``.

Releases before 0.25 send ``forward_backward`` as JSON unless the client config advertises
``proto_write_fwdbwd``, and 0.22.0's ``forward`` always posts JSON to ``/api/v1/forward``: the
gateway advertises protobuf and reads JSON too, with the same checks. The unit tests compare the
JSON decoder with the protobuf one and feed it hostile bodies; the ``slow`` tests post JSON
bodies to a real server beside the installed SDK (0.38), and run a short script through the
oldest release, 0.22.0, in its own environment (``make oldest-sdk-venv``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _serve import KEY, Serve

from polytinker.engine.models import TINY_RANDOM
from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway import _proto
from polytinker.gateway.fb_json import decode_forward_backward_json
from polytinker.gateway.tinker_api import CLIENT_CONFIG, PROTO

ROOT = Path(__file__).resolve().parent.parent
OLDEST_SDK_PYTHON = ROOT / ".venv-tinker-0.22" / "bin" / "python"


def _json_datum(tokens: list[int], inputs: dict[str, tuple[list[Any], str]]) -> dict[str, Any]:
    """A datum as tinker 0.22 writes it in a JSON body (its pydantic ``model_dump``)."""
    return {
        "loss_fn_inputs": {k: {"data": v, "dtype": dt, "shape": [len(v)]} for k, (v, dt) in inputs.items()},
        "model_input": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
    }


def _json_body(data: list[dict[str, Any]], loss_fn: str = "cross_entropy", **extra: Any) -> dict[str, Any]:
    fb = {"data": data, "loss_fn": loss_fn, **extra}
    return {"forward_backward_input": fb, "model_id": "m", "seq_id": 1}


GOOD = _json_datum([5, 17, 230], {"target_tokens": ([17, 230, 9], "int64"), "weights": ([0.0, 1.0, 1.0], "float32")})
RL = _json_datum(
    [5, 17, 230],
    {
        "target_tokens": ([17, 230, 9], "int64"),
        "advantages": ([1.0, -0.5, 2], "float32"),
        "logprobs": ([-1.0, -2.0, -0.25], "float32"),
    },
)


def test_the_client_config_makes_releases_before_0_25_send_protobuf() -> None:
    assert CLIENT_CONFIG["proto_write_fwdbwd"] is True and CLIENT_CONFIG["fwd_via_fwdbwd"] is True
    assert CLIENT_CONFIG["proto_compress_fwdbwd"] is False  # compressed bodies are refused


def test_a_json_body_decodes_as_its_protobuf_twin() -> None:
    body = _json_body([GOOD, RL], "ppo", loss_fn_config={"clip_low_threshold": 0.8})
    msg = _proto._CLASSES["ForwardBackwardRequest"](model_id="m", seq_id=1, loss_fn="ppo")
    msg.loss_fn_config["clip_low_threshold"] = 0.8
    for d in (GOOD, RL):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray([5, 17, 230], np.int32).tobytes()
        for name, t in d["loss_fn_inputs"].items():
            dense = np.asarray(t["data"], np.int64 if t["dtype"] == "int64" else np.float32)
            tensor = datum.loss_fn_inputs[name]
            tensor.dense, tensor.shape[:] = dense.tobytes(), t["shape"]
            tensor.dtype = _proto.DTYPE_INT64 if t["dtype"] == "int64" else _proto.DTYPE_FLOAT32
    from_json = decode_forward_backward_json(json.loads(json.dumps(body)), forward_only=False)
    from_proto = _proto.decode_forward_backward(bytes(msg.SerializeToString()))
    for key in ("model_id", "seq_id", "loss_fn", "loss_fn_config", "forward_only"):
        assert from_json[key] == from_proto[key], key
    for a, b in zip(from_json["data"], from_proto["data"], strict=True):
        assert a["tokens"].dtype == b["tokens"].dtype and a["tokens"].tolist() == b["tokens"].tolist()
        assert a["loss_fn_inputs"].keys() == b["loss_fn_inputs"].keys()
        for name, arr in a["loss_fn_inputs"].items():
            assert arr.dtype == b["loss_fn_inputs"][name].dtype and np.array_equal(arr, b["loss_fn_inputs"][name])
    forward = {"forward_input": body["forward_backward_input"], "model_id": "m"}
    assert decode_forward_backward_json(forward, forward_only=True)["forward_only"] is True


def _inputs(**kw: Any) -> dict[str, Any]:
    return {**GOOD, "loss_fn_inputs": {**GOOD["loss_fn_inputs"], **kw}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model_id": "m"}, "forward_backward_input must be an object"),
        ({**_json_body([GOOD]), "model_id": 7}, "model_id must be a string"),
        ({**_json_body([GOOD]), "seq_id": True}, "seq_id must be a whole number"),
        (_json_body([GOOD], loss_fn=None), "forward_backward_input.loss_fn must be a string"),
        (_json_body([]), "forward_backward_input.data must be a list of 1..100000 datums, got 0"),
        (_json_body(GOOD), "forward_backward_input.data must be a list"),
        (_json_body([GOOD], loss_fn_config=[1.0]), "forward_backward_input.loss_fn_config must be an object"),
        (_json_body([GOOD, "datum"]), "data[1] must be a Datum object"),
        (_json_body([{**GOOD, "model_input": [1, 2]}]), "data[0].model_input must be a ModelInput"),
        (_json_body([{**GOOD, "model_input": {"chunks": [{"tokens": [1, True]}]}}]), "chunks[0].tokens[1]"),
        (_json_body([{**GOOD, "model_input": {"chunks": [{"tokens": [1, 2**40]}]}}]), "chunks[0].tokens[1]"),
        (_json_body([{**GOOD, "model_input": {"chunks": [{"tokens": "123"}]}}]), "chunks[0].tokens must be a list"),
        (_json_body([{**GOOD, "model_input": {"chunks": [{"type": "image"}]}}]), "chunks of type 'image'"),
        (_json_body([_inputs(weights={"data": [1, None, 1], "dtype": "float32"})]), "weights.data[1] must be a finite"),
        (_json_body([_inputs(weights={"data": [1, "1", 1], "dtype": "float32"})]), "weights.data[1]"),
        (_json_body([_inputs(weights={"data": [1, [1], 1], "dtype": "float32"})]), "weights.data[1]"),
        (_json_body([_inputs(weights={"data": [1.0], "dtype": "bfloat16"})]), "weights.dtype must be 'int64'"),
        (_json_body([_inputs(weights=[1.0, 1.0, 1.0])]), "data[0].loss_fn_inputs.weights must be a tensor"),
        (_json_body([_inputs(target_tokens={"data": [1, 2.5, 3], "dtype": "int64"})]), "target_tokens.data[1]"),
        (_json_body([_inputs(weights={"data": [1.0] * 4, "dtype": "float32", "shape": [2, 3]})]), "shape [2, 3]"),
        (_json_body([_inputs(weights={"data": [1.0], "dtype": "float32", "shape": [-1]})]), "weights.shape[0]"),
        (
            _json_body([_inputs(weights={"data": [1.0], "dtype": "float32", "sparse_crow_indices": [0, 1]})]),
            "weights must be dense",
        ),
    ],
)
def test_a_bad_json_field_is_refused_naming_it(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as raised:
        decode_forward_backward_json(body, forward_only=False)
    assert needle in str(raised.value), str(raised.value)


def test_json_counts_are_checked_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"1\.\.100000 datums, got 100001"):
        decode_forward_backward_json(_json_body([None] * 100_001), forward_only=False)
    huge = {"chunks": [{"tokens": [1] * (1 << 19)}, {"tokens": [1] * (1 << 19)}, {"tokens": [1]}]}
    with pytest.raises(ConfigError, match=r"data\[0\]\.model_input must hold at most 1048576 tokens"):
        decode_forward_backward_json(_json_body([{**GOOD, "model_input": huge}]), forward_only=False)
    with pytest.raises(NotBuiltError, match="loss_fn_config_v2"):
        decode_forward_backward_json(_json_body([GOOD], loss_fn_config_v2={}), forward_only=False)


# --- a real serve ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("sdk-versions-serve"), model=TINY_RANDOM) as s:
        yield s


def _post(serve: Serve, path: str, body: Any) -> httpx.Response:
    headers = {"X-API-Key": KEY, "Content-Type": "application/json"}
    return httpx.post(serve.url + path, content=json.dumps(body).encode(), headers=headers, timeout=60)


def _result(serve: Serve, answer: httpx.Response) -> Any:
    """The result of a call the gateway filed, read as the SDK reads it (protobuf for a forward)."""
    assert answer.status_code == 200, answer.text
    while True:
        r = _post(serve, "/api/v1/retrieve_future", {"request_id": answer.json()["request_id"]})
        if r.headers["content-type"].startswith(PROTO):
            msg = _proto._CLASSES["ForwardBackwardOutput"]()
            msg.ParseFromString(r.content)
            return msg
        if r.json().get("type") != "try_again":
            return r.json()


def _logprobs(out: Any) -> list[list[float]]:
    field = out.loss_fn_outputs[0].fields["logprobs"]
    offsets = np.frombuffer(field.offsets, np.int64)
    data = np.frombuffer(field.data, np.float32)
    return [data[a // 4 : b // 4].tolist() for a, b in itertools.pairwise(offsets)]


@pytest.mark.slow
def test_json_bodies_score_as_the_sdks_protobuf_and_bad_ones_are_400s(serve: Serve) -> None:
    tinker = pytest.importorskip("tinker")
    from tinker import types

    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=TINY_RANDOM, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 17, 230]),
        loss_fn_inputs={"target_tokens": [17, 230, 9], "weights": [0.0, 1.0, 1.0]},
    )
    by_sdk = tc.forward([datum], "cross_entropy").result()  # protobuf, forward_only
    expected = by_sdk.loss_fn_outputs[0]["logprobs"].tolist()
    forward = {"forward_input": _json_body([GOOD])["forward_backward_input"], "model_id": tc.model_id, "seq_id": 2}
    scored = _result(serve, _post(serve, "/api/v1/forward", forward))
    assert _logprobs(scored) == [pytest.approx(expected, abs=1e-6)]
    assert scored.metrics["loss:sum"] == pytest.approx(by_sdk.metrics["loss:sum"], abs=1e-5)
    trained = _result(  # the run's next seq_id: the SDK's forward took 1 (a reused one is a 409)
        serve, _post(serve, "/api/v1/forward_backward", {**_json_body([GOOD]), "model_id": tc.model_id, "seq_id": 3})
    )
    assert _logprobs(trained) == [pytest.approx(expected, abs=1e-6)]  # the same weights: no step between
    bad = _json_body([GOOD, _inputs(weights={"data": [1.0, None, 1.0], "dtype": "float32"})])
    for path, body, needle in [
        ("/api/v1/forward_backward", {**bad, "model_id": tc.model_id}, "data[1].loss_fn_inputs.weights.data[1]"),
        (
            "/api/v1/forward_backward",
            {**_json_body([{**GOOD, "model_input": {"chunks": [{"tokens": [1, 49152]}]}}]), "model_id": tc.model_id},
            "data[0].model_input[1] must be a token id in 0..49151",
        ),
        ("/api/v1/forward_backward", {**_json_body([GOOD], "ppo"), "model_id": tc.model_id}, "advantages is missing"),
        ("/api/v1/forward", {**forward, "forward_input": None}, "forward_input must be an object"),
    ]:
        r = _post(serve, path, body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, r.text)
    service.close("success").result()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_oldest_sdk_trains_and_samples(serve: Serve) -> None:
    """tinker 0.22.0 (``make oldest-sdk-venv``): a LoRA run, forward_backward, optim_step,
    forward, save_weights_and_get_sampling_client, sample."""
    if not OLDEST_SDK_PYTHON.exists():
        pytest.skip("no .venv-tinker-0.22: `make oldest-sdk-venv` builds the oldest SDK's environment")
    env = {**os.environ, "TINKER_BASE_URL": serve.url, "TINKER_API_KEY": KEY, "TINKER_MODEL": TINY_RANDOM}
    env.pop("PYTHONPATH", None)
    script = ROOT / "tests" / "oldest_sdk" / "train_and_sample.py"
    proc = subprocess.run(
        [str(OLDEST_SDK_PYTHON), str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    out = proc.stdout
    assert proc.returncode == 0 and out.rstrip().endswith("OK"), out + proc.stderr[-4000:]
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["sdk"] == "0.22.0"
    losses = [float(x) for x in lines["losses"].split()]
    assert len(losses) == 3 and losses[2] < losses[0], losses  # three steps on the same batch: it learns
    assert lines["logprobs per datum"] == "[4, 3]"
    sampled = json.loads(lines["sampled"])
    assert len(sampled) == 2 and all(len(s) == 4 and all(0 <= t < 49152 for t in s) for s in sampled), sampled
