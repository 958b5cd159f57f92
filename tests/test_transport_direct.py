"""``DirectClient``: the handlers of a server called in this process answer what they answer over a
socket (the same values, typed messages and errors), on the caller's thread, bounded by ``concurrency``."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from polytinker.errors import ConfigError, NotResident, ProtocolError, RemoteError, TransportError
from polytinker.transport import RpcClient, RpcServer, current_call, message
from polytinker.transport.direct import DirectClient


@message("test.direct.pair")
@dataclasses.dataclass(frozen=True)
class Pair:
    left: tuple[int, ...]
    right: str = ""


def _config_error(x: Any) -> Any:
    raise ConfigError(f"bad value {x!r}")


def _not_resident(x: Any) -> Any:
    raise NotResident("dropped it")


def _crash(x: Any) -> Any:
    raise ZeroDivisionError("boom")


def _seen(x: Any) -> Any:
    call = current_call()
    return {"kind": call.kind if call else None, "type": type(x).__name__, "value": x}


HANDLERS = {
    "echo": lambda x: x,
    "seen": _seen,
    "test.direct.pair": lambda p: Pair(tuple(reversed(p.left)), p.right.upper()),
    "config": _config_error,
    "resident": _not_resident,
    "crash": _crash,
}
CALLS: list[tuple[str, Any]] = [
    ("echo", (1, 2, (3, "x"))),
    ("echo", {"a": np.arange(4, dtype=np.float32), "b": None, 3: b"raw"}),
    ("seen", (1.5, [2])),
    ("test.direct.pair", Pair((1, 2, 3), "ab")),
    ("test.direct.pair", {"left": [1]}),  # not the kind's message type: refused
    ("config", 7),
    ("resident", 0),
    ("crash", 0),
    ("nope", 1),  # no such kind
]


def _outcome(client: Any, kind: str, payload: Any) -> Any:
    try:
        out = client.call(kind, payload, timeout_s=10.0)
    except RemoteError as exc:
        return ("remote", exc.code, exc.remote_type, re.sub(r" \[error id \w+\]", "", str(exc)))  # ids differ
    except ProtocolError as exc:
        return ("protocol", str(exc))
    if isinstance(out, dict) and "a" in out:
        out = {**out, "a": (out["a"].dtype.str, out["a"].tolist(), out["a"].flags.writeable)}
    return ("ok", out)


def test_direct_calls_answer_what_the_socket_answers() -> None:
    direct = DirectClient("same", HANDLERS)
    server = RpcServer(f"inproc://direct-{uuid.uuid4().hex}", HANDLERS).start()
    with server, RpcClient(server.address) as wire:
        for kind, payload in CALLS:
            assert _outcome(direct, kind, payload) == _outcome(wire, kind, payload), kind
    assert _outcome(direct, "echo", (1, (2,))) == ("ok", [1, [2]])
    assert _outcome(direct, "test.direct.pair", Pair((1, 2), "ab")) == ("ok", Pair((2, 1), "AB"))
    assert _outcome(direct, "resident", 0)[:2] == ("remote", NotResident.code)
    direct.close()
    with pytest.raises(TransportError, match="closed"):
        direct.call("echo", 1)


def test_direct_calls_run_on_the_callers_thread_within_the_concurrency_bound() -> None:
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def work(x: Any) -> Any:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return threading.get_ident()

    one = DirectClient("one", {"work": work}, concurrency=1)
    assert one.call("work") == threading.get_ident()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: one.call("work"), range(8)))
    assert state["most"] == 1
    many = DirectClient("many", {"work": work})
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: many.call("work"), range(8)))
    assert state["most"] > 1


def test_async_handlers_are_refused() -> None:
    async def handler(x: Any) -> Any:
        return x

    with pytest.raises(ConfigError, match="async"):
        DirectClient("a", {"h": handler})
