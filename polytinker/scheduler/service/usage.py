"""What each tenant used, by the hour (``sched.usage``), and what its checkpoints hold now
(``sched.storage_usage``): the counts an operator of a shared runtime bills or budgets by.

Kinds, counted per tenant, UTC hour, base model and job, as Tinker's billing events name them:

- ``training``: the tokens of every datum of a ``forward_backward`` or ``forward``;
- ``sampling_prefill``: prompt tokens a sample read (once per call, whatever its ``num_samples``),
  and every token of a ``compute_logprobs`` sequence;
- ``sampling_sample``: the tokens sampled;
- ``checkpoint``: saves that made a named checkpoint (``save_state``, a named
  ``save_weights_for_sampler``).

Counts are added up in memory and written to the ``usage`` table every few seconds by the
scheduler's pass (``flush``) and before every read, so a crash of the scheduler loses the last
seconds of counts and nothing else. polytinker keeps no prices: costs are the operator's to apply.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.state import StateStore

BUCKET_S = 3600.0


class UsageMeter:
    def __init__(self, store: StateStore, tenant: Callable[[str], str]) -> None:
        self.store = store
        self._tenant = tenant  # the tenant of an API key (AuthError for none)
        self._lock = threading.Lock()
        self._pending: Counter[tuple[str, float, str, str, str]] = Counter()

    def add(self, tenant: str, kind: str, count: int, base_model: str, job_id: str) -> None:
        """Count ``count`` of ``kind`` in this hour (a call resent after its answer was lost counts again)."""
        if count > 0:
            now_s = time.time()
            bucket = now_s - now_s % BUCKET_S
            with self._lock:
                self._pending[(tenant, bucket, kind, base_model, job_id)] += count

    def tokens(self, tenant: str, kind: str, token_lists: Any, base_model: str, job_id: str) -> None:
        """``add`` the tokens of each list of ``token_lists``."""
        self.add(tenant, kind, sum(len(t) for t in token_lists), base_model, job_id)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, Counter()
        if not pending:
            return
        try:
            self.store.add_usage([(*key, n) for key, n in pending.items()])
        except BaseException:
            with self._lock:
                self._pending.update(pending)  # counted again at the next flush
            raise

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {m.Usage: self.usage}

    def usage(self, msg: m.Usage) -> r.UsageReply:
        tenant = self._tenant(msg.api_key)
        self.flush()
        rows = self.store.usage(tenant, msg.start_s, msg.end_s)
        fields = ("bucket_s", "kind", "base_model", "job_id", "count")
        return r.UsageReply([r.UsageRow(*(row[f] for f in fields)) for row in rows])


__all__ = ["BUCKET_S", "UsageMeter"]
