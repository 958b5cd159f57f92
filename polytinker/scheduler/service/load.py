"""Admission of calls and the load figures of each tenant.

``Admission`` bounds the calls in flight (per kind of work, ``sample`` or ``train``, and per
tenant) and counts, per tenant, what happened to its calls: ``in_flight`` now, and since the
scheduler started ``completed``, ``refused`` (answered "overloaded") and ``waiting`` (answered
"waiting": the job they named was queued, paused or preempting). ``runtime_status()`` shows a
tenant its own figures and the runtime's totals; refusals go to the log at most once per
``log_period_s`` (a summary counts the rest), so a flood of refusals is not a flood of lines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from polytinker.errors import OverloadedError
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport.protocol import RateLimitedLog

log = logging.getLogger("polytinker.scheduler.service")
WORK_KINDS = ("sample", "train")


class Admission:
    """Thread-safe in-flight bounds and per-tenant counters; see the module docstring."""

    def __init__(self, config: RuntimeConfig, log_period_s: float = 5.0) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._inflight: Counter[str] = Counter()  # per kind of work
        self._tenant_inflight: Counter[str] = Counter()
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
        return None

    @contextlib.contextmanager
    def admit(self, tenant: str, what: str) -> Iterator[None]:
        """Hold one in-flight slot of ``what`` for ``tenant``, or raise ``OverloadedError``."""
        with self._lock:
            why = self._refusal(tenant, what)
            if why is None:
                self._inflight[what] += 1
                self._tenant_inflight[tenant] += 1
            else:
                self._counts[tenant]["refused"] += 1
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
