"""Household worlds for ``textworld-v0``, in the style of ALFWorld: what is in them and how a
seeded generator builds one whose task can be solved.

- ``WorldSettings``: the difficulty knobs (rooms, receptacles per room, distractors, goal families).
- ``Task``: the goal: its family, the kind of object, the kind of receptacle it must end in.
- ``World``: rooms in a row (each has doors to its neighbours), receptacles, objects and the
  state that actions change (who holds what, what is open, dirty, hot, lit, already searched).
- ``generate(rng, settings)``: a new world; ``oracle_plan(world)``: commands that solve its
  task for a planner that knows where everything is (its length sizes the step limit).

Names follow ALFWorld: a kind and a number ("cabinet 2", "mug 1"); ``kind_of`` reads the kind back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polytinker.errors import ConfigError

FAMILIES = ("pick", "clean", "heat", "light")
# Each room kind: the receptacles it may hold and the objects found in it.
ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kitchen": (
        ("countertop", "cabinet", "drawer", "fridge", "microwave", "sinkbasin", "diningtable", "shelf", "garbagecan"),
        ("mug", "apple", "plate", "knife", "bowl", "cup", "potato", "egg", "tomato", "fork", "spoon", "bread"),
    ),
    "living room": (
        ("sofa", "coffeetable", "sidetable", "shelf", "drawer", "cabinet", "armchair", "tvstand", "garbagecan"),
        ("book", "remotecontrol", "vase", "keychain", "cellphone", "newspaper", "pillow", "creditcard", "statue"),
    ),
    "bathroom": (
        ("countertop", "sinkbasin", "cabinet", "drawer", "towelholder", "bathtubbasin", "toilet", "garbagecan"),
        ("soapbar", "towel", "toiletpaper", "spraybottle", "candle", "cloth", "soapbottle"),
    ),
    "bedroom": (
        ("bed", "desk", "sidetable", "drawer", "shelf", "dresser", "garbagecan", "armchair"),
        ("book", "cellphone", "alarmclock", "pen", "pencil", "laptop", "cd", "pillow", "keychain"),
    ),
}
CLOSABLE = frozenset({"cabinet", "drawer", "fridge", "microwave"})
# Things are put *on* these and *in* every other kind.
SURFACES = frozenset(
    {"countertop", "diningtable", "shelf", "sofa", "coffeetable", "sidetable", "armchair", "tvstand", "towelholder"}
    | {"toilet", "bed", "desk", "dresser"}
)
# Kinds a room may hold twice (cabinet 1 and cabinet 2); the others once.
REPEATABLE = ("cabinet", "drawer")
CLEANABLE = frozenset({"mug", "apple", "plate", "knife", "bowl", "cup", "potato", "tomato", "fork", "spoon", "cloth"})
CLEANABLE |= {"soapbar"}
HEATABLE = frozenset({"mug", "apple", "plate", "bowl", "cup", "potato", "egg", "tomato", "bread"})
LIGHTABLE = frozenset(ROOMS["living room"][1] + ROOMS["bedroom"][1])
LAMP = "desklamp"
# What each family needs: the appliance kind (the lamp for "light") and the rooms that have one.
APPLIANCE = {"clean": "sinkbasin", "heat": "microwave", "light": LAMP}
_HOME_ROOMS = {"pick": tuple(ROOMS), "clean": ("kitchen", "bathroom"), "heat": ("kitchen",)}
_HOME_ROOMS["light"] = ("living room", "bedroom")
_LAMP_HOLDER = {"living room": "sidetable", "bedroom": "desk"}
_ELIGIBLE = {"pick": None, "clean": CLEANABLE, "heat": HEATABLE, "light": LIGHTABLE}
# Kinds that make a silly or trivial target ("put a clean mug in the sinkbasin").
_NOT_TARGETS = {"pick": frozenset(), "clean": frozenset({"sinkbasin", "garbagecan"})}
_NOT_TARGETS["heat"] = frozenset({"microwave", "garbagecan"})


def kind_of(name: str) -> str:
    """``"cabinet 2"`` -> ``"cabinet"``."""
    return name.rsplit(" ", 1)[0]


def article(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def preposition(receptacle: str) -> str:
    return "on" if kind_of(receptacle) in SURFACES else "in"


@dataclass(frozen=True)
class WorldSettings:
    """How big and how hard the generated worlds are. The defaults are the easy setting: one
    room, four receptacles, two distractors, "put an X in/on a Y" (four to six steps)."""

    rooms: int = 1
    # Rooms in a row, 1 to 4 (kitchen, living room, bathroom, bedroom); each has doors to its neighbours.
    receptacles: int = 4
    # Receptacles per room, 3 to 8 (the legal moves include a "go to" for each other one).
    distractors: int = 2
    # Objects per room besides the one the task needs, 0 to 6.
    families: tuple[str, ...] = ("pick",)
    # Goal families to draw from: "pick" (put an X in a Y), "clean" (put a clean X in a Y),
    # "heat" (put a hot X in a Y), "light" (examine the X with the desklamp).
    max_steps: int = 0
    # Actions before the episode is truncated; 0: three times the oracle plan's length, and at
    # least what a searcher needs (the plan, plus going to and opening every receptacle once,
    # plus walking through every room twice).
    step_penalty: float = 0.0
    # Reward taken off each action (0 to 0.1): a reason to be quick besides the step limit.
    memory: bool = True
    # Observations also list what the agent has seen elsewhere and what it has not searched yet,
    # so that an agent without history can act; False: only what is in view (as in ALFWorld).
    info_commands: bool = True
    # Also admit ALFWorld's commands that change nothing (look, inventory, examine); False leaves
    # a small model fewer useless moves to try.
    subgoal_reward: float = 0.0
    # Reward (0 to 0.5) the first time the agent holds an object of the task's kind: a denser
    # signal for a small model to learn from (ALFWorld itself gives none; 0 keeps it sparse).

    def __post_init__(self) -> None:
        families = (self.families,) if isinstance(self.families, str) else tuple(self.families)
        object.__setattr__(self, "families", families)
        if not 1 <= self.rooms <= len(ROOMS):
            raise ConfigError(f"textworld: rooms must be 1 to {len(ROOMS)}, got {self.rooms}")
        if not 3 <= self.receptacles <= 8:
            raise ConfigError(f"textworld: receptacles (per room) must be 3 to 8, got {self.receptacles}")
        if not 0 <= self.distractors <= 6:
            raise ConfigError(f"textworld: distractors (per room) must be 0 to 6, got {self.distractors}")
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            raise ConfigError(f"textworld: families must be a non-empty list of {list(FAMILIES)}, got {list(families)}")
        if self.max_steps < 0:
            raise ConfigError(f"textworld: max_steps must be >= 1 (or 0: the default limit), got {self.max_steps}")
        if not 0 <= self.subgoal_reward <= 0.5:
            raise ConfigError(f"textworld: subgoal_reward must be 0 to 0.5, got {self.subgoal_reward}")
        if not 0 <= self.step_penalty <= 0.1:
            raise ConfigError(
                f"textworld: step_penalty must be 0 to 0.1 (reward off each action), got {self.step_penalty}"
            )


@dataclass(frozen=True)
class Task:
    family: str
    object: str  # the object kind ("mug")
    target: str = ""  # the receptacle kind it must end in ("cabinet"); "" for "light"

    @property
    def text(self) -> str:
        if self.family == "light":
            return f"examine the {self.object} with the {LAMP}."
        adjective = {"clean": "clean ", "heat": "hot "}.get(self.family, "")
        where = "on" if self.target in SURFACES else "in"
        return f"put {article(adjective + self.object)} {where} {article(self.target)}."

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "object": self.object, "target": self.target, "text": self.text}


@dataclass
class World:
    task: Task
    rooms: list[str]  # in a row: room i has doors to rooms i - 1 and i + 1
    receptacles: dict[str, list[str]]  # room -> its receptacles, sorted
    location: dict[str, str]  # object -> the receptacle it is in or on ("" while carried)
    closed: set[str]
    dirty: set[str]
    room: str  # where the agent is
    at: str = ""  # the receptacle it stands at ("": the middle of the room)
    holding: str = ""
    hot: set[str] = field(default_factory=set)
    lit: set[str] = field(default_factory=set)  # lamps switched on
    searched: set[str] = field(default_factory=set)  # receptacles whose contents the agent has seen
    visited: set[str] = field(default_factory=set)  # rooms the agent has been in

    def room_of(self, receptacle: str) -> str:
        return next(r for r, names in self.receptacles.items() if receptacle in names)

    def exits(self, room: str) -> list[str]:
        i = self.rooms.index(room)
        return [self.rooms[j] for j in (i - 1, i + 1) if 0 <= j < len(self.rooms)]

    def contents(self, receptacle: str) -> list[str]:
        return sorted(o for o, r in self.location.items() if r == receptacle)

    def takeable(self, obj: str) -> bool:
        return kind_of(obj) != LAMP

    def achieved(self) -> bool:
        task = self.task
        if task.family == "light":
            held = self.holding and kind_of(self.holding) == task.object
            return bool(held) and any(self.location.get(lamp) == self.at for lamp in self.lit)
        for obj, where in self.location.items():
            if kind_of(obj) != task.object or not where or kind_of(where) != task.target:
                continue
            if (task.family != "clean" or obj not in self.dirty) and (task.family != "heat" or obj in self.hot):
                return True
        return False


def _pick(rng: np.random.Generator, options: list[str] | tuple[str, ...]) -> str:
    return str(options[int(rng.integers(len(options)))])


def _room_kinds(rng: np.random.Generator, family: str, n: int) -> list[str]:
    home = _pick(rng, _HOME_ROOMS[family])
    others = [r for r in ROOMS if r != home]
    rng.shuffle(others)
    rooms = [home, *others[: n - 1]]
    rng.shuffle(rooms)
    return rooms


def _receptacle_kinds(rng: np.random.Generator, room: str, n: int, forced: list[str]) -> list[str]:
    pool = [k for k in ROOMS[room][0] + REPEATABLE if k in ROOMS[room][0]]
    for kind in forced:
        pool.remove(kind)
    rng.shuffle(pool)
    return forced + pool[: n - len(forced)]


def _layout(rng: np.random.Generator, settings: WorldSettings, family: str) -> dict[str, list[str]]:
    rooms = _room_kinds(rng, family, settings.rooms)
    numbers: dict[str, itertools.count[int]] = {}
    layout = {}
    for room in rooms:
        forced = []
        if family in ("clean", "heat") and APPLIANCE[family] in ROOMS[room][0]:
            forced.append(APPLIANCE[family])
        if family == "light" and room in _LAMP_HOLDER:
            forced.append(_LAMP_HOLDER[room])
        kinds = _receptacle_kinds(rng, room, settings.receptacles, forced)
        names = [f"{k} {next(numbers.setdefault(k, itertools.count(1)))}" for k in kinds]
        layout[room] = sorted(names, key=lambda s: (kind_of(s), int(s.rsplit(" ", 1)[1])))
    return layout


def _goal(rng: np.random.Generator, family: str, layout: dict[str, list[str]]) -> tuple[Task, str]:
    """The task and the receptacle its object starts in."""
    eligible = _ELIGIBLE[family]
    pairs = [(room, o) for room in layout for o in ROOMS[room][1] if eligible is None or o in eligible]
    room, obj = pairs[int(rng.integers(len(pairs)))]
    kinds = sorted({kind_of(r) for names in layout.values() for r in names})
    if family == "light":
        holders = [r for names in layout.values() for r in names if kind_of(r) in _LAMP_HOLDER.values()]
        sources = [r for r in layout[room] if r not in holders]
        return Task(family, obj), _pick(rng, sources)
    targets = [k for k in kinds if k not in _NOT_TARGETS[family]]
    target = _pick(rng, targets)
    sources = [r for r in layout[room] if kind_of(r) != target]
    if not sources:  # every receptacle of this room is of the target's kind: take another target
        target = _pick(rng, [k for k in targets if k != target])
        sources = [r for r in layout[room] if kind_of(r) != target]
    return Task(family, obj, target), _pick(rng, sources)


def generate(rng: np.random.Generator, settings: WorldSettings) -> World:
    """A new world drawn from ``rng``; its task is always solvable (``oracle_plan`` solves it)."""
    family = _pick(rng, settings.families)
    layout = _layout(rng, settings, family)
    task, source = _goal(rng, family, layout)
    numbers: dict[str, itertools.count[int]] = {}

    def name(kind: str) -> str:
        return f"{kind} {next(numbers.setdefault(kind, itertools.count(1)))}"

    location = {name(task.object): source}
    if family == "light":
        holder = next(r for names in layout.values() for r in names if kind_of(r) in _LAMP_HOLDER.values())
        location[name(LAMP)] = holder
    for room, receptacles in layout.items():
        kinds = [o for o in ROOMS[room][1] if o != task.object]
        rng.shuffle(kinds)
        for kind in kinds[: settings.distractors]:
            location[name(kind)] = _pick(rng, receptacles)
    dirty = {o for o in location if kind_of(o) in CLEANABLE and rng.random() < 0.5}
    if family == "clean":
        dirty |= {o for o in location if kind_of(o) == task.object}
    closed = {r for names in layout.values() for r in names if kind_of(r) in CLOSABLE}
    start = _pick(rng, list(layout))
    return World(task, list(layout), layout, location, closed, dirty, room=start, visited={start})


def step_limit(world: World, plan: list[str], settings: WorldSettings) -> int:
    """``settings.max_steps``, or the default: see ``WorldSettings.max_steps``. It depends on the
    layout only, never on where the things are hidden."""
    if settings.max_steps:
        return settings.max_steps
    receptacles = sum(len(names) for names in world.receptacles.values())
    return max(3 * len(plan), len(plan) + 2 * receptacles + 2 * (len(world.rooms) - 1))


def _route(world: World, room: str, at: str, to: str) -> list[str]:
    """The moves from (room, at) to the receptacle ``to``: through the rooms between, then to it."""
    if at == to:
        return []
    i, j = world.rooms.index(room), world.rooms.index(world.room_of(to))
    step = 1 if j > i else -1
    return [f"go to {world.rooms[k]}" for k in range(i + step, j + step, step)] + [f"go to {to}"]


def _leg(world: World, room: str, at: str, to: str, closed: set[str]) -> list[str]:
    moves = _route(world, room, at, to)
    return [*moves, f"open {to}"] if to in closed else moves


def oracle_plan(world: World) -> list[str]:
    """The shortest command list that solves the task, knowing where everything is."""
    task = world.task
    obj = next(o for o in sorted(world.location) if kind_of(o) == task.object)
    source = world.location[obj]
    everything = [r for names in world.receptacles.values() for r in names]
    if task.family == "light":
        lamp = next(o for o in world.location if kind_of(o) == LAMP)
        middles = [[world.location[lamp]]]
        finals: list[str] = [""]
    else:
        appliance = APPLIANCE.get(task.family)
        middles = [[r] for r in everything if kind_of(r) == appliance] or [[]]
        finals = [r for r in everything if kind_of(r) == task.target]
    best: list[str] | None = None
    for middle, final in itertools.product(middles, finals):
        closed = set(world.closed)
        plan = [*_leg(world, world.room, world.at, source, closed), f"take {obj} from {source}"]
        closed.discard(source)
        here = source
        for stop in middle:
            plan += _route(world, world.room_of(here), here, stop)
            plan.append(f"use {lamp}" if task.family == "light" else f"{task.family} {obj} with {stop}")
            here = stop
        if final:
            plan += _leg(world, world.room_of(here), here, final, closed)
            plan.append(f"put {obj} {preposition(final)} {final}")
        if best is None or len(plan) < len(best):
            best = plan
    assert best is not None  # a target or an appliance always exists
    return best


__all__ = [
    "APPLIANCE",
    "FAMILIES",
    "LAMP",
    "ROOMS",
    "Task",
    "World",
    "WorldSettings",
    "article",
    "generate",
    "kind_of",
    "oracle_plan",
    "preposition",
    "step_limit",
]
