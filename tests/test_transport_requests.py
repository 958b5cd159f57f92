"""``Request[R]``, ``ask`` and ``handler_table``: a call's kind comes from its message class, its
answer is checked against the reply the class declares, and handlers are filed by class. Over a
real ``RpcServer`` (inproc) and over ``DirectClient``."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any, assert_type

import pytest

from polytinker.errors import ConfigError, ProtocolError
from polytinker.transport import (
    DirectClient,
    Link,
    Request,
    RpcClient,
    RpcServer,
    ask,
    current_call,
    handler_table,
    kind_of,
    message,
    reply_of,
)


@message("test.requests.doubled")
@dataclasses.dataclass(frozen=True)
class Doubled:
    value: int


@message("test.requests.double")
@dataclasses.dataclass(frozen=True)
class Double(Request[Doubled]):
    value: int


@message("test.requests.is_even")
@dataclasses.dataclass(frozen=True)
class IsEven(Request[bool]):
    value: int


@message("test.requests.stats")
@dataclasses.dataclass(frozen=True)
class Stats(Request[dict[str, Any]]):
    pass


@message("test.requests.either")
@dataclasses.dataclass(frozen=True)
class Either(Request[Doubled | None]):
    value: int


@message("test.requests.anything")
@dataclasses.dataclass(frozen=True)
class Anything(Request[Any]):
    value: int


@message("test.requests.liar")
@dataclasses.dataclass(frozen=True)
class Liar(Request[Doubled]):
    """Its handler answers a plain int, not the ``Doubled`` the class declares."""

    value: int


@message("test.requests.plain")
@dataclasses.dataclass(frozen=True)
class Plain:
    """A registered message that is no request (a nested value)."""

    value: int


@dataclasses.dataclass(frozen=True)
class Unregistered(Request[int]):
    value: int


def _double(msg: Double) -> Doubled:
    call = current_call()
    assert call is not None and call.kind == "test.requests.double"  # the kind the class is registered as
    return Doubled(2 * msg.value)


TABLE: dict[type, Any] = {
    Double: _double,
    IsEven: lambda m: m.value % 2 == 0,
    Stats: lambda m: {"calls": 1},
    Either: lambda m: Doubled(m.value) if m.value else None,
    Anything: lambda m: [m.value],
    Liar: lambda m: m.value,
}


@pytest.fixture(params=["socket", "direct"])
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    if request.param == "direct":
        with DirectClient("requests", handler_table(TABLE)) as direct:
            yield direct
        return
    address = f"inproc://requests-{uuid.uuid4().hex}"
    server = RpcServer(address, handler_table(TABLE)).start()
    try:
        with RpcClient(address) as client:
            yield client
    finally:
        server.stop()


def test_the_kind_and_the_reply_come_from_the_message_class() -> None:
    assert kind_of(Double) == "test.requests.double"
    assert reply_of(Double) is Doubled
    assert reply_of(Stats) == dict[str, Any]
    assert handler_table(TABLE) == {
        "test.requests.double": _double,
        **{kind_of(cls): fn for cls, fn in TABLE.items() if cls is not Double},
    }
    assert set(handler_table(TABLE)) == {
        "test.requests.double",
        "test.requests.is_even",
        "test.requests.stats",
        "test.requests.either",
        "test.requests.anything",
        "test.requests.liar",
    }


def test_ask_sends_the_kind_of_the_class_and_returns_the_declared_reply(link: Link) -> None:
    doubled = ask(link, Double(21), timeout_s=10.0)
    assert_type(doubled, Doubled)  # what mypy infers (the package's typed call sites are checked by `make lint`)
    assert doubled == Doubled(42)
    assert ask(link, IsEven(4)) is True
    assert ask(link, IsEven(3)) is False
    assert ask(link, Stats()) == {"calls": 1}
    assert ask(link, Either(3)) == Doubled(3)
    assert ask(link, Either(0)) is None
    assert ask(link, Anything(5)) == [5]  # Any: not checked


def test_an_answer_of_another_type_is_refused_naming_both(link: Link) -> None:
    with pytest.raises(ProtocolError) as err:
        ask(link, Liar(3))
    text = str(err.value)
    assert "'test.requests.liar' (Liar)" in text
    assert "answered with a int" in text
    assert "not the Doubled it declares" in text


def test_what_is_no_request_has_no_kind() -> None:
    with pytest.raises(ConfigError, match="not registered with @message"):
        kind_of(Unregistered)
    with pytest.raises(ConfigError, match=r"'test.requests.plain' \(Plain\) is not a request"):
        kind_of(Plain)
    with pytest.raises(ConfigError, match="not a request"):
        handler_table({Plain: lambda m: m})
    with pytest.raises(ConfigError, match="not registered"):
        ask(DirectClient("none", {}), Unregistered(1))
