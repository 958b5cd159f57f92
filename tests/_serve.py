"""``polytinker serve --http`` as a child process on the default model (or another preset), with two
tenants whose keys start with ``tml-`` (as the tinker SDK wants): shared by the tests that drive it
over HTTP."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
KEY = "tml-alice-test-key-0123456789"
KEY_BOB = "tml-bob-test-key-0123456789ab"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``polytinker serve --http`` as a child process (restartable on the same state directory)."""

    def __init__(self, root: Path, model: str = MODEL) -> None:
        self.root = root
        self.model = model
        self.proc: subprocess.Popen[bytes] | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.root / "runtime.toml").write_text(
            f'model = "{self.model}"\naddress = "tcp://127.0.0.1:{_free_port()}"\n'
            f'[[tenants]]\nname = "alice"\napi_key = "{KEY}"\n[[tenants]]\nname = "bob"\napi_key = "{KEY_BOB}"\n'
            # A test module's runs stay live (Tinker code never ends them): room for all of them.
            "[[engines]]\nadapter_slots = 16\n"
        )

    def start(self) -> None:
        """Start serve; a port picked free that something else took before serve bound it (the
        runtime's own sockets bind ephemeral ports too) is picked again, up to three times."""
        for _ in range(3):
            start = (self.root / "serve.log").stat().st_size if (self.root / "serve.log").exists() else 0
            if self._start_once():
                return
            if "Address already in use" not in (self.root / "serve.log").read_text()[start:]:
                break
            self._pick_ports()
        raise AssertionError("serve exited: " + (self.root / "serve.log").read_text()[-3000:])

    def _start_once(self) -> bool:
        """True once serve answers; False when it exited first."""
        log = open(self.root / "serve.log", "ab")  # noqa: SIM115 (the child writes to it)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polytinker.cli",
                "serve",
                "--config",
                str(self.root / "runtime.toml"),
                "--state-dir",
                str(self.root / "state"),
                "--http",
                f"127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("serve did not come up: " + (self.root / "serve.log").read_text()[-3000:])

    def __enter__(self) -> Serve:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


__all__ = ["KEY", "KEY_BOB", "MODEL", "Serve"]
