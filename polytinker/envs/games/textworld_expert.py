"""The scripted expert of ``textworld-v0``: it solves every task from what the agent knows.

It reads only ``info["view"]`` (the task, the place, what is held, the rooms visited and the
contents of the receptacles searched), never the hidden world: where the object it needs is not
known yet, it searches, receptacle by receptacle in the listed order, then room by room. With
the object in hand it goes to the sinkbasin or the microwave when the task asks for a clean or
a hot one, then to a receptacle of the target's kind, opens it if closed and puts the object in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from polytinker.envs.games.textworld_gen import LAMP, kind_of
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.types import AgentID, PolicyInput


def _room_path(view: dict[str, Any], to_room: str) -> list[str]:
    """Rooms to walk through from the current one to ``to_room`` (known doors only), or []."""
    start, known = view["room"], view["map"]
    previous: dict[str, str] = {start: ""}
    queue = deque([start])
    while queue:
        room = queue.popleft()
        if room == to_room:
            path = []
            while room != start:
                path.append(room)
                room = previous[room]
            return path[::-1]
        for nxt in known.get(room, {}).get("exits", []):
            if nxt not in previous:
                previous[nxt] = room
                queue.append(nxt)
    return []


def _room_of(view: dict[str, Any], receptacle: str) -> str:
    return next(room for room, info in view["map"].items() if receptacle in info["receptacles"])


def _nearest(view: dict[str, Any], receptacles: list[str]) -> str | None:
    here = [r for r in receptacles if _room_of(view, r) == view["room"]]
    if here:
        return here[0]
    return min(receptacles, key=lambda r: len(_room_path(view, _room_of(view, r))), default=None)


def _toward(view: dict[str, Any], receptacle: str) -> str:
    room = _room_of(view, receptacle)
    return f"go to {receptacle}" if room == view["room"] else f"go to {_room_path(view, room)[0]}"


def _explore(view: dict[str, Any], legal: Sequence[str]) -> str:
    """Search on: open the receptacle here, or go to the next one not searched, or to a new room."""
    at = view["at"]
    if at and f"open {at}" in legal:
        return f"open {at}"
    searched = view["contents"]
    here = [r for r in view["map"][view["room"]]["receptacles"] if r not in searched]
    if here:
        return f"go to {here[0]}"
    unsearched = [r for info in view["map"].values() for r in info["receptacles"] if r not in searched]
    target = _nearest(view, unsearched)
    if target is not None:
        return _toward(view, target)
    frontier = {nxt for info in view["map"].values() for nxt in info["exits"] if nxt not in view["map"]}
    if frontier:
        room = min(sorted(frontier), key=lambda r: len(_room_path(view, r)))
        return f"go to {_room_path(view, room)[0]}"
    return "look"


def _where_is(view: dict[str, Any], kind: str) -> str | None:
    """The nearest searched receptacle that holds an object of ``kind``."""
    return _nearest(view, [r for r, objs in view["contents"].items() if any(kind_of(o) == kind for o in objs)])


def _of_kind(view: dict[str, Any], kind: str) -> str | None:
    """The nearest known receptacle of ``kind``."""
    return _nearest(view, [r for info in view["map"].values() for r in info["receptacles"] if kind_of(r) == kind])


def _act_at(view: dict[str, Any], legal: Sequence[str], place: str | None, prefix: str) -> str:
    """Go to ``place`` (search when unknown), open it if needed, then the move starting with ``prefix``."""
    if place is None:
        return _explore(view, legal)
    if view["at"] != place:
        return _toward(view, place)
    if f"open {place}" in legal:
        return f"open {place}"
    return next((m for m in legal if m.startswith(prefix)), "look")


def expert_move(view: dict[str, Any], legal: Sequence[str]) -> str:
    """The expert's next command (one of ``legal`` when the view is the env's)."""
    task, held = view["task"], view["holding"]
    if held and kind_of(held) != task["object"]:
        return next((m for m in legal if m.startswith(f"put {held} ")), _explore(view, legal))
    if not held:
        source = _where_is(view, task["object"])
        return _act_at(view, legal, source, f"take {task['object']} ")
    if task["family"] == "clean" and view["holding_dirty"]:
        return _act_at(view, legal, _of_kind(view, "sinkbasin"), f"clean {held} ")
    if task["family"] == "heat" and not view["holding_hot"]:
        return _act_at(view, legal, _of_kind(view, "microwave"), f"heat {held} ")
    if task["family"] == "light":
        return _act_at(view, legal, _where_is(view, LAMP), f"use {LAMP} ")
    return _act_at(view, legal, _of_kind(view, task["target"]), f"put {held} ")


class TextWorldExpert(ScriptedPolicy):
    """Searches for what it needs, then carries out the task (see the module docstring)."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        legal = inp.observation.legal_moves
        move = expert_move(view, legal) if view else "look"
        return move if move in legal or not legal else legal[0]


__all__ = ["TextWorldExpert", "expert_move"]
