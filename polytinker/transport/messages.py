"""Typed messages: a registry of frozen dataclasses, one per message name.

``@message("sample")`` registers a dataclass under a name. The codec then carries instances of it
(anywhere in a payload, nested too) as a msgpack ext value holding the name and a map of fields,
and rebuilds the same type on the other side, so ``__post_init__`` validation runs at the edge.

When a registered name equals an RPC kind, the server also checks that a request of that kind
carries exactly that type before its handler runs (see ``RpcServer``). Such a request may carry
numpy arrays or torch tensors only if its type is registered with ``arrays=True``: a server whose
kinds declare none never builds an array for a peer, nor imports torch for one.

On decode, every field is checked against its annotation before the class is built, so a
handler never sees a value of another type than it declares (a peer controls every field; a dict
where a job id goes must not reach SQLite): ``str``, ``bool``, ``int`` (not a bool, within signed
64 bits), ``float`` (an int is taken as a float; finiteness is the message's own business, since
answers may carry NaN), ``Literal``, registered messages, and ``tuple``/``list``/``dict`` of those,
``X | None`` and unions of them. A field annotated ``Any`` (or with a type this module does not
know) arrives as the codec gives it. Fields annotated as tuples get tuples back, and fields
annotated with an ``Enum`` subclass get its member back. A mismatch is a ``ProtocolError`` that
names the message, the field and what it must be.
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
    kwargs = {}
    for k, v in fields.items():
        check = conv.get(k)
        try:
            kwargs[k] = v if check is None else check(v)
        except _FieldTypeError as exc:
            raise ProtocolError(f"message {name!r} ({cls.__qualname__}): field {k!r} must be {exc}") from None
    try:
        return cls(**kwargs)
    except Exception as exc:  # a hostile peer controls every field: any failure is its fault
        why = describe(exc)  # bounded, and it cannot raise: str() of a value a peer built may
        raise ProtocolError(f"message {name!r} does not fit {cls.__qualname__}: {type(exc).__name__}: {why}") from exc


class _FieldTypeError(TypeError):
    """A field's value is not of its annotated type; the message says what it must be."""


def _build_converters(cls: type) -> dict[str, Callable[[Any], Any]]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: fall back to the values as decoded
        return {}
    out: dict[str, Callable[[Any], Any]] = {}
    for f in dataclasses.fields(cls):
        fn = _checker_for(hints.get(f.name))
        if fn is not None:
            out[f.name] = fn
    return out


_INT64 = (-(1 << 63), 1 << 63)  # what SQLite, numpy and torch store; msgpack carries more


def _int(v: Any) -> int:
    if type(v) is not int or not _INT64[0] <= v < _INT64[1]:
        raise _FieldTypeError("an int within signed 64 bits")
    return v


def _float(v: Any) -> float:
    if type(v) is float:
        return v
    if type(v) is int and _INT64[0] <= v < _INT64[1]:
        return float(v)
    raise _FieldTypeError("a number")


def _exact(kind: type, what: str) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not kind:
            raise _FieldTypeError(what)
        return v

    return check


def _ints(v: Any, make: Callable[[Any], Any]) -> Any:
    """A sequence of ints, checked at C speed: prompts and datums carry hundreds of thousands."""
    if not isinstance(v, list | tuple) or not set(map(type, v)) <= {int}:
        raise _FieldTypeError("a list of ints")
    if v and not (_INT64[0] <= min(v) and max(v) < _INT64[1]):
        raise _FieldTypeError("a list of ints within signed 64 bits")
    return v if type(v) is make else make(v)


def _floats(v: Any, make: Callable[[Any], Any]) -> Any:
    if not isinstance(v, list | tuple) or not set(map(type, v)) <= {float, int}:
        raise _FieldTypeError("a list of numbers")
    if any(type(x) is int for x in v):
        return make(_float(x) for x in v)
    return v if type(v) is make else make(v)


_SCALARS: dict[Any, Callable[[Any], Any]] = {
    str: _exact(str, "a string"),
    bool: _exact(bool, "a bool"),
    int: _int,
    float: _float,
    bytes: _exact(bytes, "bytes"),
}


def _checker_for(hint: Any) -> Callable[[Any], Any] | None:
    """The function that checks (and converts) a decoded value of a field annotated ``hint``;
    None for an annotation it does not check (``Any``, a class it does not know)."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(args)
    if origin is typing.Literal:
        return _literal_checker(args)
    if hint is tuple or hint is list or origin in (tuple, list):
        return _sequence_checker(origin or hint, args)
    if hint is dict or origin is dict:
        return _dict_checker(args)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_checker(hint)
    if isinstance(hint, type) and hint in _by_type:
        return _instance_checker(hint)
    return None


def _union_checker(args: tuple[Any, ...]) -> Callable[[Any], Any] | None:
    optional = type(None) in args
    checks = [_checker_for(a) for a in args if a is not type(None)]
    if any(c is None for c in checks):
        return None  # one option is unchecked: so is the field

    def check(v: Any) -> Any:
        if v is None and optional:
            return None
        wanted = []
        for c in checks:
            try:
                return c(v)  # type: ignore[misc]
            except _FieldTypeError as exc:
                wanted.append(str(exc))
        raise _FieldTypeError(" or ".join(wanted + ["nil"] * optional))

    return check


def _literal_checker(args: tuple[Any, ...]) -> Callable[[Any], Any]:
    allowed = set(args)

    def check(v: Any) -> Any:
        if not isinstance(v, str | int) or v not in allowed:
            raise _FieldTypeError(f"one of {sorted(map(str, allowed))}")
        return v

    return check


def _sequence_checker(kind: type, args: tuple[Any, ...]) -> Callable[[Any], Any] | None:
    if (len(args) == 2 and args[1] is Ellipsis) or (kind is list and len(args) == 1):
        item = args[0]
        if item is int:
            return lambda v: _ints(v, kind)
        if item is float:
            return lambda v: _floats(v, kind)
        inner = _checker_for(item)
        if inner is None:
            return lambda v: _sequence(v, kind, None)
        return lambda v: _sequence(v, kind, inner)
    if not args:  # a bare tuple or list: any items
        return lambda v: _sequence(v, kind, None)
    return _fixed_tuple_checker(args)


def _sequence(v: Any, kind: type, inner: Callable[[Any], Any] | None) -> Any:
    if not isinstance(v, list | tuple):
        raise _FieldTypeError("a list")
    if inner is None:
        return v if type(v) is kind else kind(v)
    return kind(inner(x) for x in v)


def _fixed_tuple_checker(args: tuple[Any, ...]) -> Callable[[Any], Any] | None:
    checks = [_checker_for(a) for a in args]

    def check(v: Any) -> Any:
        if not isinstance(v, list | tuple) or len(v) != len(checks):
            raise _FieldTypeError(f"a list of {len(checks)} values")
        return tuple(x if c is None else c(x) for c, x in zip(checks, v, strict=True))

    return check


def _dict_checker(args: tuple[Any, ...]) -> Callable[[Any], Any]:
    key = _checker_for(args[0]) if args else None
    value = _checker_for(args[1]) if len(args) == 2 else None

    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _FieldTypeError("a map")
        if key is None and value is None:
            return v
        return {(k if key is None else key(k)): (x if value is None else value(x)) for k, x in v.items()}

    return check


def _enum_checker(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        try:
            return cls(v)
        except (ValueError, TypeError):
            raise _FieldTypeError(f"one of {[str(m.value) for m in cls]}") from None

    return check


def _instance_checker(cls: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if not isinstance(v, cls):
            raise _FieldTypeError(f"a {_by_type[cls]!r} message")
        return v

    return check


__all__ = [
    "from_fields",
    "message",
    "message_name",
    "message_type",
    "register_message",
    "takes_arrays",
    "to_fields",
]
