"""CurveZMQ keys, the allow-list of client keys, and the loopback rule for servers without Curve.

- ``generate_keypair(dir, name)`` writes ``name.key`` (public) and ``name.key_secret`` (0600), the
  ZPL certificate files of ``zmq.auth`` (``polytinker keys generate`` calls it).
- ``ServerCurve`` / ``ClientCurve``: the keys a server or client uses; keys are Z85 text (40 chars).
- A ZAP handler (one per ZeroMQ context, started with its first Curve server) admits a client
  only if its public key is on the allow-list of the server it connects to; each server has its
  own ZAP domain, so servers in one process can have different allow-lists.
- ``check_bind_address``: without Curve a server may bind loopback, ipc and inproc only.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from polytinker.errors import ConfigError

log = logging.getLogger("polytinker.transport.auth")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_LOOPBACK_HOSTS = frozenset({"localhost", "::1", "[::1]", "ip6-localhost"})


def _z85_key(key: bytes | str, what: str) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) != 40:
        raise ConfigError(f"{what} must be a 40-character Z85 Curve key (see `polytinker keys generate`)")
    try:
        zmq.utils.z85.decode(raw)
    except Exception as exc:
        raise ConfigError(f"{what} is not valid Z85: {exc}") from exc
    return raw


@dataclass(frozen=True)
class ServerCurve:
    """A server's Curve keypair and the public keys of the clients it admits."""

    public_key: bytes
    # The server's public key (Z85); clients need it to connect.
    secret_key: bytes
    # The server's secret key (Z85); never leaves the server.
    allowed_clients: frozenset[bytes]
    # Z85 public keys of the clients admitted; any other client's handshake is refused.

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "ServerCurve.public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "ServerCurve.secret_key"))
        keys = frozenset(_z85_key(k, "ServerCurve.allowed_clients entry") for k in self.allowed_clients)
        if not keys:
            raise ConfigError("ServerCurve.allowed_clients is empty: list the public keys of the clients to admit")
        object.__setattr__(self, "allowed_clients", keys)

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], clients: Iterable[str | os.PathLike[str]]) -> ServerCurve:
        """Keys from a ``.key_secret`` file and client ``.key`` files or directories of them."""
        public, secret = load_keypair(secret_file)
        if secret is None:
            raise ConfigError(f"{secret_file} holds no secret key: pass the .key_secret file")
        allowed: set[bytes] = set()
        for item in clients:
            path = Path(item)
            allowed |= load_public_keys(path) if path.is_dir() else {load_keypair(path)[0]}
        return cls(public, secret, frozenset(allowed))


@dataclass(frozen=True)
class ClientCurve:
    """A client's Curve keypair and the public key of the server it talks to."""

    public_key: bytes
    # The client's public key (Z85); must be on the server's allow-list.
    secret_key: bytes
    # The client's secret key (Z85).
    server_public_key: bytes
    # The server's public key (Z85); a server with another key is not talked to.

    def __post_init__(self) -> None:
        for name in ("public_key", "secret_key", "server_public_key"):
            object.__setattr__(self, name, _z85_key(getattr(self, name), f"ClientCurve.{name}"))

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], server_key_file: str | os.PathLike[str]) -> ClientCurve:
        public, secret = load_keypair(secret_file)
        if secret is None:
            raise ConfigError(f"{secret_file} holds no secret key: pass the .key_secret file")
        return cls(public, secret, load_keypair(server_key_file)[0])


def generate_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``name.key`` and ``name.key_secret`` into ``directory``; returns their paths.

    The files are ZPL certificates as ``zmq.auth`` and czmq write them. The secret file is created
    with mode 0600 (never world-readable, not even for a moment), and no file is overwritten."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = d / f"{name}.key", d / f"{name}.key_secret"
    for f in (public_file, secret_file):
        if f.exists():
            raise ConfigError(f"{f} exists; pick another --name or remove it (keys are never overwritten)")
    public, secret = zmq.curve_keypair()
    curve_public = f'curve\n    public-key = "{public.decode()}"\n'
    _write_new(public_file, f"#   ZeroMQ CURVE Public Certificate ({name})\n\nmetadata\n{curve_public}", 0o644)
    _write_new(
        secret_file,
        f"#   ZeroMQ CURVE **Secret** Certificate ({name}): keep it on this machine\n\n"
        f'metadata\n{curve_public}    secret-key = "{secret.decode()}"\n',
        0o600,
    )
    return public_file, secret_file


def _write_new(path: Path, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(f"{path} exists; pick another --name or remove it (keys are never overwritten)") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZPL certificate file."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except Exception as exc:
        raise ConfigError(f"cannot read a Curve certificate from {path}: {exc}") from exc
    return public, secret


def load_public_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``directory``."""
    files = sorted(Path(directory).glob("*.key"))
    if not files:
        raise ConfigError(f"no *.key files in {directory}")
    return frozenset(load_keypair(f)[0] for f in files)


def check_bind_address(address: str, curve: ServerCurve | None, insecure: bool) -> None:
    """Refuse to bind a non-loopback address without Curve unless ``insecure`` is set."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise ConfigError(f"address {address!r}: use tcp://host:port, ipc://path or inproc://name")
    if curve is not None or insecure or scheme != "tcp":
        return
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if host in _LOOPBACK_HOSTS or host.startswith("127."):
        return
    raise ConfigError(
        f"refusing to bind {address} without Curve: pass curve=ServerCurve(...) (keys from "
        "`polytinker keys generate`), bind 127.0.0.1, or pass insecure=True to expose it unauthenticated"
    )


class _ZapHandler:
    """ZAP (RFC 27) handler for one context: a thread with a REP socket on the ZAP endpoint. It
    lives as long as the context (``Context.term()`` ends it)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.domains: dict[str, frozenset[bytes]] = {}
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="polytinker-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._answer(self._sock.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(linger=0)

    def _answer(self, req: list[bytes]) -> None:
        ok = False
        if len(req) >= 6 and req[0] == b"1.0":
            domain, mechanism = req[2].decode(errors="replace"), req[5]
            allowed = self.domains.get(domain)
            if mechanism == b"CURVE" and len(req) >= 7 and allowed is not None:
                ok = zmq.utils.z85.encode(req[6]) in allowed
            if not ok:
                log.info("Curve: refused a client on %s (mechanism %s)", domain, mechanism.decode(errors="replace"))
        rid = req[1] if len(req) > 1 else b""
        status = [b"200", b"OK"] if ok else [b"400", b"not on the allow-list"]
        # The user id is the client's Z85 key: handlers read it with server.peer_user_id().
        user_id = zmq.utils.z85.encode(req[6]) if ok else b""
        self._sock.send_multipart([b"1.0", rid, *status, user_id, b""])


_zap_lock = threading.Lock()
# One handler per context, kept for the context's life: libzmq releases an inproc endpoint only
# when its reaper thread gets to the closed socket, so stopping and re-binding races.
_zap: dict[int, _ZapHandler] = {}
_domain_ids = itertools.count(1)


def zap_register(ctx: zmq.Context, allowed: frozenset[bytes]) -> str:
    """Start (or share) the context's ZAP handler and add a domain for this allow-list."""
    domain = f"polytinker-{os.getpid()}-{next(_domain_ids)}"
    with _zap_lock:
        handler = _zap.get(id(ctx))
        if handler is None:
            handler = _zap[id(ctx)] = _ZapHandler(ctx)
        handler.domains[domain] = allowed
    return domain


def zap_unregister(ctx: zmq.Context, domain: str) -> None:
    """Forget a domain: clients of a stopped server are refused from now on."""
    with _zap_lock:
        handler = _zap.get(id(ctx))
        if handler is not None:
            handler.domains.pop(domain, None)


__all__ = [
    "ClientCurve",
    "ServerCurve",
    "check_bind_address",
    "generate_keypair",
    "load_keypair",
    "load_public_keys",
]
