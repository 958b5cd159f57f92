"""How workers and their scheduler know each other: everything derives from the worker token.

The runtime's worker token (``RuntimeConfig.worker_token``: generated per runtime, handed to local
workers at spawn and to remote ones through ``polytinker serve``'s ``worker.token`` file) is the
one shared secret. Keyed hashes (HMAC-SHA256) of it with fixed labels give:

- the scheduler's Curve client keypair for talking to workers (``scheduler_client_keypair``);
- each worker's Curve server keypair (``worker_keypair``), unless the worker has real keys of its
  own (``polytinker worker --curve-secret``);
- the proof a ``Register`` carries (``register_proof``): it binds the worker id, role, address,
  incarnation, base model and the worker's Curve public key, so a process without the token cannot
  register a worker or swap in its own key, and the token itself never goes on the wire;
- the credential of the launcher's ``WorkersQuery`` and ``ActorsReport`` (``launcher_credential``).

Every worker serves with Curve and admits only the scheduler's client key (``worker_server_curve``),
so a process on the host without the token gets no answer from any worker socket.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
import zmq.utils.z85

from polytinker.transport import ServerCurve

_LABEL = "polytinker/worker-auth/v1/"


def _mac(token: str, label: str) -> bytes:
    return hmac.new(token.encode("utf-8"), (_LABEL + label).encode("utf-8"), hashlib.sha256).digest()


def derive_keypair(token: str, label: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 Curve keys that only a holder of ``token`` can compute."""
    secret = zmq.utils.z85.encode(_mac(token, label))  # any 32 bytes are a Curve25519 secret key
    return zmq.curve_public(secret), secret


def scheduler_client_keypair(token: str) -> tuple[bytes, bytes]:
    """The keys the scheduler's connections to its workers authenticate with."""
    return derive_keypair(token, "scheduler-client")


def worker_keypair(token: str, worker_id: str) -> tuple[bytes, bytes]:
    """The Curve server keys of ``worker_id`` when it has none of its own."""
    return derive_keypair(token, f"worker-server/{worker_id}")


def worker_server_curve(token: str, worker_id: str, keypair: tuple[bytes, bytes] | None = None) -> ServerCurve:
    """A worker's server Curve: its own ``keypair`` or the derived one; only the scheduler admitted."""
    public, secret = keypair if keypair is not None else worker_keypair(token, worker_id)
    return ServerCurve(public, secret, frozenset({scheduler_client_keypair(token)[0]}))


def register_proof(token: str, *fields: str | int | float) -> str:
    """The MAC of a ``Register``'s fields, in its order (``Register.signed_fields``)."""
    joined = "\n".join(map(str, fields))
    return hmac.new(_mac(token, "register"), joined.encode("utf-8"), hashlib.sha256).hexdigest()


def leave_proof(token: str, worker_id: str, incarnation: str) -> str:
    """The MAC of a ``Leave``: a key of its own, so no ``Register``'s proof reads as one."""
    joined = f"{worker_id}\n{incarnation}"
    return hmac.new(_mac(token, "leave"), joined.encode("utf-8"), hashlib.sha256).hexdigest()


def launcher_credential(token: str) -> str:
    """What the runtime that launched the workers shows the scheduler (list workers, report actors)."""
    return _mac(token, "launcher").hex()


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two credentials."""
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


__all__ = [
    "derive_keypair",
    "launcher_credential",
    "leave_proof",
    "register_proof",
    "same",
    "scheduler_client_keypair",
    "worker_keypair",
    "worker_server_curve",
]
