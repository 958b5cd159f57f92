"""Frozen config dataclasses built from plain tables: TOML files, ``--set`` overrides, wire maps.

``from_table(TrainConfig, {"steps": "ten"}, "train")`` raises ``ConfigError("train.steps:
expected int, got str 'ten'")``: every key is checked against the dataclass's own field types
(``int``, ``float``, ``bool``, ``str``, ``Literal``, string enums, ``tuple[X, ...]``,
``dict[K, V]``, unions, nested dataclasses), so a wrong type names the field and the type it
wants before ``__post_init__`` compares it with anything. Unknown keys are errors that list the
known ones (``check_keys``). Value checks (ranges, choices that depend on other fields) stay in
each dataclass's ``__post_init__``.

One checker for every config table, so the experiment TOML, the agents' specs and the env
config (in a TOML file or an ``env.open`` request) say the same thing about the same mistake.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from polytinker.errors import ConfigError

T = TypeVar("T")


def check_keys(cls: type, data: Mapping[str, Any], what: str) -> None:
    """Unknown keys are errors that list the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{what or cls.__name__}: unknown keys {unknown}; known: {sorted(known)}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Resolved once per class: the server checks an env config on every env.open.
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def from_table(cls: type[T], data: Any, what: str) -> T:
    """``cls(**data)`` after checking the keys and the type of every value (nested dataclasses
    are built from their own tables, ``what.field`` naming them); ints become floats where a
    float is wanted, arrays tuples where a tuple is."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what or cls.__name__}: expected a table, got {_shown(data)}")
    check_keys(cls, data, what)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # callers pass dataclasses
    missing = [f.name for f in fields if f.name not in data and _required(f)]
    if missing:
        raise ConfigError(f"{what or cls.__name__}: missing {', '.join(missing)} (no default)")
    hints = _hints(cls)
    kwargs = {name: _converted(value, hints[name], _join(what, name)) for name, value in data.items()}
    return cls(**kwargs)


def check_types(cls: type, data: Mapping[str, Any], what: str) -> None:
    """Only the checks of ``from_table`` (keys and types), building nothing."""
    check_keys(cls, data, what)
    hints = _hints(cls)
    for name, value in data.items():
        _converted(value, hints[name], _join(what, name))


def _join(what: str, name: str) -> str:
    return f"{what}.{name}" if what else name


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _converted(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the field wants it, or ConfigError naming ``where`` and the expected type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for member in args:
            try:
                return _converted(value, member, where)
            except ConfigError:
                continue
        raise _mismatch(where, hint, value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return from_table(hint, value, _element_path(where, value))
        raise _mismatch(where, hint, value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _mismatch(where, hint, value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_converted(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise _mismatch(where, hint, value)
        return tuple(_converted(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(args, value, strict=False)))
    if origin in (dict, Mapping, typing.Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _mismatch(where, hint, value)
        key_hint, value_hint = args if len(args) == 2 else (Any, Any)
        return {
            _converted(k, key_hint, f"{where} key"): _converted(v, value_hint, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if origin is Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise _mismatch(where, hint, value)
    return _scalar(value, hint, where)


def _scalar(value: Any, hint: Any, where: str) -> Any:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        # The enum's own __post_init__ check lists the choices; here only the type is wrong.
        if isinstance(value, hint | str):
            return value
        raise _mismatch(where, hint, value)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        ok = isinstance(value, float)
    elif hint is type(None):
        ok = value is None
    elif isinstance(hint, type):
        ok = isinstance(value, hint)
    else:
        ok = True  # a type this checker does not know: __post_init__ has the last word
    if not ok:
        raise _mismatch(where, hint, value)
    return value


def _element_path(where: str, table: Mapping[str, Any]) -> str:
    # agents[1] reads better as agents['bob'] when the table names itself.
    name = table.get("name")
    if isinstance(name, str) and where.endswith("]") and "[" in where:
        return f"{where.rsplit('[', 1)[0]}[{name!r}]"
    return where


def describe(hint: Any) -> str:
    """A field type in the words of a TOML file: int, float, str, bool, array of str, table."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"array of {describe(args[0])}" if len(args) == 2 and args[1] is Ellipsis else "array"
    if origin in (dict, Mapping, typing.Mapping) or hint in (dict, Mapping):
        return f"table of {describe(args[1])}" if len(args) == 2 and args[1] is not Any else "table"
    if dataclasses.is_dataclass(hint):
        return "table"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    if hint is type(None):
        return "nothing (leave it out)"
    if hint is Any:
        return "any value"
    return getattr(hint, "__name__", str(hint))


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _mismatch(where: str, hint: Any, value: Any) -> ConfigError:
    return ConfigError(f"{where}: expected {describe(hint)}, got {_shown(value)}")


__all__ = ["check_keys", "check_types", "describe", "from_table"]
