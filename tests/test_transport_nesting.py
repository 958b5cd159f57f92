"""Hostile nesting: bodies whose typed messages, arrays or maps nest 10 to 100,000 deep, tensors
sent to servers that take none, errors that cannot be printed. Against real servers (the echo
server and an env server in their own processes): each stays up, answers every request it owes,
serves a well-formed request afterwards, keeps its memory bounded, and a torch-free server never
imports torch. The storm itself is in tests/storm.py, shared with the
runtime's servers."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import uuid

import msgpack
import numpy as np
import psutil
import pytest
from storm import DEPTHS, nested_body, storm

from polytinker.errors import ProtocolError, RemoteError
from polytinker.transport import RpcClient, RpcServer, TransportConfig, decode, encode, message
from polytinker.transport.codec import check_depth


def _spawn(args: list[str], *, banner_on_stderr: bool = False) -> tuple[subprocess.Popen[str], str]:
    """A server process and the address its first line names (``READY <address>``, or the env
    server's ``serving ... on <address> (Ctrl-C stops)`` on stderr)."""
    pipe = {"stderr" if banner_on_stderr else "stdout": subprocess.PIPE}
    proc = subprocess.Popen([sys.executable, *args], text=True, **pipe)  # type: ignore[call-overload]
    stream = proc.stderr if banner_on_stderr else proc.stdout
    line = stream.readline()
    words = [w for w in line.split() if "://" in w]
    assert words, f"the server did not start: {line!r}"
    return proc, words[-1]


@pytest.mark.parametrize("shape", ["messages", "lists", "maps", "mixed"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_codec_refuses_deep_bodies_before_going_deeper(shape, depth):
    body = nested_body(shape, depth)
    if depth > TransportConfig().max_depth:
        with pytest.raises(ProtocolError, match=r"max_depth|StackError|levels deep"):
            decode([body])
    elif shape in ("messages", "mixed"):  # shallow enough: decoded down to the unknown innermost name
        with pytest.raises(ProtocolError, match=r"unknown message type 'fuzz\.node'"):
            decode([body])
    else:
        decode([body])


def test_depth_is_counted_across_messages_and_containers_and_is_configurable():
    @message(f"test.node.{uuid.uuid4().hex}")
    @dataclasses.dataclass(frozen=True)
    class Node:
        child: object = None

    value: object = None
    for i in range(40):
        value = Node(value) if i % 2 else [value]
    with pytest.raises(ProtocolError, match="max_depth"):
        decode(encode(value, config=TransportConfig(max_depth=64)))
    assert decode(encode(value, config=TransportConfig(max_depth=64)), config=TransportConfig(max_depth=64)) == value
    with pytest.raises(ProtocolError, match="max_depth"):
        encode(value, config=TransportConfig(max_depth=8))  # the encoder keeps the same bound
    check_depth(list(range(100_000)), 2)  # wide and flat is fine
    check_depth([[i, i] for i in range(10_000)], 2)  # a list of flat lists: one level at C speed
    for too_deep in ([[1], [[2]]], [(1,), [{"a": 1}]], [[[1]]]):
        with pytest.raises(ProtocolError, match="max_depth"):
            check_depth(too_deep, 2)


def test_plain_bodies_are_held_to_the_same_depth_as_any_other():
    """Bodies of maps, lists and scalars alone decode on a faster path with its own depth check
    (none at all when the body has no more bytes that could open a map or array than max_depth):
    it refuses exactly what check_depth refuses, for shapes from flat to just past the limit."""
    rng = random.Random(0)

    def build(depth: int) -> object:
        if depth == 1:
            return rng.choice([[1, "a"], {"k": 2.0}, [[], {}], [[0, 1]] * 3])
        inner = [build(depth - 1) for _ in range(rng.randint(1, 3))]
        filler = rng.choice([[], [7, "x"], [[1, 2]], [{}]])
        if rng.random() < 0.5:
            return [*filler, *inner] if rng.random() < 0.5 else [*inner, *filler]
        return {f"k{i}": v for i, v in enumerate([*filler, *inner])}

    limit = 6
    cfg = TransportConfig(max_depth=limit)
    for depth in [1, 2, 4, 5, 6, 7, 8, 12] * 8:
        value = build(depth)
        body = msgpack.packb(value)  # a peer's body: the encoder would refuse the deep ones itself
        try:
            check_depth(value, limit)
        except ProtocolError:
            with pytest.raises(ProtocolError, match="max_depth"):
                decode([body], config=cfg)
        else:
            assert decode([body], config=cfg) == value
    # Containers of 16 or more have other first bytes (array 16, map 16): deep ones are refused too.
    for wide in (lambda v: [v, *range(20)], lambda v: {"v": v, **{f"k{i}": i for i in range(20)}}):
        value = 0
        for _ in range(limit + 1):
            value = wide(value)
        with pytest.raises(ProtocolError, match="max_depth"):
            decode([msgpack.packb(value)], config=cfg)


def test_arrays_are_refused_where_a_kind_takes_none():
    array = np.arange(4, dtype=np.float32)
    with pytest.raises(ProtocolError, match="arrays or tensors"):
        decode(encode({"x": array}), arrays=False)
    assert decode(encode({"x": array}))["x"].tolist() == [0, 1, 2, 3]


def test_a_tensor_header_whose_strides_would_overflow_is_refused():
    inner = msgpack.packb(["float32", [0, 2**61, 2**61], b""])
    with pytest.raises(ProtocolError, match="spans"):
        decode([msgpack.packb(msgpack.ExtType(2, inner))])


def test_an_error_that_cannot_be_printed_is_still_answered():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RecursionError("maximum recursion depth exceeded")

    def fail(_: object) -> None:
        raise Unprintable()

    handlers = {"fail": fail, "echo": lambda x: x}
    cfg = TransportConfig(handler_threads=1)  # one thread: it must survive every failure
    with (
        RpcServer(f"inproc://unprintable-{uuid.uuid4().hex}", handlers, config=cfg) as srv,
        RpcClient(srv.address) as client,
    ):
        for _ in range(20):
            with pytest.raises(RemoteError, match="cannot be printed") as info:
                client.call("fail", None, timeout_s=5)
            assert info.value.remote_type == "Unprintable" and info.value.error_id
        assert client.call("echo", "still serving", timeout_s=5) == "still serving"


def test_the_echo_server_survives_the_storm(tmp_path):
    proc, address = _spawn(["-m", "polytinker.transport._echo", f"ipc://{tmp_path}/echo.sock"])
    try:
        report = storm(address, kinds=["echo", "nbytes", "fail"], pid=proc.pid)
        assert proc.poll() is None, "the echo server died"
        assert report.growth_bytes < 96 << 20, report
        with RpcClient(address) as c:
            assert c.call("echo", "after the storm", timeout_s=10) == "after the storm"
    finally:
        proc.kill()
        proc.wait()


def test_an_env_server_survives_the_storm_and_never_imports_torch():
    args = ["-m", "polytinker.cli", "env", "serve", "guess_number-v0", "--bind", "tcp://127.0.0.1:0"]
    proc, address = _spawn(args, banner_on_stderr=True)
    try:
        report = storm(address, kinds=["env.open", "env.step", "env.info"], pid=proc.pid, tensors=True)
        assert proc.poll() is None, "the env server died"
        assert report.growth_bytes < 96 << 20, report
        # `import torch` maps libtorch*.so (a shared library preloaded from torch's folder, as vLLM's
        # CPU build puts into LD_PRELOAD for its children, is not an import of torch).
        maps = [m.path for m in psutil.Process(proc.pid).memory_maps()]
        torch_libs = [p for p in maps if "/torch/" in p and os.path.basename(p).startswith("libtorch")]
        assert not torch_libs, f"torch was imported: {torch_libs[:3]}"
    finally:
        proc.kill()
        proc.wait()
