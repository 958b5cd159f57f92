"""The depth check of a body that msgpack alone decodes (maps, lists and scalars: no ext value, so
no typed message), on the codec's fast path for small plain bodies."""

from __future__ import annotations

import itertools
from typing import Any

from polytinker.errors import ProtocolError


def check_plain_depth(obj: list[Any] | dict[Any, Any], body: bytes | bytearray | memoryview, limit: int) -> None:
    """Raise ProtocolError when ``obj``, decoded from ``body``, nests deeper than ``limit``.

    Nesting n deep takes n map or array headers, so a body with at most ``limit`` bytes that could
    be one (counted at C speed, strings and numbers included) needs no walk: a remote env's state
    (maps of maps, 490 bytes) is checked in well under a microsecond instead of 22."""
    raw = body if type(body) is bytes else bytes(body)
    if len(raw.translate(None, _NOT_OPENERS)) > limit:
        _walk(obj, limit)


_PLAIN_NESTED = frozenset({list, dict})
# The first bytes of msgpack maps and arrays: fixmap, fixarray, array 16/32, map 16/32.
_OPENERS = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_OPENERS = bytes(b for b in range(256) if b not in _OPENERS)
_LISTS = frozenset({list})


def _walk(obj: list[Any] | dict[Any, Any], limit: int) -> None:
    """``check_depth`` for what msgpack alone decodes: maps, lists and scalars, never a typed
    message (an ext value, which sends a body to the full decoder), so no type is looked up.
    Level by level, each container's element types tested at C speed and only its containers
    carried down (a level made of lists only, token ids, in one go): the state of a remote env,
    maps of maps, in about half of check_depth's time."""
    level: list[Any] = [obj]
    depth = 1
    while level:
        if depth > limit:
            raise ProtocolError(f"values nest deeper than max_depth={limit}")
        lists_only = _LISTS.issuperset(map(type, level))
        if lists_only and _PLAIN_NESTED.isdisjoint(map(type, itertools.chain.from_iterable(level))):
            return
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            if _PLAIN_NESTED.isdisjoint(map(type, children)):
                continue
            if _LISTS.issuperset(map(type, children)):
                below += children
            else:
                below += [c for c in children if type(c) is dict or type(c) is list]
        level = below
        depth += 1
