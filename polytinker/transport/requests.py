"""Requests: a message class that declares its reply, so a call's kind and result type follow from it.

A request is a registered message that derives from ``Request[R]``, ``R`` being what its handler
answers; the kind is the name it is registered under, written once::

    @message("sched.w.sample")
    @dataclass(frozen=True)
    class EngineSample(Request[SampleReply]): ...

- ``ask(link, msg)`` sends ``msg`` as the kind of ``type(msg)`` over an ``RpcClient`` or a
  ``DirectClient`` and returns the answer, typed ``R`` for mypy and checked to be one at run time:
  any other answer is a ``ProtocolError`` that names the request and both types.
- ``handler_table({EngineSample: worker.sample, ...})`` turns a table keyed by request class into
  the kind-keyed table ``RpcServer`` and ``DirectClient`` serve, so a handler cannot be filed under
  another kind than its message's.
- ``kind_of(cls)`` and ``reply_of(cls)``: a request class's kind and declared reply.

``R`` may be a registered message, a plain class (``bool``), a generic alias (``dict[str, Any]``:
its origin is checked), a union of those, ``None``, or ``Any`` (not checked). Nothing changes on
the wire: the header carries the same kind string as before.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Generic, TypeVar, cast

from polytinker.errors import ConfigError, ProtocolError
from polytinker.transport.direct import Link
from polytinker.transport.messages import message_name
from polytinker.transport.server import Handler

R = TypeVar("R")


class Request(Generic[R]):
    """Base of a request message whose handler answers an ``R`` (see the module docstring)."""

    __slots__ = ()


# Per request class: its kind, the reply it declares and the classes an answer may be (None: any).
_known: dict[type, tuple[str, Any, tuple[type, ...] | None]] = {}


def _declared(cls: type) -> Any:
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (reply,) = typing.get_args(base)
                if not isinstance(reply, TypeVar):
                    return reply
    raise ConfigError(f"{cls.__qualname__} declares no reply: derive it from Request[ReplyType]")


def _classes(reply: Any) -> tuple[type, ...] | None:
    """The classes an answer of type ``reply`` is an instance of; None for ``Any``."""
    if reply is Any:
        return None
    if reply is None or reply is type(None):
        return (type(None),)
    if typing.get_origin(reply) in (typing.Union, types.UnionType):
        out: list[type] = []
        for arm in typing.get_args(reply):
            arms = _classes(arm)
            if arms is None:
                return None
            out += arms
        return tuple(out)
    origin = typing.get_origin(reply)
    if isinstance(origin, type):
        return (origin,)
    if isinstance(reply, type):
        return (reply,)
    raise ConfigError(f"a request's reply must be a class, a union of classes, None or Any, got {reply!r}")


def _entry(cls: type) -> tuple[str, Any, tuple[type, ...] | None]:
    hit = _known.get(cls)
    if hit is None:
        name = message_name(cls)
        if name is None:
            raise ConfigError(f"{cls.__qualname__} is not registered with @message, so it has no kind")
        if not issubclass(cls, Request):
            raise ConfigError(f"message {name!r} ({cls.__qualname__}) is not a request: derive it from Request[...]")
        reply = _declared(cls)
        hit = _known[cls] = (name, reply, _classes(reply))
    return hit


def kind_of(cls: type) -> str:
    """The kind a request of class ``cls`` is sent as: its registered message name."""
    return _entry(cls)[0]


def reply_of(cls: type) -> Any:
    """The reply type ``cls`` declares (the ``R`` of its ``Request[R]`` base)."""
    return _entry(cls)[1]


def _type_name(reply: Any) -> str:
    return reply.__qualname__ if isinstance(reply, type) else str(reply).replace("typing.", "")


def check_reply(msg: Request[R], answer: Any) -> R:
    """``answer``, if it is of the reply type ``msg``'s class declares; else a ``ProtocolError``."""
    kind, reply, classes = _entry(type(msg))
    if classes is not None and not isinstance(answer, classes):
        raise ProtocolError(
            f"request {kind!r} ({type(msg).__qualname__}) was answered with a {type(answer).__qualname__}, "
            f"not the {_type_name(reply)} it declares"
        )
    return cast(R, answer)


def ask(link: Link, msg: Request[R], *, timeout_s: float | None = None) -> R:
    """Send ``msg`` as the kind of its class and return the answer, checked to be its declared reply."""
    return check_reply(msg, link.call(kind_of(type(msg)), msg, timeout_s=timeout_s))


def handler_table(table: Mapping[type, Handler]) -> dict[str, Handler]:
    """The kind-keyed table of handlers keyed by request class (``RpcServer``'s and ``DirectClient``'s)."""
    return {kind_of(cls): handler for cls, handler in table.items()}


__all__ = ["Request", "ask", "check_reply", "handler_table", "kind_of", "reply_of"]
