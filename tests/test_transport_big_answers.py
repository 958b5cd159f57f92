"""Where an RPC answer is decoded: the answer to a blocking ``call()``, big (a sample of a thousand
sequences) or small, by the caller that waits for it, on its own socket (no other caller's answer
waits behind it); the answer to ``call_async()`` on arrival, by the client's I/O thread."""

from __future__ import annotations

import dataclasses
import threading

from polytinker.transport import RpcClient, RpcServer, message

DECODED_ON: list[str] = []  # the threads that built a Rows, in order (the server's handler's too)


@message("test.big_answers.rows")
@dataclasses.dataclass(frozen=True)
class Rows:
    ints: list[int]

    def __post_init__(self) -> None:
        DECODED_ON.append(threading.current_thread().name)


def _rows(n: int) -> Rows:
    return Rows(list(range(n)))


def test_a_blocking_call_is_decoded_by_its_caller_and_an_async_one_by_the_io_thread() -> None:
    caller = threading.current_thread().name
    with RpcServer("tcp://127.0.0.1:0", {"rows": _rows}) as server, RpcClient(server.address) as client:
        DECODED_ON.clear()
        assert client.call("rows", 50_000).ints == list(range(50_000))  # about 150 kB of msgpack
        assert DECODED_ON[-1] == caller, DECODED_ON

        DECODED_ON.clear()
        assert client.call("rows", 3).ints == [0, 1, 2]
        assert DECODED_ON[-1] == caller, DECODED_ON

        DECODED_ON.clear()
        assert client.call_async("rows", 3).result(30.0).ints == [0, 1, 2]
        assert DECODED_ON[-1].startswith("polytinker-client"), DECODED_ON

        # Many callers at once, big and small: each gets its own answer.
        results: dict[int, list[int]] = {}

        def call(n: int) -> None:
            results[n] = client.call("rows", n).ints

        threads = [threading.Thread(target=call, args=(n,)) for n in (3, 40_000, 5, 60_000, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        assert results == {n: list(range(n)) for n in (3, 40_000, 5, 60_000, 7)}
