"""Policy mapping: which agent (or scripted opponent) plays each env role in each episode.

One pure function of the episode's seed, ``PolicyMapping.assign(seed) -> {role: Slot}``, so that
every episode of a GRPO group (same seed) faces the same opponents:

- ``independent``: each role has its own agent (its own adapter); ``roles`` may pin a role to a
  frozen agent or to a scripted opponent (``"scripted:random"``, ``"scripted:heuristic"``).
- ``self_play``: one agent plays every role (its prompt names the role); both sides learn.
- ``league``: one agent plays one role (alternating with the seed) against opponents drawn from
  its past versions, in a pool that the loop fills every ``pool_every`` steps (the newest
  ``pool_size`` kept), and the frozen agents (``trainable = false``) no role is pinned to.
- ``round_robin``: many agents of a two-player game in pairs. Step ``k`` plays round ``k`` of the
  circle method (every agent meets every other once in ``n - 1`` steps; with an odd number one
  sits out each round), group ``g`` of the step plays the round's pair ``g`` (modulo the pairs):
  ``train.groups`` = agents / 2 trains every agent every step. Seats alternate with the seed.
  ``assign`` takes the step and the group index here; the other kinds read the seed alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from polytinker.agents.spec import AgentSpec
from polytinker.agents.types import MappingKind, Slot, SlotKind
from polytinker.errors import ConfigError

SCRIPTED_PREFIX = "scripted:"
TEAM = "team"  # the evaluation "opponent" that is the experiment's own agents (PolicyMapping.team)


@dataclass(frozen=True)
class MappingConfig:
    kind: MappingKind = MappingKind.INDEPENDENT
    # "independent", "self_play", "league" or "round_robin".
    roles: dict[str, str] = field(default_factory=dict)
    # Env role -> agent name or "scripted:random" / "scripted:heuristic". Independent mapping
    # fills the roles not named here with the agents in order.
    pool_size: int = 4
    # league: past versions kept in the opponent pool.
    pool_every: int = 2
    # league: the learner's version joins the pool every this many steps.
    swap_roles: bool = True
    # self_play, league and round_robin: the role alternates with the seed (both seats get practice).

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", MappingKind(self.kind))
        except ValueError:
            raise ConfigError(f"mapping.kind {self.kind!r}: choose one of {[k.value for k in MappingKind]}") from None
        if self.pool_size < 1 or self.pool_every < 1:
            raise ConfigError("mapping: pool_size and pool_every must be >= 1")
        object.__setattr__(self, "roles", dict(self.roles))


def _fixed_slot(value: str, specs: dict[str, AgentSpec], role: str) -> Slot:
    if value.startswith(SCRIPTED_PREFIX):
        return Slot(SlotKind.SCRIPTED, value.removeprefix(SCRIPTED_PREFIX))
    spec = specs.get(value)
    if spec is None:
        raise ConfigError(f"mapping.roles[{role!r}] = {value!r}: no such agent; agents: {sorted(specs)}")
    return Slot(SlotKind.LEARNER if spec.trainable else SlotKind.FROZEN, value)


class PolicyMapping:
    """Assigns slots to an env's roles, per episode seed; keeps the league's opponent pool."""

    def __init__(self, config: MappingConfig, roles: Sequence[str], agents: Sequence[AgentSpec]) -> None:
        self.config = config
        self.env_roles = list(roles)
        self.specs = {a.name: a for a in agents}
        unknown = sorted(set(config.roles) - set(self.env_roles))
        if unknown:
            raise ConfigError(f"mapping.roles names {unknown}, not roles of the env; its roles: {self.env_roles}")
        self.fixed = {r: _fixed_slot(v, self.specs, r) for r, v in config.roles.items()}
        self.pool: dict[str, list[int]] = {}
        if config.kind is MappingKind.INDEPENDENT:
            free = [a.name for a in agents if a.name not in config.roles.values()]
            for role in self.env_roles:
                if role not in self.fixed:
                    if not free:
                        raise ConfigError(
                            f"independent mapping: no agent left for role {role!r}; add an agent or set "
                            f"mapping.roles.{role} = 'scripted:random'"
                        )
                    self.fixed[role] = _fixed_slot(free.pop(0), self.specs, role)
            self.learner = ""
        elif config.kind is MappingKind.ROUND_ROBIN:
            self.learner = ""
        else:
            trainable = [a.name for a in agents if a.trainable]
            if len(trainable) != 1:
                raise ConfigError(f"{config.kind} mapping trains exactly one agent; trainable agents: {trainable}")
            self.learner = trainable[0]
        self.open_roles = [r for r in self.env_roles if r not in self.fixed]
        pinned = set(config.roles.values())
        # round_robin: the agents no role is pinned to, paired anew each step.
        self.rotation = [a.name for a in agents if a.name not in pinned]
        if config.kind is MappingKind.ROUND_ROBIN and (len(self.open_roles) != 2 or len(self.rotation) < 2):
            raise ConfigError(
                f"round_robin mapping pairs agents in two roles: the env leaves {self.open_roles} open and "
                f"{self.rotation} are free to play; pin the other roles with mapping.roles, or add agents"
            )

    def assign(self, seed: int, *, step: int = 0, group: int = 0) -> dict[str, Slot]:
        """The slots of one episode (the same for every episode with this seed); ``step`` and
        ``group`` (the seed's index among the step's groups) pick a round robin's pair."""
        slots = dict(self.fixed)
        if self.config.kind is MappingKind.ROUND_ROBIN:
            pairs = round_robin_pairs(self.rotation, step)
            pair = pairs[group % len(pairs)]
            first, second = reversed(pair) if self.config.swap_roles and seed % 2 else pair
            for role, name in zip(self.open_roles, (first, second), strict=True):
                slots[role] = Slot(SlotKind.LEARNER if self.specs[name].trainable else SlotKind.FROZEN, name)
        elif self.config.kind is MappingKind.SELF_PLAY:
            slots.update({r: Slot(SlotKind.LEARNER, self.learner) for r in self.open_roles})
        elif self.config.kind is MappingKind.LEAGUE and self.open_roles:
            mine = self.open_roles[seed % len(self.open_roles)] if self.config.swap_roles else self.open_roles[0]
            rng = np.random.default_rng(seed)
            opponents = self.league_opponents()
            for role in self.open_roles:
                if role == mine or not opponents:
                    slots[role] = Slot(SlotKind.LEARNER, self.learner)
                else:
                    slots[role] = opponents[int(rng.choice(len(opponents)))]
        return slots

    def league_opponents(self) -> list[Slot]:
        """A league's opponents: the learner's past versions in the pool, then the frozen agents
        that no role is pinned to (with neither, the learner plays itself)."""
        pinned = {s.name for s in self.fixed.values()}
        frozen = [n for n, spec in self.specs.items() if not spec.trainable and n not in pinned]
        past = [Slot(SlotKind.PAST, self.learner, v) for v in self.pool.get(self.learner, [])]
        return past + [Slot(SlotKind.FROZEN, n) for n in frozen]

    def add_to_pool(self, agent: str, version: int) -> list[int]:
        """Put a version in the agent's pool; returns the versions dropped (beyond ``pool_size``)."""
        pool = self.pool.setdefault(agent, [])
        if version not in pool:
            pool.append(version)
        dropped = pool[: -self.config.pool_size]
        del pool[: -self.config.pool_size]
        return dropped

    def trained_roles(self, agent: str) -> list[str]:
        """The roles an agent plays while it trains (it is evaluated in each)."""
        if self.config.kind is not MappingKind.INDEPENDENT and agent == self.learner:
            return list(self.open_roles)
        if self.config.kind is MappingKind.ROUND_ROBIN and agent in self.rotation and self.specs[agent].trainable:
            return list(self.open_roles)
        return [r for r, s in self.fixed.items() if s.kind is SlotKind.LEARNER and s.name == agent]

    def team(self) -> dict[str, Slot]:
        """Every role as training fills it, with the current version in each learner role (a
        league's past versions left out): the evaluation of the agents together. A round robin's
        team is its first pairing's first pair (one episode holds two of its agents)."""
        if self.config.kind is MappingKind.ROUND_ROBIN:
            return self.assign(0)
        slots = dict(self.fixed)
        slots.update({r: Slot(SlotKind.LEARNER, self.learner) for r in self.open_roles})
        return slots

    def evaluation(self, agent: str, role: str, opponent: str) -> dict[str, Slot]:
        """The agent in ``role``, the scripted ``opponent`` kind in every other role."""
        scripted = Slot(SlotKind.SCRIPTED, opponent)
        return {r: Slot(SlotKind.LEARNER, agent) if r == role else scripted for r in self.env_roles}


def round_robin_pairs(names: Sequence[str], round_index: int) -> list[tuple[str, str]]:
    """Round ``round_index`` (modulo ``n - 1``) of the circle method over ``names``: the first
    stays, the others turn one place a round, position ``i`` meets position ``n - 1 - i``; every
    pair meets once in ``n - 1`` rounds. With an odd number, the one drawn against the empty
    seat sits the round out."""
    seats = [*names, ""] if len(names) % 2 else list(names)
    n = len(seats)
    turn = round_index % (n - 1)
    rest = seats[1:]
    circle = [seats[0], *rest[len(rest) - turn :], *rest[: len(rest) - turn]]
    pairs = [(circle[i], circle[n - 1 - i]) for i in range(n // 2)]
    return [(a, b) for a, b in pairs if a and b]


__all__ = ["SCRIPTED_PREFIX", "TEAM", "MappingConfig", "PolicyMapping", "round_robin_pairs"]
