"""What the Tinker SDK's ``AdminClient`` reads: the audit log, usage by the hour, and the
checkpoint storage held now (``AuditLogResponse``, ``BillingUsageResponse``,
``CurrentCheckpointStorageUsageResponse``).

The scheduler keeps the records (``scheduler/service/audit.py``, ``usage.py``); the gateway spells
them as Tinker does: ``tinker://`` paths, the run's model id and session where the tenant made the
run through this gateway, ISO 8601 times. In Tinker these need an admin role of an organization;
here every tenant reads its own, since a tenant is the unit that owns weights and uses the
runtime. polytinker keeps no prices, so every cost and rate is null.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from polytinker.errors import ConfigError
from polytinker.gateway.tinker_backend import Tenant, TinkerBackend
from polytinker.gateway.tinker_names import to_tinker_path
from polytinker.gateway.wire import iso_time
from polytinker.model_path import SAMPLER_NAME_PREFIX, CheckpointPath
from polytinker.scheduler.service.usage import BUCKET_S

_GIGABYTE = 1e9


def _unix(text: str, name: str) -> float:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{name} must be an RFC 3339 time, e.g. 2026-07-13T00:00:00Z") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _audited_path(job_id: str, path: str, name: Any) -> str:
    """The ``tinker://`` path an audit entry names: a named sampler save (the scheduler records
    the version it saved) by the ``sampler_weights/NAME`` its client was answered."""
    if isinstance(name, str) and name.startswith(SAMPLER_NAME_PREFIX):
        return to_tinker_path(str(CheckpointPath(job_id, name)))
    return to_tinker_path(path)


class TinkerAdmin:
    def __init__(self, backend: TinkerBackend) -> None:
        self.backend = backend

    def _runs(self, t: Tenant) -> Callable[[str], tuple[str, str | None]]:
        """A lookup, one query per job however many rows name it: (model id, session id) of a job
        the tenant made through this gateway; (job id, None) for any other (made by polytinker's
        own client, or another tenant's)."""
        return functools.cache(lambda job_id: self._run(t, job_id))

    def _run(self, t: Tenant, job_id: str) -> tuple[str, str | None]:
        run = self.backend.store.model(t.owner, job_id)
        if run is None:
            return job_id, None
        session, sep, _ = run.model_id.partition(":train:")
        return run.model_id, session if sep else None

    def audit_log(self, t: Tenant, event_type: str, day: str | None) -> dict[str, Any]:
        """One UTC day of the tenant's audit log, as ``AuditLogResponse``."""
        log = t.service.audit_log(day or None, event_type)
        run = self._runs(t)
        entries = []
        for e in log.entries:
            model_id, _ = run(e.job_id)
            tinker_path = _audited_path(e.job_id, e.path, e.details.get("name"))
            details = {"tenant": e.tenant, "owner": e.owner, "model_id": model_id, "tinker_path": tinker_path}
            entries.append(
                {
                    "timestamp": iso_time(e.time_s),
                    "event": e.event,
                    "event_details": {**e.details, **details},
                    "model_id": model_id,
                    "tinker_path": tinker_path,
                    "purpose": e.details.get("purpose"),
                }
            )
        return {"entries": entries}

    def usage(self, t: Tenant, starting_on: str, ending_before: str) -> dict[str, Any]:
        """The tenant's hourly usage in [starting_on, ending_before), as ``BillingUsageResponse``."""
        start, end = _unix(starting_on, "starting_on"), _unix(ending_before, "ending_before")
        run = self._runs(t)
        data = []
        for row in t.service.usage(start, end).rows:
            _, session_id = run(row.job_id)
            info: dict[str, Any] = {"type": row.kind}
            if row.kind == "checkpoint":
                info["count"] = row.count
            else:
                info["token_count"] = row.count
                if row.kind == "sampling_prefill":
                    info["cached"] = False  # polytinker bills no prefix cache apart
            data.append(
                {
                    "bucket_start": iso_time(row.bucket_s),
                    "bucket_end": iso_time(row.bucket_s + BUCKET_S),
                    "base_model": row.base_model,
                    "session_id": session_id,
                    "event_info": info,
                }
            )
        return {"data": data, "sessions": {}, "cost_data_through": None}

    def storage(self, t: Tenant) -> dict[str, Any]:
        """The tenant's named checkpoints now, as ``CurrentCheckpointStorageUsageResponse``."""
        held = t.service.storage_usage()
        item = {
            "checkpoint_count": held.checkpoint_count,
            "size_bytes": held.size_bytes,
            "size_gigabytes": held.size_bytes / _GIGABYTE,
        }
        return {"data": [item], "effective_rate_usd_per_gigabyte_month": None}


__all__ = ["TinkerAdmin"]
