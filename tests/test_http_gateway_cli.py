"""`polytinker gateway`: the HTTP front door alone, in front of a scheduler that runs elsewhere
(here the shared tiny-random runtime, whose tenant keys are not the tml- keys the tinker SDK
wants, so the requests are raw HTTP), with the ``[http]`` table of a runtime config; SIGTERM ends it
cleanly."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fixtures.client import KEY_ALICE, MODEL, shared_runtime


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_gateway_serves_a_remote_scheduler(tmp_path: Path) -> None:
    port = _port()
    (tmp_path / "runtime.toml").write_text("[http]\nmax_telemetry_bytes = 100\n")  # the default: 1 MiB
    cmd = [
        sys.executable,
        "-m",
        "polytinker.cli",
        "gateway",
        "--scheduler",
        shared_runtime().address,
        "--http",
        f"127.0.0.1:{port}",
        "--model",
        MODEL,
        "--state-dir",
        str(tmp_path / "gw"),
        "--config",
        str(tmp_path / "runtime.toml"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        headers = {"X-API-Key": KEY_ALICE}
        caps = httpx.get(f"{url}/api/v1/get_server_capabilities", headers=headers, timeout=10).json()
        assert [m["model_name"] for m in caps["supported_models"]] == [MODEL]
        session = httpx.post(f"{url}/api/v1/create_session", headers=headers, json={}, timeout=10).json()
        assert session["session_id"]
        telemetry = f"{url}/api/v1/telemetry"
        assert httpx.post(telemetry, headers=headers, content=b" " * 100, timeout=10).status_code == 200
        too_big = httpx.post(telemetry, headers=headers, content=b" " * 101, timeout=10)
        assert too_big.status_code == 413 and "larger than 100 bytes" in too_big.text
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        assert (tmp_path / "gw" / "gateway.sqlite").stat().st_mode & 0o077 == 0  # private to its user
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"HTTP at http://127.0.0.1:{port}" in out
