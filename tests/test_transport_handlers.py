"""How a server runs handlers: on handler threads fed by the socket's I/O thread (which answers
heartbeats meanwhile), in order with one handler thread, ``async def`` handlers on the server's
loop, and CANCEL: a queued request never runs, a running handler sees the cancel, the answer is
dropped, and other calls go on undisturbed. Real servers and clients throughout."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import zmq

from polytinker.errors import ConfigError, RemoteError, RequestTimeout
from polytinker.transport import RpcClient, RpcServer, TransportConfig, current_call
from polytinker.transport.protocol import pack_header

# Dead after 1 s of silence, as in test_transport_rpc.py.
FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=5, request_timeout_s=10.0)
# For bursts of hundreds of calls from several threads, whose subject is not the heartbeat: on a
# loaded two-core machine the client's own I/O thread can starve past 1 s and count a live server
# dead, so these allow 10 s of silence.
PATIENT = dataclasses.replace(FAST, heartbeat_liveness=50)


def _inproc() -> str:
    return f"inproc://test-{uuid.uuid4().hex}"


class Recorder:
    """Handlers with side effects a test can watch."""

    def __init__(self) -> None:
        self.ran: list[Any] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.saw_cancel = threading.Event()
        self.concurrent = 0
        self.max_concurrent = 0
        self._lock = threading.Lock()

    def record(self, x: Any) -> Any:
        with self._lock:
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        time.sleep(0.002)
        with self._lock:
            self.ran.append(x)
            self.concurrent -= 1
        return x

    def block(self, timeout_s: float) -> str:
        """Runs until the test releases it."""
        self.started.set()
        return "released" if self.release.wait(timeout_s) else "timed out"

    def until_cancelled(self, timeout_s: float) -> str:
        call = current_call()
        assert call is not None and call.kind == "until_cancelled"
        self.started.set()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if call.cancelled:
                self.saw_cancel.set()
                return "cancelled"
            time.sleep(0.005)
        return "not cancelled"

    def handlers(self) -> dict[str, Any]:
        return {
            "record": self.record,
            "block": self.block,
            "until_cancelled": self.until_cancelled,
            "echo": lambda x: x,
            "sleep": lambda s: time.sleep(s) or s,
        }


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def test_a_queued_request_that_is_cancelled_never_runs(rec):
    cfg = dataclasses.replace(FAST, handler_threads=1)
    with RpcServer(_inproc(), rec.handlers(), config=cfg) as srv, RpcClient(srv.address, config=FAST) as c:
        blocker = c.call_async("block", 10.0)
        assert rec.started.wait(5)
        queued = c.call_async("record", "cancelled one")  # the one handler thread is busy: it waits
        time.sleep(0.2)  # it has reached the server's queue
        assert queued.cancel()
        time.sleep(1.0)  # the CANCEL has reached the server (generous: a loaded two-core machine)
        rec.release.set()
        assert blocker.result(timeout=10) == "released"
        assert c.call("record", "later") == "later"
    assert rec.ran == ["later"]


def test_a_running_handler_sees_the_cancel_and_its_answer_is_dropped(rec):
    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        fut = c.call_async("until_cancelled", 10.0)
        assert rec.started.wait(5)
        assert fut.cancel()
        assert rec.saw_cancel.wait(5)
        assert [c.call("echo", i) for i in range(20)] == list(range(20))


def test_a_timeout_cancels_the_call_on_the_server(rec):
    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        with pytest.raises(RequestTimeout):
            c.call("until_cancelled", 10.0, timeout_s=0.3)
        assert rec.saw_cancel.wait(5)
        rec.saw_cancel.clear()
        rec.started.clear()
        fut = c.call_async("until_cancelled", 10.0, timeout_s=0.3)  # the I/O thread's deadline
        with pytest.raises(RequestTimeout):
            fut.result(timeout=5)
        assert rec.saw_cancel.wait(5)


def test_asyncio_cancellation_cancels_the_call_on_the_server(rec):
    async def main(c: RpcClient) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(c.call_async("until_cancelled", 10.0)), 0.3)
        assert await asyncio.to_thread(rec.saw_cancel.wait, 5)
        assert await asyncio.wrap_future(c.call_async("echo", "after")) == "after"

    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        asyncio.run(main(c))


def test_cancelling_does_not_disturb_other_calls(rec):
    server = RpcServer("tcp://127.0.0.1:0", rec.handlers(), config=PATIENT)
    with server as srv, RpcClient(srv.address, config=PATIENT) as c:

        def burst(offset: int) -> list[int]:
            slow = [c.call_async("sleep", 0.05) for _ in range(5)]
            futs = [c.call_async("echo", offset + i) for i in range(100)]
            for f in slow:
                f.cancel()
            return [f.result(timeout=30) for f in futs]

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(burst, range(0, 400, 100)))
        assert [x for r in results for x in r] == list(range(400))
        assert c.call("echo", "last") == "last"


@contextlib.contextmanager
def _raw_dealer(address: str) -> Iterator[zmq.Socket]:
    """A bare pyzmq DEALER, as a peer in another language would connect (5 s receive timeout)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


def test_cancel_on_the_wire(rec):
    """What a peer in another language sees: nothing comes back for a cancelled request, and the
    server goes on answering."""
    with RpcServer("tcp://127.0.0.1:0", rec.handlers(), config=FAST) as srv, _raw_dealer(srv.address) as sock:
        sock.send_multipart([pack_header(1, 7, "until_cancelled"), msgpack.packb(10.0)])
        assert rec.started.wait(5)
        sock.send(pack_header(7, 7, "until_cancelled"))
        sock.send(pack_header(7, 99, "no-such-request"))  # unknown ids are ignored
        assert rec.saw_cancel.wait(5)
        sock.send_multipart([pack_header(1, 8, "echo"), msgpack.packb("after")])
        header, body = sock.recv_multipart()
        assert msgpack.unpackb(header) == [1, 2, 8, "echo"] and msgpack.unpackb(body) == "after"
        sock.send(pack_header(5, 0, ""))
        assert msgpack.unpackb(sock.recv()) == [1, 6, 0, ""]
        with pytest.raises(zmq.Again):
            sock.recv(zmq.NOBLOCK)  # still nothing for request 7


def test_one_handler_thread_serves_in_order_one_at_a_time(rec):
    cfg = dataclasses.replace(PATIENT, handler_threads=1)
    with RpcServer(_inproc(), rec.handlers(), config=cfg) as srv, RpcClient(srv.address, config=PATIENT) as c:
        futs = [c.call_async("record", i) for i in range(100)]
        futs.append(c.call_async("sleep", 0.05))  # a slow one in the middle keeps its place
        futs += [c.call_async("record", i) for i in range(100, 150)]
        for f in futs:
            f.result(timeout=30)
    assert rec.ran == list(range(150))
    assert rec.max_concurrent == 1


def test_fail_call_answers_a_stuck_handler_now_and_a_new_thread_serves_on(rec):
    """A watchdog answers a handler that does not return (fail_call): the caller gets the error at
    once, the handler's late answer is dropped, and with one handler thread the next request is
    served by the thread that replaced the stuck one. A call answered already is not failed."""
    cfg = dataclasses.replace(FAST, handler_threads=1)
    running: list[Any] = []
    handlers = {**rec.handlers(), "stuck": lambda t: running.append(current_call()) or rec.block(t)}
    with RpcServer(_inproc(), handlers, config=cfg) as srv, RpcClient(srv.address, config=FAST) as c:
        fut = c.call_async("stuck", 10.0)
        assert rec.started.wait(5)
        assert srv.fail_call(running[0], TimeoutError("the handler ran past its deadline"))
        with pytest.raises(RemoteError, match="ran past its deadline") as info:
            fut.result(timeout=5)
        assert info.value.remote_type == "TimeoutError"
        assert not srv.fail_call(running[0], TimeoutError("twice"))  # one answer per call
        assert c.call("echo", "served", timeout_s=5) == "served"  # the stuck thread was replaced
        rec.release.set()  # the stuck handler returns: its answer goes nowhere
        assert [c.call("echo", i, timeout_s=5) for i in range(5)] == list(range(5))


def test_heartbeats_are_answered_while_a_long_handler_runs(rec):
    """The handler runs on a handler thread; the I/O thread answers the pings of a client that
    counts the server dead after 1 s meanwhile."""
    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        assert c.call("sleep", 1.6) == 1.6
        assert c.call("echo", 1) == 1


def test_many_slow_handlers_start_together(rec):
    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        t0 = time.monotonic()
        futs = [c.call_async("sleep", 0.5) for _ in range(FAST.handler_threads)]
        assert [f.result(timeout=10) for f in futs] == [0.5] * FAST.handler_threads
        assert time.monotonic() - t0 < 2.0  # in parallel, not one after the other


def test_async_handlers_await_concurrently():
    seen: list[str] = []

    async def nap(seconds: float) -> float:
        call = current_call()
        assert call is not None
        seen.append(call.kind)
        await asyncio.sleep(seconds)
        return seconds

    async def boom(x: Any) -> None:
        await asyncio.sleep(0)
        raise ValueError(f"bad {x}")

    cfg = dataclasses.replace(FAST, handler_threads=1)
    handlers = {"nap": nap, "boom": boom, "echo": lambda x: x}
    with RpcServer(_inproc(), handlers, config=cfg) as srv, RpcClient(srv.address, config=FAST) as c:
        t0 = time.monotonic()
        futs = [c.call_async("nap", 0.5) for _ in range(50)]
        assert [f.result(timeout=10) for f in futs] == [0.5] * 50
        assert time.monotonic() - t0 < 3.0  # 50 x 0.5 s one after the other would be 25 s
        assert seen == ["nap"] * 50
        with pytest.raises(RemoteError) as info:
            c.call("boom", 3)
        assert info.value.remote_type == "ValueError" and "bad 3" in str(info.value)
        assert c.call("echo", "sync too") == "sync too"


def _forever_handler() -> tuple[Callable[[Any], Awaitable[None]], threading.Event, threading.Event]:
    """An async handler that waits a minute, and the events set when it starts and when it is cancelled."""
    cancelled = threading.Event()
    started = threading.Event()

    async def forever(_: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return forever, started, cancelled


def test_a_cancelled_async_handler_is_cancelled_at_its_await():
    forever, started, cancelled = _forever_handler()
    with RpcServer(_inproc(), {"forever": forever}, config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        fut = c.call_async("forever", None)
        assert started.wait(5)
        assert fut.cancel()
        assert cancelled.wait(5)


def test_stopping_cancels_running_async_handlers():
    forever, started, cancelled = _forever_handler()
    srv = RpcServer(_inproc(), {"forever": forever}, config=FAST).start()
    with RpcClient(srv.address, config=FAST) as c:
        c.call_async("forever", None)
        assert started.wait(5)
        srv.stop()
        assert cancelled.wait(5)


def test_handler_settings_are_checked():
    with pytest.raises(ConfigError, match="handler_threads"):
        TransportConfig(handler_threads=-1)
    with pytest.raises(ConfigError, match="max_depth"):
        TransportConfig(max_depth=1)
    with pytest.raises(ConfigError, match="not callable"):
        RpcServer(_inproc(), {"x": 3})  # type: ignore[dict-item]


def test_a_slow_handler_never_delays_a_quick_one(rec):
    with RpcServer(_inproc(), rec.handlers(), config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        assert [c.call("echo", i) for i in range(50)] == list(range(50))
        slow = c.call_async("sleep", 0.5)
        t0 = time.monotonic()
        assert c.call("echo", "fast") == "fast"
        assert time.monotonic() - t0 < 0.4
        assert slow.result(timeout=5) == 0.5


def test_a_tell_that_cannot_be_served_is_dropped_silently(rec):
    with RpcServer("tcp://127.0.0.1:0", rec.handlers(), config=FAST) as srv, _raw_dealer(srv.address) as sock:
        sock.send_multipart([pack_header(4, 1, "record"), b"\xc1"])  # 0xc1: never valid msgpack
        sock.send_multipart([pack_header(4, 2, "record"), msgpack.packb("ok")])
        sock.send_multipart([pack_header(1, 3, "echo"), msgpack.packb("after")])
        header, body = sock.recv_multipart()
        assert msgpack.unpackb(header) == [1, 2, 3, "echo"] and msgpack.unpackb(body) == "after"
        end = time.monotonic() + 5
        while not rec.ran and time.monotonic() < end:  # a tell may still run on a handler thread
            time.sleep(0.01)
        time.sleep(0.05)
    assert rec.ran == ["ok"]


def test_a_handler_that_raises_system_exit_does_not_stop_the_server():
    def leave(_: Any) -> None:
        raise SystemExit(3)

    handlers = {"leave": leave, "echo": lambda x: x}
    with RpcServer(_inproc(), handlers, config=FAST) as srv, RpcClient(srv.address, config=FAST) as c:
        for _ in range(3):
            with pytest.raises(RemoteError) as info:
                c.call("leave", None)
            assert info.value.remote_type == "SystemExit"
            assert c.call("echo", "still here") == "still here"
