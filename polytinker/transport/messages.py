"""Typed messages: a registry of frozen dataclasses, one per message name.

``@message("sample")`` registers a dataclass under a name. The codec then carries instances of it
(anywhere in a payload, nested too) as a msgpack ext value holding the name and a map of fields,
and rebuilds the same type on the other side, so ``__post_init__`` validation runs at the edge.

When a registered name equals an RPC kind, the server also checks that a request of that kind
carries exactly that type before its handler runs (see ``RpcServer``). Such a request may carry
numpy arrays or torch tensors only if its type is registered with ``arrays=True``: a server whose
kinds declare none never builds an array for a peer, nor imports torch for one.

On decode, fields annotated as tuples (``tuple[int, ...]``, ``tuple[X, ...] | None``) get tuples
back and fields annotated with an ``Enum`` subclass get its member back; everything else arrives
as the codec gives it (lists for sequences).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from polytinker.errors import ConfigError, ProtocolError
from polytinker.transport.protocol import describe

T = TypeVar("T")

_lock = threading.Lock()
_by_name: dict[str, type] = {}
_by_type: dict[type, str] = {}
_with_arrays: set[type] = set()  # registered with arrays=True
_reused: set[type] = set()  # registered with reused=True
_reused_names: tuple[str, ...] = ()  # their names (a new tuple at each registration)
# Per-type field converters, built on first decode (type hints may name classes defined later).
_converters: dict[type, dict[str, Callable[[Any], Any]]] = {}


def register_message(name: str, cls: type, *, arrays: bool = False, reused: bool = False) -> None:
    """Register dataclass ``cls`` under ``name``; a name or a class registers once. ``arrays``:
    a request of kind ``name`` may carry numpy arrays and torch tensors. ``reused``: instances are
    immutable values (a frozen dataclass of strings, numbers and tuples, no arrays) that peers send
    again and again, such as an adapter's layout with each version: the codec may encode one once
    (equal instances must encode alike) and hand out one decoded instance for equal bytes."""
    global _reused_names
    if reused and (arrays or not getattr(getattr(cls, "__dataclass_params__", None), "frozen", False)):
        raise ConfigError(f"@message({name!r}): a reused message must be a frozen dataclass without arrays")
    if not name or not isinstance(name, str):
        raise ConfigError(f"message name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"@message({name!r}) needs a dataclass, got {cls!r}")
    with _lock:
        if _by_name.get(name, cls) is not cls:
            raise ConfigError(f"message name {name!r} is already registered to {_by_name[name].__qualname__}")
        if _by_type.get(cls, name) != name:
            raise ConfigError(f"{cls.__qualname__} is already registered as {_by_type[cls]!r}")
        _by_name[name] = cls
        _by_type[cls] = name
        if arrays:
            _with_arrays.add(cls)
        if reused and cls not in _reused:
            _reused.add(cls)
            _reused_names = (*_reused_names, name)


def message(name: str, *, arrays: bool = False, reused: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``@message("kind")`` above ``@dataclass(frozen=True)`` registers the class;
    ``arrays=True`` lets a request of that kind carry numpy arrays and torch tensors; ``reused``
    is :func:`register_message`'s."""

    def deco(cls: type[T]) -> type[T]:
        register_message(name, cls, arrays=arrays, reused=reused)
        return cls

    return deco


def message_name(cls: type) -> str | None:
    """The registered name of ``cls``, or None."""
    return _by_type.get(cls)


def message_type(name: str) -> type | None:
    """The class registered under ``name``, or None."""
    return _by_name.get(name)


def is_reused(cls: type) -> bool:
    """Whether ``cls`` was registered with ``reused=True``."""
    return cls in _reused


def reused_names() -> tuple[str, ...]:
    """The names registered with ``reused=True``."""
    return _reused_names


def takes_arrays(cls: type) -> bool:
    """Whether ``cls`` was registered with ``arrays=True``."""
    return cls in _with_arrays


def to_fields(obj: Any) -> dict[str, Any]:
    """The init fields of a registered dataclass instance, shallow (nested values stay objects)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def from_fields(name: str, fields: Any) -> Any:
    """Rebuild the message registered as ``name``; any mismatch is a ProtocolError."""
    cls = _by_name.get(name)
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r} (not registered with @message on this side)")
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise ProtocolError(f"message {name!r}: fields must be a map of names to values")
    conv = _converters.get(cls)
    if conv is None:
        conv = _converters[cls] = _build_converters(cls)
    try:
        kwargs = {k: (conv[k](v) if k in conv and v is not None else v) for k, v in fields.items()}
        return cls(**kwargs)
    except Exception as exc:  # a hostile peer controls every field: any failure is its fault
        why = describe(exc)  # bounded, and it cannot raise: str() of a value a peer built may
        raise ProtocolError(f"message {name!r} does not fit {cls.__qualname__}: {type(exc).__name__}: {why}") from exc


def _build_converters(cls: type) -> dict[str, Callable[[Any], Any]]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: fall back to the values as decoded
        return {}
    out: dict[str, Callable[[Any], Any]] = {}
    for f in dataclasses.fields(cls):
        fn = _converter_for(hints.get(f.name))
        if fn is not None:
            out[f.name] = fn
    return out


def _converter_for(hint: Any) -> Callable[[Any], Any] | None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) != 1:
            return None
        return _converter_for(options[0])
    if hint is tuple or origin is tuple:
        args = typing.get_args(hint)
        # tuple[tuple[int, ...], ...]: the inner sequences are tuples too (msgpack gives lists).
        inner = _converter_for(args[0]) if len(args) == 2 and args[1] is Ellipsis else None
        if inner is not None:
            return lambda v: tuple(inner(x) for x in v) if isinstance(v, list | tuple) else v
        return lambda v: tuple(v) if isinstance(v, list) else v
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    return None


__all__ = [
    "from_fields",
    "message",
    "message_name",
    "message_type",
    "register_message",
    "takes_arrays",
    "to_fields",
]
