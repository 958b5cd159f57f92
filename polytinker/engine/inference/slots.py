"""Adapter slots: which adapter versions an engine knows, which are resident in its backend,
and which may be dropped.

- Every version loaded (from tensors or a peft directory) is *known*: its source stays in host
  memory (tensors) or on disk (a directory), so an evicted version can come back.
- At most ``capacity`` versions are *resident* in the backend. Making a batch's versions resident
  evicts the least recently used others that are not pinned.
- A request holds its version from submission to completion (``acquire``/``release``): loading
  ``a@5`` while requests for ``a@4`` are queued or running leaves ``a@4`` known until the last
  of them finishes; then the stale version is retired (forgotten and unloaded).

Thread model: ``register``/``acquire``/``release``/``pin``/``forget`` may be called from any
thread and never touch the backend; only ``prepare`` (called by the engine's one worker thread
between batches) loads and unloads, so a batch in progress never sees its weights change.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference.base import InferenceBackend
from polytinker.engine.types import AdapterName, AdapterRef
from polytinker.errors import ConfigError

Source = AdapterWeights | Path


class AdapterSlots:
    """Residency policy over a backend: LRU eviction, pinning, versions held by requests."""

    def __init__(self, backend: InferenceBackend, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"AdapterSlots capacity must be positive, got {capacity}")
        self._backend = backend
        self.capacity = capacity
        self._lock = threading.Lock()
        self._sources: dict[AdapterRef, Source] = {}
        self._stale_sources: set[AdapterRef] = set()  # re-registered: the backend copy is out of date
        self._resident: OrderedDict[AdapterRef, None] = OrderedDict()  # least recently used first
        self._pinned: set[AdapterRef] = set()
        self._in_use: Counter[AdapterRef] = Counter()
        self._to_unload: set[AdapterRef] = set()  # forgotten but still resident: unload at next prepare
        self.loads = 0  # backend loads so far (evictions make later loads): for tests and metrics
        self.evictions = 0

    # ----- any thread -----

    def register(self, ref: AdapterRef, source: Source) -> None:
        """Know ``ref`` from tensors or a peft directory. Re-registering a version replaces it;
        older versions of the same name that no request holds and no pin keeps are retired."""
        with self._lock:
            if ref in self._sources:
                self._stale_sources.add(ref)
            self._sources[ref] = source
            self._to_unload.discard(ref)
            for old in [r for r in self._sources if r.name == ref.name and r.version < ref.version]:
                self._retire_if_unused(old)

    def latest(self, name: AdapterName) -> AdapterRef | None:
        with self._lock:
            versions = [r for r in self._sources if r.name == name]
            return max(versions, key=lambda r: r.version) if versions else None

    def known(self) -> list[AdapterRef]:
        with self._lock:
            return sorted(self._sources, key=lambda r: (r.name, r.version))

    def resident(self) -> list[AdapterRef]:
        """Resident versions, least recently used first."""
        with self._lock:
            return list(self._resident)

    def acquire(self, ref: AdapterRef | None) -> None:
        """A request for ``ref`` was submitted; ``None`` (the base model) is always available."""
        if ref is None:
            return
        with self._lock:
            if ref not in self._sources:
                latest = [str(r) for r in self._sources if r.name == ref.name]
                hint = f"; known versions of {ref.name!r}: {latest}" if latest else ""
                raise ConfigError(f"adapter {ref} is not loaded in this engine{hint}; load it first")
            self._in_use[ref] += 1

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        with self._lock:
            self._in_use[ref] -= 1
            if self._in_use[ref] <= 0:
                del self._in_use[ref]
                newest = max(r.version for r in self._sources if r.name == ref.name) if ref in self._sources else -1
                if ref.version < newest:
                    self._retire_if_unused(ref)

    def pin(self, ref: AdapterRef) -> None:
        """Keep ``ref`` resident: never evicted, never retired, until ``unpin``."""
        with self._lock:
            if ref not in self._sources:
                raise ConfigError(f"cannot pin {ref}: it is not loaded")
            if ref not in self._pinned and len(self._pinned) >= self.capacity:
                raise ConfigError(
                    f"cannot pin {ref}: all {self.capacity} slots are pinned; unpin one or raise max_resident_adapters"
                )
            self._pinned.add(ref)

    def unpin(self, ref: AdapterRef) -> None:
        with self._lock:
            self._pinned.discard(ref)

    def forget(self, ref: AdapterRef) -> None:
        """Drop ``ref`` now (requests already holding it fail or finish first: it is unloaded at
        the next batch boundary). Unknown refs raise ``ConfigError``."""
        with self._lock:
            if ref not in self._sources:
                raise ConfigError(f"adapter {ref} is not loaded")
            self._drop(ref)

    def fits(self, refs: set[AdapterRef]) -> bool:
        """Whether one batch can use all of ``refs`` at once alongside the pinned versions."""
        with self._lock:
            return len(self._pinned | refs) <= self.capacity

    # ----- worker thread only -----

    def prepare(self, refs: Iterable[AdapterRef | None], keep: Iterable[AdapterRef | None] = ()) -> None:
        """Make every ref resident (evicting as needed) and bring the backend up to date.
        ``keep``: the versions of batches paused between their steps (the engine runs this batch
        inside theirs): neither evicted nor unloaded, even when forgotten, until they end."""
        needed = {r for r in refs if r is not None}
        kept = {r for r in keep if r is not None}
        with self._lock:
            for ref in list(self._to_unload - kept):
                if ref in self._resident:
                    del self._resident[ref]
                    self._backend.unload_adapter(ref)
                self._to_unload.discard(ref)
            if len(needed | kept | self._pinned) > self.capacity:
                raise ConfigError(f"a batch needs {len(needed)} adapters but only {self.capacity} slots exist")
            for ref in sorted(needed, key=str):
                self._make_resident(ref, protect=needed | kept)

    def _make_resident(self, ref: AdapterRef, protect: set[AdapterRef]) -> None:
        if ref not in self._sources:
            raise ConfigError(f"adapter {ref} was unloaded before its request ran")
        if ref in self._resident and ref not in self._stale_sources:
            self._resident.move_to_end(ref)
            return
        if ref not in self._resident:
            while len(self._resident) >= self.capacity:
                self._evict_one(protect)
        source = self._sources[ref]
        if isinstance(source, AdapterWeights):
            self._backend.load_adapter(source)
        else:
            self._backend.load_adapter_dir(ref, source)
        self._stale_sources.discard(ref)
        self._resident[ref] = None
        self._resident.move_to_end(ref)
        self.loads += 1

    def _evict_one(self, protect: set[AdapterRef]) -> None:
        for victim in self._resident:  # oldest first
            if victim not in self._pinned and victim not in protect:
                del self._resident[victim]
                self._backend.unload_adapter(victim)
                self.evictions += 1
                return
        raise ConfigError("no adapter slot can be freed: every resident adapter is pinned or in this batch")

    # ----- helpers (lock held) -----

    def _retire_if_unused(self, ref: AdapterRef) -> None:
        if self._in_use[ref] == 0 and ref not in self._pinned:
            self._drop(ref)

    def _drop(self, ref: AdapterRef) -> None:
        self._sources.pop(ref, None)
        self._stale_sources.discard(ref)
        self._pinned.discard(ref)
        if ref in self._resident:
            self._to_unload.add(ref)


__all__ = ["AdapterSlots"]
