"""Blocking calls on their caller's thread (transport/_caller_sockets.py): each runs on a socket of
its own taken from the client's pool, and still learns at once from the client's I/O thread when
the server is gone, silent or refuses us. Servers that must die are real subprocesses; the
socket-counting tests talk to a plain ROUTER that speaks the documented wire protocol."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from polytinker.errors import PeerDeadError, RequestTimeout, TransportError
from polytinker.transport import RpcClient, RpcServer, TransportConfig, current_call
from polytinker.transport.codec import decode, encode
from polytinker.transport.protocol import PONG_HEADER, MsgType, pack_header, parse_header

FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=5, request_timeout_s=10.0)


class _EchoProcess:
    def __init__(self, address: str = "tcp://127.0.0.1:0") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polytinker.transport._echo", address], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), line
        self.address = line.split()[1]


@pytest.fixture
def echo() -> Iterator[_EchoProcess]:
    srv = _EchoProcess()
    try:
        yield srv
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.proc.kill()
        srv.proc.wait(10)


def _blocking_call_in_thread(c: RpcClient, kind: str, payload: object) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            c.call(kind, payload)
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, raised


def test_a_blocking_call_fails_at_once_when_its_server_is_killed(echo):
    # 300 x 0.2 s: silence alone would take a minute; the closed connection tells at once.
    cfg = dataclasses.replace(FAST, heartbeat_liveness=300, request_timeout_s=60.0)
    with RpcClient(echo.address, config=cfg) as c:
        assert c.call("echo", 1) == 1
        t, raised = _blocking_call_in_thread(c, "sleep", 30)
        time.sleep(0.3)
        t0 = time.monotonic()
        echo.proc.kill()
        t.join(10)
        assert not t.is_alive()
        assert raised and isinstance(raised[0], PeerDeadError), raised
        assert time.monotonic() - t0 < 5.0


def test_a_blocking_call_fails_when_its_server_falls_silent(echo):
    """A frozen server keeps its connections open: the heartbeats of the I/O thread tell."""
    with RpcClient(echo.address, config=dataclasses.replace(FAST, request_timeout_s=60.0)) as c:
        assert c.call("echo", 1) == 1
        t, raised = _blocking_call_in_thread(c, "sleep", 0.1)
        echo.proc.send_signal(signal.SIGSTOP)
        t.join(15)
        assert not t.is_alive()
        assert raised and isinstance(raised[0], PeerDeadError), raised
        assert "heartbeats" in str(raised[0])


def test_closing_the_client_ends_a_blocking_call(echo):
    c = RpcClient(echo.address, config=FAST)
    assert c.call("echo", 1) == 1
    t, raised = _blocking_call_in_thread(c, "sleep", 30)
    time.sleep(0.3)
    c.close()
    t.join(5)
    assert not t.is_alive()
    assert raised and isinstance(raised[0], TransportError), raised
    with pytest.raises(TransportError):
        c.call("echo", 2)


def test_a_timed_out_blocking_call_is_cancelled_on_the_server():
    seen = threading.Event()

    def patient(_: object) -> str:
        call = current_call()
        assert call is not None
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if call.cancelled:
                seen.set()
                return "stopped"
            time.sleep(0.01)
        return "ran out"

    handlers = {"patient": patient, "echo": lambda p: p}
    with RpcServer("tcp://127.0.0.1:0", handlers) as srv, RpcClient(srv.address, config=FAST) as c:
        with pytest.raises(RequestTimeout):
            c.call("patient", None, timeout_s=0.2)
        assert seen.wait(5.0), "the server never heard of the cancel"
        assert c.call("echo", "next") == "next"


class _PlainRouter:
    """A ROUTER that speaks the wire protocol by hand: answers pings at once and holds requests
    until ``answer`` is called, recording which connection (identity) each came on."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.requests: list[tuple[bytes, int, str, object]] = []
        self._todo: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                todo, self._todo = self._todo, []
            for fn in todo:
                fn()
            if not self.sock.poll(10):
                continue
            ident, header, *body = self.sock.recv_multipart()
            mtype, rid, kind = parse_header(header)
            if mtype == MsgType.PING:
                self.sock.send_multipart([ident, PONG_HEADER])
            elif mtype == MsgType.REQUEST:
                with self._lock:
                    self.requests.append((ident, rid, kind, decode(body)))

    def answer(self, ident: bytes, rid: int, kind: str, value: object) -> None:
        def send() -> None:
            self.sock.send_multipart([ident, pack_header(MsgType.REPLY, rid, kind), *encode(value)])

        with self._lock:
            self._todo.append(send)

    def wait_for(self, n: int, timeout_s: float = 10.0) -> list[tuple[bytes, int, str, object]]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if len(self.requests) >= n:
                    return list(self.requests)
            time.sleep(0.005)
        raise AssertionError(f"{len(self.requests)} of {n} requests arrived")

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture
def router() -> Iterator[_PlainRouter]:
    r = _PlainRouter()
    try:
        yield r
    finally:
        r.close()


def _answering(router: _PlainRouter, n: int) -> threading.Thread:
    """Answer the next ``n`` requests with their payloads, as they come."""

    def run() -> None:
        done = len(router.requests)
        for _ in range(n):
            ident, rid, kind, payload = router.wait_for(done + 1)[done]
            router.answer(ident, rid, kind, payload)
            done += 1

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_calls_from_short_lived_threads_share_one_socket(router):
    with RpcClient(router.address, config=FAST) as c:
        answering = _answering(router, 20)
        for i in range(20):  # one thread after another, as a pool that churns its threads
            t = threading.Thread(target=lambda i=i: c.call("echo", i))
            t.start()
            t.join(10)
        answering.join(10)
        assert [r[3] for r in router.requests] == list(range(20))
        assert len({r[0] for r in router.requests}) == 1  # one connection carried them all


def test_concurrent_calls_get_a_socket_each_and_idle_ones_are_bounded(router):
    with RpcClient(router.address, config=dataclasses.replace(FAST, idle_caller_sockets=2)) as c:
        results: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: results.update({i: c.call("echo", i)})) for i in range(6)]
        for t in threads:
            t.start()
        held = router.wait_for(6)  # all six are in flight at once, unanswered
        assert len({r[0] for r in held}) == 6
        for ident, rid, kind, payload in held:
            router.answer(ident, rid, kind, payload)
        for t in threads:
            t.join(10)
        assert results == {i: i for i in range(6)}

        answering = _answering(router, 6)
        for i in range(6):  # one at a time now: the two sockets kept idle, no new connection
            assert c.call("echo", 10 + i) == 10 + i
        answering.join(10)
        later = {r[0] for r in router.requests[6:]}
        assert len(later) == 1 and later <= {r[0] for r in held}


def test_a_late_answer_to_a_call_given_up_on_is_dropped(router):
    with RpcClient(router.address, config=FAST) as c:
        with pytest.raises(RequestTimeout):
            c.call("echo", "late", timeout_s=0.2)
        ident, rid, kind, payload = router.wait_for(1)[0]
        router.answer(ident, rid, kind, payload)  # it comes after the caller gave up
        answering = _answering(router, 1)
        assert c.call("echo", "fresh") == "fresh"  # on the same socket, past the late answer
        answering.join(10)
        assert router.requests[1][0] == ident
