"""Fuzz: 10,000 random and malformed multipart messages from a raw DEALER against a running server
(a real subprocess). It must stay up, answer every addressable one with an error, and keep its
memory bounded."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import msgpack
import psutil
import pytest
import zmq

from polytinker.transport import RpcClient, RpcServer, TransportConfig
from polytinker.transport._echo import HANDLERS
from polytinker.transport.codec import EXT_MESSAGE, EXT_NDARRAY, EXT_TENSOR
from polytinker.transport.protocol import PROTOCOL_VERSION, MsgType, pack_header, parse_header

N_MESSAGES = 10_000


def _garbage(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(rng.randint(0, n))


def _header(rng: random.Random, kind: str) -> bytes:
    return pack_header(MsgType.REQUEST, rng.randint(1, 2**64 - 1), kind)


def _bad_ext(rng: random.Random) -> bytes:
    code = rng.choice([EXT_NDARRAY, EXT_TENSOR, EXT_MESSAGE, 0, 42, 127])
    inner = rng.choice(
        [
            _garbage(rng, 40),
            msgpack.packb(["float32", [rng.randint(0, 10**6)], rng.randint(-2, 5)]),
            msgpack.packb(["float32", [3], _garbage(rng, 20)]),
            msgpack.packb([rng.choice(["object", "<U8", "", "int4"]), [1], b"\0" * 8]),
            msgpack.packb(["no.such.message", {"a": 1}]),
        ]
    )
    return msgpack.packb({"x": [msgpack.ExtType(code, inner)]})


def _case(rng: random.Random) -> tuple[list[bytes], bool | None]:
    """One hostile message and what the server owes it: True an error reply, None some reply (random
    bytes can happen to be a valid payload), False nothing (a tell)."""
    kind = rng.choice(["echo", "fail", "nbytes", "no-such-kind", "", "x" * 300])
    choice = rng.randrange(12)
    if choice == 0:
        return [_garbage(rng, 64) for _ in range(rng.randint(1, 4))], True  # random frames
    if choice == 1:
        return [], False  # an empty multipart cannot be sent; replaced below
    if choice == 2:
        return [msgpack.packb([PROTOCOL_VERSION + rng.randint(1, 9), 1, 1, "echo"]), b"\xc0"], True
    if choice == 3:
        return [msgpack.packb([PROTOCOL_VERSION, rng.randint(8, 300), 1, kind])], True  # unknown type
    if choice == 4:
        return [msgpack.packb([PROTOCOL_VERSION, 1, -1, kind]), b"\xc0"], True  # bad request id
    if choice == 5:
        return [_header(rng, kind)], True  # no body
    if choice == 6:
        return [_header(rng, kind), _garbage(rng, 200)], None  # body is noise
    if choice == 7:
        return [_header(rng, rng.choice(["echo", "nbytes"])), _bad_ext(rng), *[b"\0" * 12] * rng.randint(0, 3)], None
    if choice == 8:
        return [_header(rng, "echo"), msgpack.packb(1), *[b""] * 40], True  # too many frames
    if choice == 9:
        return [pack_header(MsgType.REPLY, 5, "echo"), b"\xc0"], True  # servers take no replies
    if choice == 10:
        tell_kind = rng.choice(["echo", "nbytes", "no-such-kind", ""])  # a failing tell is logged, not answered
        return [pack_header(MsgType.TELL, 0, tell_kind), _garbage(rng, 50)], False
    return [_header(rng, "no-such-kind"), msgpack.packb({"a": _garbage(rng, 30)})], True


def _serve(address: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "polytinker.transport._echo", address], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc


def _drain(sock: zmq.Socket, want: int, timeout_s: float) -> tuple[int, int]:
    """Read until ``want`` replies arrived; (error replies, other replies)."""
    errors = other = 0
    end = time.monotonic() + timeout_s
    while errors + other < want and time.monotonic() < end:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        mtype, _, _ = parse_header(frames[0])  # every answer is a well-formed envelope
        if mtype == MsgType.ERROR:
            assert isinstance(msgpack.unpackb(frames[1])["code"], str)
            errors += 1
        else:
            other += 1
    return errors, other


def test_fuzzed_server_stays_up_answers_errors_and_keeps_memory_bounded(tmp_path):
    proc = _serve(f"ipc://{tmp_path}/fuzz.sock")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        address = f"ipc://{tmp_path}/fuzz.sock"
        sock.connect(address)
        server = psutil.Process(proc.pid)
        rng = random.Random(1234)
        rss_after_warmup = 0
        sent = owed = must_fail = 0
        for batch in range(10):
            for _ in range(N_MESSAGES // 10):
                frames, answer = _case(rng)
                if not frames:
                    frames, answer = [b""], True
                sock.send_multipart(frames)
                sent += 1
                owed += answer is not False
                must_fail += answer is True
            errors, other = _drain(sock, owed, timeout_s=30)
            # A few random array headers happen to be valid and get echoed: still one answer each.
            assert errors + other == owed, f"batch {batch}: {errors} errors + {other} replies, {owed} owed"
            assert errors >= must_fail > 0.7 * owed
            owed = must_fail = 0
            if batch == 2:
                rss_after_warmup = server.memory_info().rss
        assert sent == N_MESSAGES
        growth = server.memory_info().rss - rss_after_warmup
        assert growth < 30 << 20, f"server RSS grew by {growth >> 20} MiB over {N_MESSAGES} hostile messages"
        assert proc.poll() is None, "the server died"
        with RpcClient(address) as c:
            assert c.call("echo", "still serving") == "still serving"
    finally:
        sock.close(linger=0)
        proc.kill()
        proc.wait()


def test_oversized_messages_are_refused_and_the_server_goes_on():
    cfg = TransportConfig(max_message_bytes=1 << 20, max_body_bytes=1 << 16)
    with RpcServer("tcp://127.0.0.1:0", HANDLERS, config=cfg) as srv:
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(srv.address)
        try:
            # A body over max_body_bytes but under ZMQ_MAXMSGSIZE: an addressable `too_large` error.
            raw.send_multipart([pack_header(MsgType.REQUEST, 9, "echo"), msgpack.packb(b"x" * 100_000)])
            assert raw.poll(5000)
            reply = raw.recv_multipart()
            assert parse_header(reply[0]) == (MsgType.ERROR, 9, "echo")
            assert msgpack.unpackb(reply[1])["code"] == "too_large"
            # A frame over ZMQ_MAXMSGSIZE: libzmq drops the connection; nothing to answer.
            raw.send_multipart([pack_header(MsgType.REQUEST, 10, "echo"), b"\0" * (2 << 20)])
            assert not raw.poll(500)
        finally:
            raw.close(linger=0)
        with RpcClient(srv.address, config=cfg) as c:
            assert c.call("echo", "fine") == "fine"
            with pytest.raises(Exception, match="too_large"):
                c.call("echo", b"x" * 100_000)
