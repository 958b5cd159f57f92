"""Adapter placement on engines and learner time-slicing choices: pure decisions, no I/O.

``AdapterPlacement`` tracks which LoRA adapters each engine holds and answers where to put or find
one: only engines of the adapter's base model; a free slot first, spreading load; otherwise the
least recently used adapter that nothing pins is evicted; a pinned adapter (by a running job or by
a person) is never evicted. ``route`` sends one sample request to an engine holding the adapter,
and adds a replica when the adapter is hot.

``next_learner_job`` picks which resident job a shared learner group trains next at a step boundary.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from polytinker.errors import ConfigError
from polytinker.scheduler.types import AdapterID, BaseModelID, EngineSpec, JobID, ResourceID


@dataclass(frozen=True)
class AdapterLoad:
    """Where an adapter goes or is served from, and what that costs."""

    engine: ResourceID
    adapter: AdapterID
    load: bool  # not resident there yet: the engine must load it
    evicted: AdapterID | None  # the adapter removed to make room, if any
    reason: str


class _Engine:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.resident: OrderedDict[AdapterID, float] = OrderedDict()  # LRU first; value: last use time
        self.pins: Counter[AdapterID] = Counter()  # running jobs using each adapter here


class AdapterPlacement:
    """Adapter slots of all engines. ``hot_requests_per_s`` is the request rate one replica absorbs
    before ``route`` adds another (up to ``max_replicas``); rates decay with ``half_life_s``."""

    def __init__(
        self,
        engines: Iterable[EngineSpec],
        *,
        hot_requests_per_s: float = 50.0,
        max_replicas: int = 4,
        half_life_s: float = 30.0,
    ) -> None:
        if hot_requests_per_s <= 0 or max_replicas < 1 or half_life_s <= 0:
            raise ConfigError("AdapterPlacement: hot_requests_per_s > 0, max_replicas >= 1, half_life_s > 0")
        self._engines: dict[ResourceID, _Engine] = {}
        self._by_base: dict[BaseModelID, list[ResourceID]] = {}
        for spec in engines:
            self.add_engine(spec)
        self._where: dict[AdapterID, set[ResourceID]] = {}
        self._user_pinned: set[AdapterID] = set()
        self._rate: dict[AdapterID, tuple[float, float]] = {}  # adapter -> (rate at time, time)
        self._engine_rate: dict[ResourceID, tuple[float, float]] = {}  # engine -> (rate at time, time)
        self._hot = hot_requests_per_s
        self._max_replicas = max_replicas
        self._decay_per_s = math.log(2) / half_life_s
        # Which engines are there now (registered and alive; ClusterState.present): routing
        # prefers them, and uses the others only when none of them will do.
        self.present: Callable[[ResourceID], bool] = lambda _: True

    def add_engine(self, spec: EngineSpec) -> None:
        """One more engine, empty (one that joined at run time; ``ClusterState.add_engine``)."""
        if spec.engine_id in self._engines:
            raise ConfigError(f"engine {spec.engine_id!r} is already placed on")
        self._engines[spec.engine_id] = _Engine(spec)
        self._by_base.setdefault(spec.base_model, []).append(spec.engine_id)

    def remove_engine(self, engine_id: ResourceID) -> None:
        """An engine gone for good (one that joined and left): its adapters are resident nowhere
        else on its account; routing places them on the engines that are left."""
        e = self._engines.pop(engine_id)
        self._by_base[e.spec.base_model].remove(engine_id)
        for adapter in e.resident:
            holders = self._where.get(adapter, set())
            holders.discard(engine_id)
            if not holders:
                self._where.pop(adapter, None)
        self._engine_rate.pop(engine_id, None)

    # --- queries ---------------------------------------------------------------------------------
    def engines_of(self, base_model: BaseModelID) -> list[ResourceID]:
        return list(self._by_base.get(base_model, ()))

    def resident(self, engine_id: ResourceID) -> list[AdapterID]:
        """Adapters held by the engine, least recently used first."""
        return list(self._engines[engine_id].resident)

    def holders(self, adapter: AdapterID) -> set[ResourceID]:
        return set(self._where.get(adapter, ()))

    def is_user_pinned(self, adapter: AdapterID | None) -> bool:
        """Pinned by ``pin`` (not merely by a running job)."""
        return adapter in self._user_pinned

    def is_pinned(self, adapter: AdapterID, engine_id: ResourceID) -> bool:
        return adapter in self._user_pinned or self._engines[engine_id].pins[adapter] > 0

    def can_host(self, engine_id: ResourceID, adapter: AdapterID) -> bool:
        """Resident already, a free slot, or an unpinned adapter to evict."""
        e = self._engines[engine_id]
        if adapter in e.resident or len(e.resident) < e.spec.adapter_slots:
            return True
        return self._lru_victim(e) is not None

    def rate(self, adapter: AdapterID, now_s: float) -> float:
        """Recent requests per second for ``adapter`` (exponentially decayed)."""
        return self._decayed(self._rate, adapter, now_s)

    def engine_load(self, engine_id: ResourceID, now_s: float) -> float:
        """Recent requests per second routed to the engine, plus one per running job pinning an adapter there."""
        return self._decayed(self._engine_rate, engine_id, now_s) + sum(self._engines[engine_id].pins.values())

    # --- changes ---------------------------------------------------------------------------------
    def pin(self, adapter: AdapterID) -> None:
        """Keep every resident copy of the adapter: it is never evicted until ``unpin``."""
        self._user_pinned.add(adapter)

    def unpin(self, adapter: AdapterID) -> None:
        self._user_pinned.discard(adapter)

    def acquire(self, engine_id: ResourceID, adapter: AdapterID, now_s: float) -> AdapterLoad:
        """A job starts using the adapter on this engine: load it if needed and pin it while in use."""
        e = self._engines[engine_id]
        placed = self._load(e, adapter, now_s)
        e.pins[adapter] += 1
        return placed

    def release(self, engine_id: ResourceID, adapter: AdapterID, now_s: float) -> None:
        """The job is done with it: unpin; the adapter stays resident (warm) until evicted."""
        e = self._engines[engine_id]
        if e.pins[adapter] <= 0:
            raise ConfigError(f"release of {adapter} on {engine_id}, which no job holds")
        e.pins[adapter] -= 1
        if not e.pins[adapter]:
            del e.pins[adapter]  # keep the counter to adapters in use
        if adapter in e.resident:
            e.resident[adapter] = now_s
            e.resident.move_to_end(adapter)

    def choose_engine(
        self,
        adapter: AdapterID | None,
        base_model: BaseModelID,
        candidates: Iterable[ResourceID],
        now_s: float,
        jobs_on: Callable[[ResourceID], int] | None = None,
    ) -> ResourceID | None:
        """Best engine among ``candidates`` (already of the right base model and with room) for a job:
        one holding the adapter (no load), else one with a free slot (no eviction), else one that can
        evict; among equals the one with the fewest jobs (``jobs_on``, if given: jobs without an adapter
        pin nothing but still share the engine), then the least loaded."""
        usable = [c for c in candidates if adapter is None or self.can_host(c, adapter)]
        if not usable:
            return None

        def key(c: ResourceID) -> tuple[bool, bool, int, float, str]:
            e = self._engines[c]
            warm = adapter is not None and adapter in e.resident
            evicts = adapter is not None and not warm and len(e.resident) >= e.spec.adapter_slots
            return (not warm, evicts, jobs_on(c) if jobs_on else 0, self.engine_load(c, now_s), c)

        return min(usable, key=key)

    def route(self, adapter: AdapterID, base_model: BaseModelID, now_s: float) -> AdapterLoad | None:
        """Engine for one sample request with ``adapter``; ``None`` when no engine of the base model can
        host it (all slots pinned). A hot adapter gets one more replica on the least loaded engine."""
        self._count(self._rate, adapter, now_s)
        placed = self._route(adapter, base_model, now_s)
        if placed is not None:
            self._count(self._engine_rate, placed.engine, now_s)
        return placed

    def present_first(self, engine_ids: list[ResourceID]) -> list[ResourceID]:
        """The engines of ``engine_ids`` that are there now, or all of them when none is."""
        return self._there(engine_ids) or engine_ids

    def _there(self, engine_ids: list[ResourceID]) -> list[ResourceID]:
        return [e for e in engine_ids if self.present(e)]

    def _route(self, adapter: AdapterID, base_model: BaseModelID, now_s: float) -> AdapterLoad | None:
        held = sorted(self._where.get(adapter, ()))
        holders = self._there(held)
        if held and not holders:  # every holder is gone for now: load it where an engine is there
            target = self.choose_engine(adapter, base_model, self._there(self.engines_of(base_model)), now_s)
            if target is not None:
                placed = self._load(self._engines[target], adapter, now_s)
                return AdapterLoad(target, adapter, True, placed.evicted, "its holders are gone: loaded on one there")
            holders = held  # nowhere else: wait for a holder to come back
        if holders:
            best = min(holders, key=lambda c: (self.engine_load(c, now_s), c))
            per_replica = self.rate(adapter, now_s) / len(holders)
            if per_replica > self._hot and len(holders) < self._max_replicas:
                others = [
                    c
                    for c in self.engines_of(base_model)
                    if c not in holders and self.present(c) and self.can_host(c, adapter)
                ]
                target = self.choose_engine(adapter, base_model, others, now_s)
                if target is not None:
                    placed = self._load(self._engines[target], adapter, now_s)
                    return AdapterLoad(target, adapter, True, placed.evicted, "hot adapter: added a replica")
            e = self._engines[best]
            e.resident[adapter] = now_s
            e.resident.move_to_end(adapter)
            return AdapterLoad(best, adapter, False, None, "resident: least loaded holder")
        # An engine that is there, else (none there, or none of those can host it) any of the model's.
        engines = self.engines_of(base_model)
        target = self.choose_engine(adapter, base_model, self._there(engines), now_s) or self.choose_engine(
            adapter, base_model, engines, now_s
        )
        if target is None:
            return None
        return self._load(self._engines[target], adapter, now_s)

    # --- internals -------------------------------------------------------------------------------
    def _decayed(self, table: dict[str, tuple[float, float]], key: str, now_s: float) -> float:
        value, t = table.get(key, (0.0, now_s))
        return value * math.exp(-self._decay_per_s * max(0.0, now_s - t))

    def _count(self, table: dict[str, tuple[float, float]], key: str, now_s: float) -> None:
        # An exponentially decayed count of events; times the decay rate it approximates events per second.
        count = self._decayed(table, key, now_s) / self._decay_per_s + 1.0
        table[key] = (count * self._decay_per_s, now_s)

    def _lru_victim(self, e: _Engine) -> AdapterID | None:
        for a in e.resident:  # least recently used first
            if e.pins[a] == 0 and a not in self._user_pinned:
                return a
        return None

    def _load(self, e: _Engine, adapter: AdapterID, now_s: float) -> AdapterLoad:
        eid = e.spec.engine_id
        if adapter in e.resident:
            e.resident[adapter] = now_s
            e.resident.move_to_end(adapter)
            return AdapterLoad(eid, adapter, False, None, "already resident")
        evicted = None
        if len(e.resident) >= e.spec.adapter_slots:
            evicted = self._lru_victim(e)
            if evicted is None:
                raise ConfigError(f"engine {eid}: every adapter slot is pinned; check can_host first")
            del e.resident[evicted]
            self._where[evicted].discard(eid)
            if not self._where[evicted]:
                del self._where[evicted]
        e.resident[adapter] = now_s
        self._where.setdefault(adapter, set()).add(eid)
        why = f"evicted least recently used {evicted}" if evicted else "free slot"
        return AdapterLoad(eid, adapter, True, evicted, why)


def next_learner_job(ready: Iterable[tuple[JobID, int, float]]) -> JobID | None:
    """Which ready job a shared learner group trains next, from (job, priority, last time it trained):
    the highest priority, then the one that waited longest, so co-located jobs take turns step by step."""
    best: tuple[int, float, JobID] | None = None
    for job_id, priority, last_run_s in ready:
        key = (-priority, last_run_s, job_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


__all__ = ["AdapterLoad", "AdapterPlacement", "next_learner_job"]
