"""A resent ``create_job`` (or ``copy_checkpoint``, which makes a job too) is answered with the
job its first copy made, not with a second job.

The client resends ``create_job`` when the scheduler restarts mid-call (``Connection.request``):
a scheduler killed after it committed the job and before its answer went out would otherwise
make a second job for the same call, orphaned and holding an adapter slot. So each call carries a
``request_key`` (``CreateJob``): one per logical call, the same on each of its resends
(``ServiceClient`` makes one per call; the HTTP gateway derives one from the SDK's session and
``model_seq_id``). The scheduler stores it with the job, in the job row's own transaction (the
``jobs`` table's ``request_key`` and ``request_digest`` columns), so the state answers a resend
that reaches a restarted scheduler too.

A key belongs to its tenant: another tenant's same key makes that tenant's own job. A key its
tenant used before with the same fields is answered with that job, whatever state it is in now;
with other fields it is refused (``RequestKeyReused``, a 409 through the gateway, naming
``request_key``), as the gateway refuses a Tinker ``seq_id`` reused for another body. A key lives
as long as its job row (a finished inference job's row is pruned after a while: see ``jobs.py``),
far longer than a client resends. A call without a key (an older client) makes a job each time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from polytinker.errors import RequestKeyReused
from polytinker.scheduler.service.messages import CopyCheckpoint, CreateJob
from polytinker.scheduler.service.state import StateStore
from polytinker.scheduler.service.state_rows import JobRow

_NOT_FIELDS = ("api_key", "request_key")  # what the digest leaves out: who asks, and the key itself


def request_digest(msg: CreateJob | CopyCheckpoint) -> str:
    """A digest of what the call asks for (every field but the key and the API key)."""
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name not in _NOT_FIELDS}
    raw = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def repeated_job(store: StateStore, tenant: str, msg: CreateJob | CopyCheckpoint) -> JobRow | None:
    """The job the tenant's earlier call with ``msg.request_key`` made (None: no such call, or no
    key); ``RequestKeyReused`` when that call asked for something else."""
    if not msg.request_key:
        return None
    row = store.job_for_request(tenant, msg.request_key)
    if row is None:
        return None
    if row.request_digest != request_digest(msg):
        raise RequestKeyReused(
            f"request_key {msg.request_key!r} was already used for job {row.job_id} with other fields: a resent "
            "call carries its own key with the same fields, a new one a new key"
        )
    return row


__all__ = ["repeated_job", "request_digest"]
