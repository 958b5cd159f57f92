"""``HttpConfig``: the ``[http]`` table of a runtime config, the HTTP gateway's one config.

Read from ``runtime.toml`` by ``polytinker serve`` (with the rest of ``RuntimeConfig``) and by
``polytinker gateway --config`` (this table alone, ``HttpConfig.from_toml``). Besides where to
serve and how long to keep results, it holds what one tenant may hold of the gateway at a time
(bodies in flight, telemetry uploads, signed download URLs, remembered seq_ids), each also
bounded over all tenants, so no tenant's requests take the gateway from the others
(docs/tinker.md, "What the gateway checks at the door").
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from typing import Any

from polytinker.errors import ConfigError
from polytinker.tables import from_table


@dataclass(frozen=True)
class HttpConfig:
    """``[http]`` of a runtime config: the HTTP front door (Tinker API, OpenAI-compatible; docs/tinker.md)."""

    address: str = ""
    # ``HOST:PORT`` to serve on; "" serves no HTTP. Off loopback, put TLS in front (a reverse proxy).
    max_body_bytes: int = 256 << 20
    # Largest request body accepted (a forward_backward carries its whole batch).
    long_poll_s: float = 20.0
    # How long one retrieve_future waits for its call before answering try_again.
    future_ttl_s: float = 3600.0
    # How long a finished call's result waits to be retrieved.
    max_futures_per_tenant: int = 10_000
    # Unretrieved calls one tenant may have; past it, calls answer 429.
    default_max_tokens: int = 256
    # max_tokens of a sample that names none (Tinker's SamplingParams default is None).
    tokenizer_id: str = ""
    # What get_info answers as the tokenizer to load (a hub id, or a directory clients can read); "":
    # the model's hub id, its tokenizer placed in this machine's Hugging Face cache (hub_tokenizer.py),
    # or for a model without one (tiny-random, a directory) its directory here.
    session_timeout_s: float = 180.0
    # A Tinker session whose client sent no heartbeat for this long ends as its close would: its
    # runs' jobs finish (their adapter slots go to other runs; saved weights stay) and its samplers'
    # versions may be pruned again. The SDK heartbeats every 10 s and warns after 120 s without one.
    # A restarted gateway gives every open session this long again.
    max_bodies_in_flight_per_tenant: int = 2
    # Request bytes one API key may have in flight (arriving or being handled), in bodies of
    # max_body_bytes: past it that key's requests answer 429 (Retry-After) until some finish,
    # while other keys' go on. A body that declares its length is charged before it is read.
    max_bodies_in_flight: int = 4
    # The same over all keys together (an unknown key's requests count here only): what request
    # bodies may take of the gateway's memory at once.
    max_telemetry_bytes: int = 1 << 20
    # Largest telemetry upload (the SDK's; accepted and dropped); 413 past it.
    max_telemetry_uploads_per_tenant: int = 4
    # Telemetry uploads of one key in progress at once; 429 past it.
    max_telemetry_uploads: int = 16
    # Telemetry uploads of all keys in progress at once; 429 past it.
    max_download_urls_per_tenant: int = 16
    # Sets of signed download URLs (get_external_weights_urls) one tenant holds; a new set drops
    # the tenant's own oldest, never another tenant's.
    max_download_bytes_per_tenant: int = 512 << 20
    # Bytes of the files behind those URLs one tenant holds (in this process's memory); a set
    # larger than this is a 413 (polytinker checkpoints export writes it to a directory instead).
    max_download_urls: int = 1024
    # Sets of download URLs over all tenants; a tenant whose set does not fit beside the others'
    # is answered 429 until some expire.
    max_download_bytes: int = 2 << 30
    # Bytes behind download URLs over all tenants, likewise.
    seq_ids_per_run: int = 1024
    # The last seq_ids of each training run kept with their answers, so a call the SDK resends is
    # answered once; well past the calls an SDK has in flight at once (it sends them in turn).

    def __post_init__(self) -> None:
        if self.address:
            host_port(self.address)
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"[http] {name} must be a whole number > 0, got {value!r}")
        if not self.long_poll_s > 0 or not self.future_ttl_s > 0:
            raise ConfigError("[http] long_poll_s and future_ttl_s must be > 0")
        if not self.session_timeout_s > 0:
            raise ConfigError(f"[http] session_timeout_s must be > 0, got {self.session_timeout_s}")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> HttpConfig:
        """The ``[http]`` table of a runtime config file (defaults where it has none); the rest of
        the file is not read: a gateway in front of a scheduler elsewhere needs only this table."""
        return from_table(cls, read_toml(path).get("http", {}), "http")


# The bounds that are counts or byte sizes: whole numbers > 0.
_POSITIVE_INTS = (
    "max_body_bytes",
    "max_futures_per_tenant",
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


def host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.removeprefix("http://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"an HTTP address is HOST:PORT (e.g. 127.0.0.1:8000), got {address!r}")
    return host, int(port)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A runtime config file's tables; ConfigError naming the file when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read runtime config {path}: {exc}") from exc


__all__ = ["HttpConfig", "host_port", "read_toml"]
