"""A household text world in the style of ALFWorld (``textworld-v0``): one agent, ``player_0``.

Each episode is a new seeded world (``textworld_gen``): rooms with receptacles (cabinets,
drawers, a fridge, a countertop, a sinkbasin, a microwave...), some closed, with objects in
them, and a task from one of ALFWorld's families: put an X in a Y, put a clean X in a Y
(``clean X with sinkbasin``), put a hot X in a Y (``heat X with microwave``), examine an X with
the desklamp (hold it and ``use`` the lamp). The moves are ALFWorld's commands that are
admissible now: ``go to``, ``open``, ``close``, ``take X from Y``, ``put X in/on Y``, ``clean``,
``heat``, ``use``, ``look``, ``inventory``, ``examine``. The agent sees only where it is: a
closed receptacle's contents stay hidden until it is opened. Every observation holds the task,
the last action's feedback, the place, what is carried and (``memory``) what was seen before,
so that a policy without history can act. Reward: 1 when the task is done (minus an optional
``step_penalty`` per action; plus ``subgoal_reward``, if set, once when the agent first holds the
task's object); the episode is truncated after ``max_steps`` actions.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import numpy as np

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.games.textworld_expert import TextWorldExpert
from polytinker.envs.games.textworld_gen import (
    CLEANABLE,
    CLOSABLE,
    HEATABLE,
    LAMP,
    World,
    WorldSettings,
    article,
    generate,
    kind_of,
    oracle_plan,
    preposition,
    step_limit,
)
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID


class Command(NamedTuple):
    """A decoded move: ``verb`` and up to two names."""

    verb: str
    thing: str = ""
    where: str = ""


def _listing(names: list[str]) -> str:
    items = [article(n) for n in names]
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def admissible(world: World, info_commands: bool = True) -> dict[str, Command]:
    """The commands the agent may give now, canonical text to command, in a stable order;
    ``info_commands``: also look, inventory and examine."""
    moves = {f"go to {r}": Command("go", r) for r in world.receptacles[world.room] if r != world.at}
    moves.update({f"go to {room}": Command("walk", room) for room in world.exits(world.room)})
    at, held = world.at, world.holding
    if at:
        reachable = at not in world.closed
        if kind_of(at) in CLOSABLE:
            moves[f"close {at}" if reachable else f"open {at}"] = Command("close" if reachable else "open", at)
        if reachable and not held:
            for obj in world.contents(at):
                if world.takeable(obj):
                    moves[f"take {obj} from {at}"] = Command("take", obj, at)
        if reachable and held:
            moves[f"put {held} {preposition(at)} {at}"] = Command("put", held, at)
        if held and kind_of(at) == "sinkbasin" and kind_of(held) in CLEANABLE:
            moves[f"clean {held} with {at}"] = Command("clean", held, at)
        if held and kind_of(at) == "microwave" and kind_of(held) in HEATABLE:
            moves[f"heat {held} with {at}"] = Command("heat", held, at)
        for lamp in world.contents(at) if reachable else []:
            if kind_of(lamp) == LAMP and lamp not in world.lit:
                moves[f"use {lamp}"] = Command("use", lamp)
    if not info_commands:
        return moves
    moves["look"], moves["inventory"] = Command("look"), Command("inventory")
    if at:
        moves[f"examine {at}"] = Command("examine", at)
    if held:
        moves[f"examine {held}"] = Command("examine", held)
    return moves


def contents_text(world: World, receptacle: str) -> str:
    if receptacle in world.closed:
        return f"The {receptacle} is closed."
    where = "On" if preposition(receptacle) == "on" else "In"
    return f"{where} the {receptacle}, you see {_listing(world.contents(receptacle))}."


def _surroundings(world: World) -> str:
    text = f"Around you: {_listing(world.receptacles[world.room])}."
    exits = world.exits(world.room)
    return f"{text} Doors lead to the {' and the '.join(exits)}." if exits else text


def _look_around(world: World) -> str:
    return f"You are in the {world.room}. {_surroundings(world)}"


def _reveal(world: World, receptacle: str) -> None:
    if receptacle not in world.closed:
        world.searched.add(receptacle)


def execute(world: World, cmd: Command) -> str:
    """Carry out an admissible command; the feedback the agent reads."""
    verb, thing, where = cmd
    if verb == "go":
        world.at = thing
        _reveal(world, thing)
        return f"You arrive at {thing}."
    if verb == "walk":
        world.room, world.at = thing, ""
        world.visited.add(thing)
        return f"You walk into the {thing}."
    if verb in ("open", "close"):
        (world.closed.discard if verb == "open" else world.closed.add)(thing)
        _reveal(world, thing)
        return f"You {verb} the {thing}."
    if verb == "take":
        world.location[thing], world.holding = "", thing
        return f"You pick up the {thing} from the {where}."
    if verb == "put":
        world.location[thing], world.holding = where, ""
        return f"You put the {thing} {preposition(where)} the {where}."
    if verb == "clean":
        world.dirty.discard(thing)
        return f"You clean the {thing} using the {where}."
    if verb == "heat":
        world.hot.add(thing)
        return f"You heat the {thing} using the {where}."
    if verb == "use":
        world.lit.add(thing)
        return f"You turn on the {thing}."
    if verb == "look":
        return _look_around(world)
    if verb == "inventory":
        return f"You are carrying: {_carried(world)}."
    return _examine(world, thing)


def _examine(world: World, thing: str) -> str:
    if thing != world.holding:
        _reveal(world, thing)
        return contents_text(world, thing)
    states = [s for s, on in (("dirty", thing in world.dirty), ("hot", thing in world.hot)) if on]
    return f"The {thing} is {' and '.join(states)}." if states else f"There's nothing special about the {thing}."


def _carried(world: World) -> str:
    """What the agent holds; with its state where the task asks for one (examine tells it always)."""
    held = world.holding
    if not held:
        return "nothing"
    family = world.task.family
    if family == "clean" and held in world.dirty:
        return f"{article(held)} (dirty)"
    if family == "heat" and held in world.hot:
        return f"{article(held)} (hot)"
    return article(held)


def _memory(world: World) -> str:
    seen = [
        f"{obj} {preposition(r)} {r}"
        for obj, r in sorted(world.location.items())
        if r in world.searched and r != world.at
    ]
    unsearched = [r for room in world.rooms if room in world.visited for r in world.receptacles[room]]
    unsearched = [r for r in unsearched if r not in world.searched]
    unvisited = [room for room in world.rooms if room not in world.visited]
    parts = [
        f"Seen elsewhere: {', '.join(seen)}." if seen else "",
        f"Not searched yet: {', '.join(unsearched)}." if unsearched else "",
        f"Rooms not visited: {', '.join(unvisited)}." if unvisited else "",
    ]
    return " ".join(p for p in parts if p)


def describe(world: World, feedback: str, memory: bool) -> str:
    """The observation text: task, feedback, place, what is carried, what is remembered."""
    place = (
        f"You are at {world.at} in the {world.room}. {contents_text(world, world.at)}"
        if world.at
        else f"You are in the middle of the {world.room}. {_surroundings(world)}"
    )
    lines = [f"Your task is to: {world.task.text}", feedback, place, f"You are carrying: {_carried(world)}."]
    if memory:
        lines.append(_memory(world))
    return "\n".join(line for line in lines if line)


class TextWorldEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "textworld_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy, "heuristic": TextWorldExpert}

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        rooms: int = 1,
        receptacles: int = 4,
        distractors: int = 2,
        families: tuple[str, ...] | list[str] | str = ("pick",),
        max_steps: int = 0,
        step_penalty: float = 0.0,
        memory: bool = True,
        info_commands: bool = True,
        subgoal_reward: float = 0.0,
    ) -> None:
        families = (families,) if isinstance(families, str) else tuple(families)
        self.settings = WorldSettings(
            rooms, receptacles, distractors, families, max_steps, step_penalty, memory, info_commands, subgoal_reward
        )
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self._start(generate(np.random.default_rng(0), self.settings))  # a world to show before reset

    def _start(self, world: World) -> None:
        self.world = world
        self.plan = oracle_plan(world)
        self.max_steps = step_limit(world, self.plan, self.settings)
        self.steps = 0
        self.won = False
        self.subgoal_paid = False
        self.feedback = ""
        self._moves = admissible(world, self.settings.info_commands)

    def instructions(self, agent: AgentID) -> str:
        return (
            "You are in a house. Do the task you are given by answering with one of the legal commands, "
            "for example: go to cabinet 1, open cabinet 1, take mug 1 from cabinet 1, put mug 1 in fridge 1, "
            "clean mug 1 with sinkbasin 1, heat mug 1 with microwave 1, use desklamp 1. You can carry one "
            "thing at a time; open a closed receptacle to see and reach inside. Answer with the command only."
        )

    def _new_game(self) -> None:
        self._start(generate(self._rng, self.settings))

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return () if self._is_over() or self._is_truncated() else tuple(self._moves)

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.feedback = execute(self.world, self._moves[move])
        self.steps += 1
        self.won = self.world.achieved()
        self._moves = admissible(self.world, self.settings.info_commands)
        reward = float(self.won) + self._subgoal() - self.settings.step_penalty
        return {agent: reward} if reward else {}

    def _subgoal(self) -> float:
        """``subgoal_reward``, once an episode: when the agent first holds the task's kind of object."""
        held = self.world.holding
        if self.subgoal_paid or not self.settings.subgoal_reward or held.rsplit(" ", 1)[0] != self.world.task.object:
            return 0.0
        self.subgoal_paid = True
        return self.settings.subgoal_reward

    def _is_over(self) -> bool:
        return self.won

    def _is_truncated(self) -> bool:
        return self.steps >= self.max_steps and not self.won

    def _render(self, agent: AgentID) -> str:
        text = describe(self.world, self.feedback, self.settings.memory)
        if self.won:
            return f"{text}\nTask complete!"
        if self._is_truncated():
            return f"{text}\nOut of time: {self.max_steps} actions."
        return text

    def view(self, agent: AgentID) -> dict[str, Any]:
        """What the agent knows: the task, where it is, what it holds, the rooms it has been in
        and the contents of the receptacles it has searched."""
        w = self.world
        known = [room for room in w.rooms if room in w.visited]
        return {
            "task": w.task.as_dict(),
            "room": w.room,
            "at": w.at,
            "holding": w.holding,
            "holding_dirty": w.holding in w.dirty,
            "holding_hot": w.holding in w.hot,
            "map": {room: {"receptacles": list(w.receptacles[room]), "exits": w.exits(room)} for room in known},
            "contents": {r: w.contents(r) for room in known for r in w.receptacles[room] if r in w.searched},
            "steps": self.steps,
            "max_steps": self.max_steps,
        }


__all__ = ["Command", "TextWorldEnv", "admissible", "describe", "execute"]
