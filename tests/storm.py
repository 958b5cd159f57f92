"""A storm of hostile requests against any polytinker server, from a raw DEALER socket.

``storm(address, kinds)`` sends, for each kind, bodies nested ``DEPTHS`` deep (typed messages
inside typed messages, arrays in arrays, maps in maps, all mixed), bodies with tensors and arrays,
random bytes, and tells of the same; it reads the answers, checks every request got exactly one
well-formed ERROR (a REPLY where the bytes happened to be valid), and measures the server's RSS
growth after a warm-up round. Nothing here is a mock: a real socket, the real wire format.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import psutil
import zmq

from polytinker.transport import ClientCurve, encode
from polytinker.transport.codec import EXT_MESSAGE, EXT_TENSOR
from polytinker.transport.protocol import MsgType, pack_header, parse_header

DEPTHS = [10, 100, 1_000, 10_000, 100_000]


def _ext_header(n: int, code: int) -> bytes:
    if n < 1 << 8:
        return bytes([0xC7, n, code])
    if n < 1 << 16:
        return b"\xc8" + n.to_bytes(2, "big") + bytes([code])
    return b"\xc9" + n.to_bytes(4, "big") + bytes([code])


def _nested_messages(depth: int) -> bytes:
    """Typed messages (ext 3), each the one field of the next: built from the inside out without
    recursion; each level adds a few bytes (100,000 levels are about 2.5 MB)."""
    fixed = b"\x92" + msgpack.packb("fuzz.node") + b"\x81" + msgpack.packb("child")
    core = fixed + b"\xc0"  # the innermost message: a well-formed one of a name nobody registered
    parts, length = [core], len(core)
    for _ in range(depth - 1):
        piece = fixed + _ext_header(length, EXT_MESSAGE)
        parts.append(piece)
        length += len(piece)
    return _ext_header(length, EXT_MESSAGE) + b"".join(reversed(parts))


def nested_body(shape: str, depth: int) -> bytes:
    """A msgpack body ``depth`` levels deep: ``messages``, ``lists``, ``maps`` or ``mixed``."""
    if shape == "messages":
        return _nested_messages(depth)
    if shape == "lists":
        return b"\x91" * depth + b"\xc0"
    if shape == "maps":
        return b"\x81\xa1k" * depth + b"\xc0"
    # Lists and maps around typed messages around lists: the depth check must see through all.
    third = max(1, depth // 3)
    return b"\x91" * third + b"\x81\xa1k" * third + _nested_messages(max(1, depth - 2 * third))


def _tensor_body() -> list[bytes]:
    inner = msgpack.packb(["float32", [4], np.arange(4, dtype=np.float32).tobytes()])
    return [msgpack.packb({"t": msgpack.ExtType(EXT_TENSOR, inner)})]


def hostile_bodies(rng: random.Random, tensors: bool) -> list[list[bytes]]:
    bodies = [[nested_body(shape, d)] for shape in ("messages", "lists", "maps", "mixed") for d in DEPTHS]
    bodies += [[rng.randbytes(rng.randint(0, 300))] for _ in range(10)]
    if tensors:
        bodies += [_tensor_body(), [bytes(f) for f in encode({"a": np.zeros(1000, np.float32)})]]
    return bodies


@dataclass(frozen=True)
class StormReport:
    requests: int
    errors: int
    replies: int
    tells: int
    growth_bytes: int


def _connect(address: str, curve: ClientCurve | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret_key, curve.public_key
        sock.curve_serverkey = curve.server_public_key
    sock.connect(address)
    return sock


def _round(sock: zmq.Socket, kinds: list[str], bodies: list[list[bytes]], rid: int) -> tuple[int, int, int, int]:
    """Send every body to every kind as a request and as a tell; (requests, errors, replies, tells)."""
    owed: set[int] = set()
    tells = 0
    for kind in kinds:
        for frames in bodies:
            rid += 1
            sock.send_multipart([pack_header(MsgType.REQUEST, rid, kind), *frames])
            owed.add(rid)
            sock.send_multipart([pack_header(MsgType.TELL, 0, kind), *frames])
            tells += 1
    # A last request through the same queue: once it is answered, every tell before it has started.
    rid += 1
    sock.send_multipart([pack_header(MsgType.REQUEST, rid, kinds[0]), b"\xc1"])
    owed.add(rid)
    errors = replies = 0
    end = time.monotonic() + 120
    while owed and time.monotonic() < end:
        if not sock.poll(200):
            continue
        frames = sock.recv_multipart()
        mtype, got, _ = parse_header(frames[0])  # every answer is a well-formed envelope
        assert got in owed, f"an answer to request {got}, which was not owed (or answered twice)"
        owed.discard(got)
        if mtype == MsgType.ERROR:
            err = msgpack.unpackb(frames[1])
            assert isinstance(err["code"], str) and "Traceback" not in err.get("traceback", "")
            errors += 1
        else:
            replies += 1
    assert not owed, f"{len(owed)} requests never answered"
    return len(kinds) * len(bodies) + 1, errors, replies, tells


def storm(
    address: str, kinds: list[str], *, pid: int, tensors: bool = True, curve: ClientCurve | None = None
) -> StormReport:
    """Three rounds of hostile requests; the RSS growth from the end of the first to the end of the
    last. (A leak grows by the same amount each round; what remains is the allocator keeping the
    high-water mark of each handler thread's arena, which levels off.)"""
    rng = random.Random(1234)
    bodies = hostile_bodies(rng, tensors)
    server = psutil.Process(pid)
    sock = _connect(address, curve)
    try:
        _round(sock, kinds, bodies, 0)
        rss = server.memory_info().rss
        _round(sock, kinds, bodies, 10**6)
        requests, errors, replies, tells = _round(sock, kinds, bodies, 2 * 10**6)
        growth = server.memory_info().rss - rss
    finally:
        sock.close(linger=0)
    assert errors >= requests - 10 - 2 * len(kinds), (errors, replies, requests)  # random bytes may parse
    return StormReport(requests, errors, replies, tells, growth)


__all__ = ["DEPTHS", "StormReport", "hostile_bodies", "nested_body", "storm"]
