"""Admission of calls and the load figures of each tenant.

``Admission`` bounds the calls in flight (per kind of work, ``sample`` or ``train``, and per
tenant) and counts, per tenant, what happened to its calls: ``in_flight`` now, and since the
scheduler started ``completed``, ``refused`` (answered "overloaded") and ``waiting`` (answered
"waiting": the job they named was queued, paused or preempting). ``runtime_status()`` shows a
tenant its own figures and the runtime's totals; refusals go to the log at most once per
``log_period_s`` (a summary counts the rest), so a flood of refusals is not a flood of lines.

Fairness: while other tenants contend for a kind of work (they have calls of it in flight, or one
was refused in the last ``CONTEND_S``), a tenant holds at most its weighted share of that kind's
runtime bound (rounded up), so one tenant's flood of calls cannot keep the others out. Alone, a
tenant may use the whole bound: a tenant refused at the full bound becomes a contender, the
tenants over their share are refused from then on, and the calls they have in flight end and
leave room for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from polytinker.errors import OverloadedError
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport.protocol import RateLimitedLog

log = logging.getLogger("polytinker.scheduler.service")
WORK_KINDS = ("sample", "train")
# How long a refused tenant counts as contending: longer than the client's longest back-off after
# an "overloaded" answer (10 s), so a tenant that keeps retrying keeps its share.
CONTEND_S = 15.0


class Admission:
    """Thread-safe in-flight bounds and per-tenant counters; see the module docstring."""

    def __init__(
        self,
        config: RuntimeConfig,
        log_period_s: float = 5.0,
        weights: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``weights``: each tenant's fair-share weight (default: the config's tenants'; a tenant
        named nowhere weighs 1)."""
        self.config = config
        self._weights = dict(weights) if weights is not None else {t.name: t.weight for t in config.tenants}
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()  # per kind of work
        self._tenant_inflight: Counter[str] = Counter()
        self._kind_inflight: Counter[tuple[str, str]] = Counter()  # per (kind of work, tenant)
        self._refused_at: dict[tuple[str, str], float] = {}  # (kind of work, tenant) -> last refusal
        self._counts: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._refusal_log = RateLimitedLog(log, log_period_s)

    def _refusal(self, tenant: str, what: str) -> str | None:
        """Why a new ``what`` call of ``tenant`` is refused now, or None (holding the lock)."""
        bound = self.config.max_inflight_samples if what == "sample" else self.config.max_inflight_train
        if self._inflight[what] >= bound:
            return f"{self._inflight[what]} {what} calls in flight in the runtime (bound {bound})"
        mine, per_tenant = self._tenant_inflight[tenant], self.config.max_inflight_per_tenant
        if mine >= per_tenant:
            return f"{mine} calls of this tenant in flight (bound max_inflight_per_tenant={per_tenant})"
        mine, share = self._kind_inflight[(what, tenant)], self._fair_share(tenant, what, bound)
        if mine >= share:
            return f"{mine} {what} calls of this tenant in flight: its fair share of {bound} while other tenants wait"
        return None

    def _fair_share(self, tenant: str, what: str, bound: int) -> int:
        """``tenant``'s part of ``bound`` by weight among the tenants contending for ``what`` (holding the lock)."""
        now = self._clock()
        for key in [k for k, t in self._refused_at.items() if now - t > CONTEND_S]:
            del self._refused_at[key]
        contending = {t for (k, t), n in self._kind_inflight.items() if k == what and n > 0}
        contending |= {t for (k, t) in self._refused_at if k == what}
        contending.add(tenant)
        weight = self._weights.get(tenant, 1.0)
        total = sum(self._weights.get(t, 1.0) for t in contending)
        return max(1, math.ceil(bound * weight / total))

    @contextlib.contextmanager
    def admit(self, tenant: str, what: str) -> Iterator[None]:
        """Hold one in-flight slot of ``what`` for ``tenant``, or raise ``OverloadedError``."""
        with self._lock:
            why = self._refusal(tenant, what)
            if why is None:
                self._inflight[what] += 1
                self._tenant_inflight[tenant] += 1
                self._kind_inflight[(what, tenant)] += 1
            else:
                self._counts[tenant]["refused"] += 1
                self._refused_at[(what, tenant)] = self._clock()
        if why is not None:
            self._refusal_log("overloaded: refused a %s call of tenant %s: %s", what, tenant, why)
            raise OverloadedError(why, self.config.retry_after_s)
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._lock:
                self._inflight[what] -= 1
                self._tenant_inflight[tenant] -= 1
                self._kind_inflight[(what, tenant)] -= 1
                if self._kind_inflight[(what, tenant)] <= 0:  # bounded memory under many tenants
                    del self._kind_inflight[(what, tenant)]
                self._counts[tenant]["completed" if ok else "failed"] += 1

    def waited(self, tenant: str) -> None:
        """A call of ``tenant`` was answered "waiting" (its job cannot run it yet)."""
        with self._lock:
            self._counts[tenant]["waiting"] += 1

    def tenant_status(self, tenant: str) -> dict[str, int]:
        with self._lock:
            c = self._counts[tenant]
            return {
                "in_flight": self._tenant_inflight[tenant],
                "completed": c["completed"],
                "failed": c["failed"],
                "refused": c["refused"],
                "waiting": c["waiting"],
            }

    def totals(self) -> dict[str, Any]:
        """The runtime's figures over all tenants (no tenant's name or share in them)."""
        with self._lock:
            summed: Counter[str] = Counter()
            for c in self._counts.values():
                summed.update(c)
            return {
                "in_flight": {k: self._inflight[k] for k in WORK_KINDS},
                "completed": summed["completed"],
                "failed": summed["failed"],
                "refused": summed["refused"],
                "waiting": summed["waiting"],
            }


__all__ = ["WORK_KINDS", "Admission"]
