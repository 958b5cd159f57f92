"""RPC over inproc, ipc and tcp: replies, errors, timeouts, cancellation, concurrency, dead peers,
reconnects. Servers that must die run as real subprocesses and are killed with SIGKILL."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from polytinker.errors import PeerDeadError, ProtocolError, RemoteError, RequestTimeout, TransportError
from polytinker.transport import RpcClient, RpcServer, TransportConfig, message
from polytinker.transport._echo import HANDLERS

# Dead after 1 s of silence: quick, yet tolerant of a loaded two-core CI machine.
FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=5, request_timeout_s=10.0)
# The fixtures' server and client carry bursts of a thousand calls from several threads and never
# test a death: they allow 10 s of silence, since on a loaded machine the client's I/O thread can
# starve past 1 s and count a live server dead.
PATIENT = dataclasses.replace(FAST, heartbeat_liveness=50)
TRANSPORTS = ["inproc", "ipc", "tcp"]


def _address(transport: str, tmp_path) -> str:
    if transport == "inproc":
        return f"inproc://test-{uuid.uuid4().hex}"
    if transport == "ipc":
        return f"ipc://{tmp_path}/rpc.sock"
    return "tcp://127.0.0.1:0"


@pytest.fixture(params=TRANSPORTS)
def server(request, tmp_path) -> Iterator[RpcServer]:
    with RpcServer(_address(request.param, tmp_path), HANDLERS, config=PATIENT) as srv:
        yield srv


@pytest.fixture
def client(server) -> Iterator[RpcClient]:
    with RpcClient(server.address, config=PATIENT) as c:
        yield c


class _ServerProcess:
    """The reference echo server in a child process (so it can be SIGKILLed)."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polytinker.transport._echo", address],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"echo server did not start: {line!r}"
        self.address = line.split()[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def test_replies_carry_every_payload_type(client):
    payload = {"ids": list(range(10)), "x": np.arange(5000, dtype=np.float32), "t": torch.ones(3, 1000).bfloat16()}
    out = client.call("echo", payload)
    assert out["ids"] == payload["ids"]
    assert np.array_equal(out["x"], payload["x"]) and torch.equal(out["t"], payload["t"])
    assert client.call("echo") is None


def test_handler_errors_come_back_named_with_an_id_and_no_traceback(client, caplog):
    with caplog.at_level("WARNING", logger="polytinker.transport.server"), pytest.raises(RemoteError) as info:
        client.call("fail", "bad input")
    err = info.value
    assert err.remote_type == "ValueError" and err.code == "handler"
    assert "bad input" in str(err) and len(err.error_id) == 12 and err.error_id in str(err)
    assert err.remote_traceback == ""  # the caller never sees the server's code or paths...
    logged = [r for r in caplog.records if err.error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # ...the server's log has it, under the same id
    with pytest.raises(ProtocolError, match="unknown_kind"):
        client.call("no-such-kind", 1)
    assert client.call("echo", 7) == 7  # the server goes on


def test_errors_callers_act_on_travel_as_codes():
    from polytinker.errors import AuthError, ConfigError, error_class

    def refuse(_: object) -> None:
        raise AuthError("not yours")

    def misconfigured(_: object) -> None:
        raise ConfigError("rank must be > 0")

    handlers = {"refuse": refuse, "config": misconfigured}
    with RpcServer(f"inproc://codes-{uuid.uuid4().hex}", handlers, config=FAST) as srv, RpcClient(srv.address) as c:
        for kind, cls in (("refuse", AuthError), ("config", ConfigError)):
            with pytest.raises(RemoteError) as info:
                c.call(kind)
            assert info.value.code == cls.code and error_class(info.value.code) is cls


def test_an_error_relayed_from_a_server_behind_keeps_its_code():
    """A scheduler passes a worker's error on as the RemoteError it got: its caller still reads the
    worker's code (a learner's ConfigError is a ConfigError to the client, not a server crash)."""
    from polytinker.errors import ConfigError

    def misconfigured(_: object) -> None:
        raise ConfigError("the checkpoint's shape differs")

    with (
        RpcServer(f"inproc://worker-{uuid.uuid4().hex}", {"load": misconfigured}, config=FAST) as worker,
        RpcClient(worker.address) as to_worker,
    ):

        def relay(_: object) -> None:
            to_worker.call("load")

        with (
            RpcServer(f"inproc://relay-{uuid.uuid4().hex}", {"load": relay}, config=FAST) as front,
            RpcClient(front.address) as c,
            pytest.raises(RemoteError) as info,
        ):
            c.call("load")
    assert info.value.code == ConfigError.code and "shape differs" in str(info.value)


def test_a_server_for_trusted_clients_may_expose_tracebacks():
    cfg = dataclasses.replace(FAST, expose_tracebacks=True)
    with RpcServer(f"inproc://tb-{uuid.uuid4().hex}", HANDLERS, config=cfg) as srv, RpcClient(srv.address) as c:
        with pytest.raises(RemoteError) as info:
            c.call("fail", "bad input")
        assert "ValueError: bad input" in info.value.remote_traceback


def test_timeout_then_the_client_still_works(client):
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        client.call("sleep", 2.0, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert client.call("echo", "after") == "after"


def test_a_slow_handler_does_not_block_the_socket(client):
    slow = client.call_async("sleep", 0.8)
    t0 = time.monotonic()
    assert client.call("echo", 1) == 1
    assert time.monotonic() - t0 < 0.6
    assert slow.result() == 0.8


def test_cancel_abandons_a_call(client):
    fut = client.call_async("sleep", 0.5)
    assert fut.cancel()
    assert fut.cancelled()
    assert client.call("echo", "next") == "next"


def test_thousand_concurrent_requests(client):
    def burst(offset: int) -> list[int]:
        futs = [client.call_async("echo", offset + i) for i in range(250)]
        return [f.result(timeout=30) for f in futs]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(burst, range(0, 1000, 250)))
    assert [x for r in results for x in r] == list(range(1000))


def test_blocking_calls_from_many_threads_mixed_with_async_ones(client):
    """Blocking calls take turns driving the socket; async replies arrive whoever drives it."""
    slow = [client.call_async("sleep", 0.3) for _ in range(3)]

    def worker(k: int) -> list[int]:
        return [client.call("echo", k * 1000 + i) for i in range(100)]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(worker, range(8)))
    assert results == [[k * 1000 + i for i in range(100)] for k in range(8)]
    assert [f.result(timeout=10) for f in slow] == [0.3] * 3
    late = client.call_async("echo", "late")  # the I/O thread, not a leader, answers this one
    assert late.result(timeout=10) == "late"


def test_blocking_call_inside_a_future_callback_fails_loudly(client):
    seen: list[BaseException] = []
    done = threading.Event()

    def callback(_f: object) -> None:
        try:
            client.call("echo", 1)
        except TransportError as exc:
            seen.append(exc)
        done.set()

    client.call_async("sleep", 0.2).add_done_callback(callback)  # answered later, on the I/O thread
    assert done.wait(10)
    assert seen and "call_async" in str(seen[0])


def test_client_futures_awaited_from_asyncio(server):
    with RpcClient(server.address, config=FAST) as c:

        def call(kind: str, payload: object) -> asyncio.Future[object]:
            return asyncio.wrap_future(c.call_async(kind, payload))

        async def main() -> None:
            assert await asyncio.gather(*(call("echo", i) for i in range(200))) == list(range(200))
            with pytest.raises(RemoteError):
                await call("fail", "x")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call("sleep", 1.0), 0.1)  # cancels the call
            assert await call("echo", "ok") == "ok"

        asyncio.run(main())


def test_tells_run_without_a_reply(tmp_path):
    seen: list[int] = []
    done = threading.Event()

    def record(x: int) -> None:
        seen.append(x)
        if len(seen) == 50:
            done.set()

    with RpcServer("inproc://test-tell", {"record": record}) as srv, RpcClient(srv.address, config=FAST) as c:
        for i in range(50):
            c.send_oneway("record", i)
        assert done.wait(10)
        c.send_oneway("no-such-kind", 1)  # an error on a tell is logged, not answered
    assert sorted(seen) == list(range(50))


@message("test.rpc.add")
@dataclasses.dataclass(frozen=True)
class AddRequest:
    a: int
    b: int


def test_typed_kinds_are_checked_at_the_edge():
    handlers = {"test.rpc.add": lambda req: req.a + req.b}
    with RpcServer("inproc://test-typed", handlers) as srv, RpcClient(srv.address, config=FAST) as c:
        assert c.call("test.rpc.add", AddRequest(2, 3)) == 5
        with pytest.raises(ProtocolError, match="bad_payload"):
            c.call("test.rpc.add", {"a": 2, "b": 3})


def test_handlers_on_the_io_thread():
    cfg = dataclasses.replace(FAST, handler_threads=0)
    with RpcServer("inproc://test-inline", HANDLERS, config=cfg) as srv, RpcClient(srv.address, config=FAST) as c:
        assert [c.call("echo", i) for i in range(100)] == list(range(100))
        with pytest.raises(RemoteError):
            c.call("fail", 1)


def test_closed_client_refuses_calls(server):
    c = RpcClient(server.address, config=FAST)
    c.close()
    with pytest.raises(TransportError):
        c.call("echo", 1)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_dead_peer_fails_pending_calls(transport, tmp_path):
    srv = _ServerProcess(_address(transport, tmp_path))
    try:
        with RpcClient(srv.address, config=FAST) as c:
            assert c.call("echo", 1) == 1
            pending = c.call_async("sleep", 30)
            time.sleep(0.2)
            t0 = time.monotonic()
            srv.kill()
            with pytest.raises(PeerDeadError):
                pending.result(timeout=10)
            assert time.monotonic() - t0 < 4.0  # 5 heartbeats of 0.2 s, plus scheduling slack
    finally:
        srv.proc.kill()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_closed_connection_fails_pending_calls_at_once_whatever_the_silence_limit(transport, tmp_path):
    """A killed server closes its connection: its calls fail then, not a minute of silence later."""
    srv = _ServerProcess(_address(transport, tmp_path))
    try:
        lost = threading.Event()
        with RpcClient(srv.address, config=dataclasses.replace(FAST, heartbeat_liveness=300), on_lost=lost.set) as c:
            assert c.call("echo", 1) == 1
            pending = c.call_async("sleep", 30)
            time.sleep(0.2)
            t0 = time.monotonic()
            srv.kill()
            with pytest.raises(PeerDeadError, match="closed the connection"):
                pending.result(timeout=30)
            assert time.monotonic() - t0 < 5.0  # the limit is 60 s of silence
            assert lost.wait(5.0)  # and the owner's hook heard of it
    finally:
        srv.proc.kill()


def test_a_slow_server_is_waited_for_and_its_slowness_raises_the_limit(tmp_path):
    """A frozen (SIGSTOPped) server is silent but alive: once it has been slow, a later silence of
    more than the configured limit (but within four times its slowest answer) kills no call."""
    srv = _ServerProcess(_address("tcp", tmp_path))
    limit_s = 3.0  # 15 pings of 0.2 s
    try:
        with RpcClient(srv.address, config=dataclasses.replace(FAST, heartbeat_liveness=15)) as c:
            assert c.call("echo", 1) == 1
            # The first freeze teaches the client (its ping waits out most of it: at least 3.3 / 4 s
            # of 2.0 s, even when a busy client reads the echo's answer or pings late), and stays
            # 1 s within the limit; the second is past limit_s but within four times the first.
            for frozen_s in (2.0, 3.3):
                pending = c.call_async("echo", frozen_s)
                srv.proc.send_signal(signal.SIGSTOP)
                time.sleep(frozen_s)
                srv.proc.send_signal(signal.SIGCONT)
                assert pending.result(timeout=30) == frozen_s
            assert frozen_s > limit_s
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.proc.kill()


def test_dead_peer_inproc():
    srv = RpcServer("inproc://test-dead", HANDLERS, config=FAST).start()
    with RpcClient(srv.address, config=FAST) as c:
        assert c.call("echo", 1) == 1
        pending = c.call_async("sleep", 30)
        time.sleep(0.1)
        srv.stop()
        with pytest.raises(PeerDeadError):
            pending.result(timeout=10)


def _call_until_answered(c: RpcClient, deadline_s: float = 10.0) -> object:
    end = time.monotonic() + deadline_s
    while True:
        try:
            return c.call("echo", "back", timeout_s=0.5)
        except (PeerDeadError, RequestTimeout):
            if time.monotonic() > end:
                raise


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_reconnect_to_a_restarted_server(transport, tmp_path):
    first = _ServerProcess(_address(transport, tmp_path))
    second = None
    try:
        with RpcClient(first.address, config=FAST) as c:
            assert c.call("echo", 1) == 1
            first.kill()
            with pytest.raises((PeerDeadError, RequestTimeout)):
                c.call("echo", 2, timeout_s=1.0)
            second = _ServerProcess(first.address)  # the same endpoint, port included
            assert second.proc.pid != first.proc.pid
            assert _call_until_answered(c) == "back"
    finally:
        first.proc.kill()
        if second is not None:
            second.proc.kill()


def test_reconnect_inproc():
    address = f"inproc://test-{uuid.uuid4().hex}"
    srv = RpcServer(address, HANDLERS, config=FAST).start()
    with RpcClient(address, config=FAST) as c:
        assert c.call("echo", 1) == 1
        srv.stop()
        with pytest.raises((PeerDeadError, RequestTimeout)):
            c.call("echo", 2, timeout_s=1.0)
        with RpcServer(address, HANDLERS, config=FAST):
            assert _call_until_answered(c) == "back"


def test_no_threads_or_fds_leak(tmp_path):
    before_threads = threading.active_count()
    before_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with RpcServer("tcp://127.0.0.1:0", HANDLERS, config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
            assert c.call("echo", 1) == 1
    time.sleep(0.2)
    assert threading.active_count() <= before_threads + 1
    assert len(os.listdir("/proc/self/fd")) <= before_fds + 4


def test_calls_racing_a_close_all_end():
    """Calls made while another thread closes the client each return or raise; none waits for ever."""
    with RpcServer(f"inproc://close-race-{uuid.uuid4().hex}", HANDLERS, config=FAST) as srv:
        for _ in range(5):
            c = RpcClient(srv.address, config=FAST)
            outcomes: list[str] = []

            def caller(c: RpcClient = c, outcomes: list[str] = outcomes) -> None:
                for i in range(200):
                    try:
                        c.call("echo", i)
                        outcomes.append("ok")
                    except TransportError:
                        outcomes.append("closed")
                        return

            threads = [threading.Thread(target=caller) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.02)
            c.close()
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads), "a call hung across close()"
            assert "closed" in outcomes or len(outcomes) == 800
