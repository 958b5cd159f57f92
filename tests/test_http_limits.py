"""The gateway's per-tenant limits come from its config (``[http]``, HttpConfig): each lowered below
its default takes effect at a real gateway (uvicorn on a socket, the Tinker routes, raw HTTP
requests) in front of a real scheduler service with no workers, and bad values are refused when
the config is read. The defaults at work under the real SDK are tests/test_http_hostile.py's."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _http_raw import stalled

from polytinker.errors import ConfigError, OverloadedError
from polytinker.gateway._cli import gateway_config
from polytinker.gateway.app import Gateway
from polytinker.gateway.errors import HttpError
from polytinker.scheduler._cli import runtime_config
from polytinker.scheduler.service import RuntimeConfig, SchedulerService, TenantConfig
from polytinker.scheduler.service.http_config import HttpConfig

MODEL = "tiny-random"
KEYS = {name: f"tml-{name}-limits-key-0123456789" for name in ("alice", "bob", "carol")}
ALICE, BOB, CAROL = KEYS.values()


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler service of three tenants, no workers: what the gateway asks about keys and jobs."""
    cfg = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path_factory.mktemp("limits-scheduler")),
        tenants=tuple(TenantConfig(name, api_key=key) for name, key in KEYS.items()),
        worker_token="limits-worker-token-0123456789",
    )
    svc = SchedulerService(cfg, cfg.worker_token).start("tcp://127.0.0.1:0")
    assert svc.server is not None
    yield svc.server.address
    svc.stop()


@contextlib.contextmanager
def _gateway(scheduler: str, root: Path, **limits: Any) -> Iterator[Gateway]:
    config = HttpConfig(address="127.0.0.1:0", **limits)
    with Gateway(scheduler, root, config, base_models=(MODEL,)) as gw:
        yield gw


def _port(gw: Gateway) -> int:
    return int(gw.address.rsplit(":", 1)[1])


def _post(gw: Gateway, path: str, body: Any, key: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"X-API-Key": key, "Content-Type": "application/json"}
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=30)


def _until_429(gw: Gateway, path: str, body: Any, key: str) -> httpx.Response:
    """The 429 ``key`` gets once the requests stalled before reach the gateway (they race this one)."""
    deadline = time.monotonic() + 10
    while (r := _post(gw, path, body, key)).status_code != 429:
        assert time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.05)
    assert r.headers["retry-after"]
    return r


def _message(r: httpx.Response) -> str:
    return str(r.json()["error"]["message"])


# --- request bytes in flight -----------------------------------------------------------------------------
INFO = {"model_id": "nope"}  # a small body every key may send: 400 unknown model once admitted


def test_max_bodies_in_flight_per_tenant_holds_one_key_back(scheduler: str, tmp_path: Path) -> None:
    with (
        _gateway(scheduler, tmp_path, max_body_bytes=1000, max_bodies_in_flight_per_tenant=1) as gw,
        # One body of the largest size, hanging: all alice may have in flight (the default: two).
        stalled(_port(gw), "/api/v1/forward_backward", ALICE, 1, length=1000),
    ):
        refused = _until_429(gw, "/api/v1/get_info", INFO, ALICE)
        assert "this key has too many request bytes in flight (at most 1000)" in _message(refused)
        other = _post(gw, "/api/v1/get_info", INFO, BOB)
        assert other.status_code == 400 and "unknown model" in other.text  # bob's goes through


def test_max_bodies_in_flight_bounds_all_keys_together(scheduler: str, tmp_path: Path) -> None:
    with _gateway(scheduler, tmp_path, max_body_bytes=1000, max_bodies_in_flight=2) as gw:
        # Alice and bob each hang one largest body: within their own bounds (two each), all the
        # gateway takes (the default: four).
        with (
            stalled(_port(gw), "/api/v1/forward_backward", ALICE, 1, length=1000),
            stalled(_port(gw), "/api/v1/forward_backward", BOB, 1, length=1000),
        ):
            refused = _until_429(gw, "/api/v1/get_info", INFO, CAROL)
            assert "the gateway has too many request bytes in flight (at most 2000" in _message(refused)
        deadline = time.monotonic() + 15  # given back once the hanging requests are gone
        while (r := _post(gw, "/api/v1/get_info", INFO, CAROL)).status_code == 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.status_code == 400


# --- telemetry -------------------------------------------------------------------------------------------
BATCH = {"session_id": "s", "events": []}


def test_max_telemetry_bytes_refuses_a_larger_upload(scheduler: str, tmp_path: Path) -> None:
    with _gateway(scheduler, tmp_path, max_telemetry_bytes=100) as gw:
        assert _post(gw, "/api/v1/telemetry", b" " * 100, ALICE).status_code == 200
        refused = _post(gw, "/api/v1/telemetry", b" " * 101, ALICE)  # the default takes 1 MiB
        assert refused.status_code == 413 and "larger than 100 bytes" in _message(refused)


def test_max_telemetry_uploads_per_tenant_holds_one_key_back(scheduler: str, tmp_path: Path) -> None:
    with (
        _gateway(scheduler, tmp_path, max_telemetry_uploads_per_tenant=1) as gw,
        stalled(_port(gw), "/api/v1/telemetry", ALICE, 1, length=50),  # the default takes four
    ):
        refused = _until_429(gw, "/api/v1/telemetry", BATCH, ALICE)
        assert "too many telemetry uploads at once (at most 1 per key" in _message(refused)
        assert _post(gw, "/api/v1/telemetry", BATCH, BOB).status_code == 200


def test_max_telemetry_uploads_bounds_all_keys_together(scheduler: str, tmp_path: Path) -> None:
    with (
        _gateway(scheduler, tmp_path, max_telemetry_uploads=2) as gw,
        stalled(_port(gw), "/api/v1/telemetry", ALICE, 1, length=50),
        stalled(_port(gw), "/api/v1/telemetry", BOB, 1, length=50),  # the default takes 16
    ):
        refused = _until_429(gw, "/api/v1/telemetry", BATCH, CAROL)
        assert "2 over all keys" in _message(refused)


# --- signed download URLs --------------------------------------------------------------------------------
def _sign(gw: Gateway, owner: str, size: int) -> str:
    """A signed URL of ``owner``'s, of one file of ``size`` bytes, from the table the gateway serves
    (signing through the API needs a learner's export: tests/test_http_hostile.py does it)."""
    token, _ = gw.app.state.downloads.put(owner, {"adapter": b"x" * size})
    return f"{gw.url}/api/v1/downloads/{token}/adapter"


def _served(url: str) -> bool:
    status = httpx.get(url, timeout=30).status_code
    assert status in (200, 404)
    return status == 200


def test_max_download_urls_per_tenant_drops_the_tenants_own_oldest(scheduler: str, tmp_path: Path) -> None:
    with _gateway(scheduler, tmp_path, max_download_urls_per_tenant=1) as gw:
        bobs = _sign(gw, "bob", 10)
        first, second = _sign(gw, "alice", 10), _sign(gw, "alice", 10)  # the default keeps 16
        assert not _served(first) and _served(second) and _served(bobs)


def test_max_download_bytes_per_tenant_drops_the_oldest_and_refuses_more(scheduler: str, tmp_path: Path) -> None:
    with _gateway(scheduler, tmp_path, max_download_bytes_per_tenant=100) as gw:
        first, second = _sign(gw, "alice", 60), _sign(gw, "alice", 60)  # 120 bytes: the first goes
        assert not _served(first) and _served(second)
        with pytest.raises(HttpError) as too_big:  # the default takes 512 MiB a tenant
            _sign(gw, "alice", 101)
        assert too_big.value.status == 413 and "(100 bytes)" in str(too_big.value)


@pytest.mark.parametrize(("limit", "sizes"), [("max_download_urls", (10, 10)), ("max_download_bytes", (60, 50))])
def test_the_total_download_bounds_refuse_a_tenant_not_evict_another(
    scheduler: str, tmp_path: Path, limit: str, sizes: tuple[int, int]
) -> None:
    with _gateway(scheduler, tmp_path, **{limit: {"max_download_urls": 1, "max_download_bytes": 100}[limit]}) as gw:
        bobs = _sign(gw, "bob", sizes[0])
        with pytest.raises(OverloadedError, match="as many download URLs as it may") as refused:
            _sign(gw, "alice", sizes[1])  # fits the default's 1024 sets and 2 GiB
        assert ("1 sets of files" if limit == "max_download_urls" else "100 bytes over all") in str(refused.value)
        assert _served(bobs)


# --- seq_ids remembered per run ---------------------------------------------------------------------------
def _result(gw: Gateway, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        out = _post(gw, "/api/v1/retrieve_future", {"request_id": request_id}, ALICE).json()
        if out.get("type") != "try_again":
            return dict(out)
        assert time.monotonic() < deadline, out


def test_seq_ids_per_run_bounds_what_a_resend_is_matched_with(scheduler: str, tmp_path: Path) -> None:
    with _gateway(scheduler, tmp_path, seq_ids_per_run=1) as gw:
        session = _post(gw, "/api/v1/create_session", {}, ALICE).json()["session_id"]
        created = _post(gw, "/api/v1/create_model", {"session_id": session, "base_model": MODEL}, ALICE).json()
        model_id = _result(gw, created["request_id"])["model_id"]

        def step(seq_id: int) -> str:
            body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-4}}
            r = _post(gw, "/api/v1/optim_step", body, ALICE)
            assert r.status_code == 200, r.text
            return str(r.json()["request_id"])

        first = step(1)
        assert step(1) == first  # a resend: answered with the first call's request id
        step(2)  # one seq_id kept per run (the default keeps 1024): seq_id 1 is forgotten
        assert step(1) != first


# --- the config ------------------------------------------------------------------------------------------
LIMITS = (
    "max_bodies_in_flight_per_tenant",
    "max_bodies_in_flight",
    "max_telemetry_bytes",
    "max_telemetry_uploads_per_tenant",
    "max_telemetry_uploads",
    "max_download_urls_per_tenant",
    "max_download_bytes_per_tenant",
    "max_download_urls",
    "max_download_bytes",
    "seq_ids_per_run",
)


@pytest.mark.parametrize("field", LIMITS)
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_limit_must_be_a_whole_number_above_zero(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"[http] {field} must be a whole number > 0, got {value!r}")):
        HttpConfig(**{field: value})


def test_the_defaults_are_the_limits_the_gateway_had() -> None:
    c = HttpConfig()
    assert (c.max_bodies_in_flight_per_tenant, c.max_bodies_in_flight) == (2, 4)
    assert (c.max_telemetry_bytes, c.max_telemetry_uploads_per_tenant, c.max_telemetry_uploads) == (1 << 20, 4, 16)
    assert (c.max_download_urls_per_tenant, c.max_download_bytes_per_tenant) == (16, 512 << 20)
    assert (c.max_download_urls, c.max_download_bytes, c.seq_ids_per_run) == (1024, 2 << 30, 1024)


def test_the_http_table_is_read_and_checked_from_toml(tmp_path: Path) -> None:
    toml = tmp_path / "runtime.toml"
    toml.write_text('model = "tiny-random"\n[http]\nmax_telemetry_uploads = 3\nseq_ids_per_run = 8\n')
    assert RuntimeConfig.from_toml(toml).http.max_telemetry_uploads == 3
    assert HttpConfig.from_toml(toml).seq_ids_per_run == 8  # the table alone, for polytinker gateway
    toml.write_text('[http]\nmax_bodies_in_flight = "four"\n')
    with pytest.raises(ConfigError, match=r"http\.max_bodies_in_flight: expected int"):
        HttpConfig.from_toml(toml)
    toml.write_text("[http]\nmax_download_urls = 0\n")
    with pytest.raises(ConfigError, match=r"\[http\] max_download_urls must be a whole number > 0"):
        RuntimeConfig.from_toml(toml)
    toml.write_text("[http]\nmax_downloads = 3\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        HttpConfig.from_toml(toml)


def test_serve_and_gateway_take_the_table_with_the_flags_over_it(tmp_path: Path) -> None:
    from polytinker.cli import build_parser

    toml = tmp_path / "runtime.toml"
    toml.write_text('model = "tiny-random"\n[http]\naddress = "127.0.0.1:9000"\nmax_telemetry_bytes = 512\n')
    parser = build_parser()
    served = runtime_config(parser.parse_args(["serve", "--config", str(toml), "--http", "127.0.0.1:9001"]))
    assert (served.http.address, served.http.max_telemetry_bytes) == ("127.0.0.1:9001", 512)
    args = ["gateway", "--scheduler", "tcp://127.0.0.1:7000", "--model", MODEL, "--config", str(toml)]
    alone = gateway_config(parser.parse_args([*args, "--http", "127.0.0.1:9002"]))
    assert (alone.address, alone.tokenizer_id, alone.max_telemetry_bytes) == ("127.0.0.1:9002", "", 512)
    flags = gateway_config(parser.parse_args([*args, "--http", "127.0.0.1:9002", "--tokenizer-id", "org/tok"]))
    assert (flags.tokenizer_id, flags.max_telemetry_bytes) == ("org/tok", 512)


def test_serve_and_gateway_take_a_session_timeout_flag_over_the_table(tmp_path: Path) -> None:
    from polytinker.cli import build_parser

    toml = tmp_path / "runtime.toml"
    toml.write_text('model = "tiny-random"\n[http]\naddress = "127.0.0.1:9000"\nsession_timeout_s = 60\n')
    parser = build_parser()
    args = ["gateway", "--scheduler", "tcp://127.0.0.1:7000", "--model", MODEL, "--http", "127.0.0.1:9002"]
    assert gateway_config(parser.parse_args(args)).session_timeout_s == 180.0  # the default
    assert gateway_config(parser.parse_args([*args, "--config", str(toml)])).session_timeout_s == 60.0
    flagged = gateway_config(parser.parse_args([*args, "--config", str(toml), "--session-timeout-s", "15"]))
    assert (flagged.session_timeout_s, flagged.address) == (15.0, "127.0.0.1:9002")
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="session_timeout_s must be > 0"):
            gateway_config(parser.parse_args([*args, "--session-timeout-s", bad]))
    served = runtime_config(parser.parse_args(["serve", "--config", str(toml), "--session-timeout-s", "30"]))
    assert (served.http.session_timeout_s, served.http.address) == (30.0, "127.0.0.1:9000")
    assert runtime_config(parser.parse_args(["serve", "--config", str(toml)])).http.session_timeout_s == 60.0
