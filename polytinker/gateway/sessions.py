"""How a Tinker session ends: its client's ``close`` (``finish``), or silence.

The SDK heartbeats its session every 10 s from a background thread while its process lives. A
session with no heartbeat for ``session_timeout_s`` (``[http]``) belongs to a process that exited
without ``close`` (killed, crashed, or a script that never closes its ServiceClient): it ends as
its close would, with the status ``timeout``. Ending a session

- finishes its training runs' jobs: their adapter slots, learner shares and engine memory go to
  other runs at once; their saved weights stay (a ``save_state`` checkpoint resumes with
  ``create_training_client_from_state``, a saved sampler version still samples);
- releases the holds its samplers had on their versions (``ServiceClient.release_weights``), so
  training's pruning may take them again.

A first finish is written with the session filed as ending (``GatewayStore.finish_session``), and
it leaves that file once its runs and holds are let go: a gateway that stops in between does the
rest after it restarts. Doing it takes the tenant's scheduler client, which the gateway holds for
keys it has seen since it started (it keeps no key): a session of a key not seen since a restart
ends at that key's next request. A restarted gateway heard no heartbeats while it was down, so it
gives every open session ``session_timeout_s`` from its start again (``refresh_heartbeats``).

A heartbeat of a finished session is answered 410, on which the SDK stops heartbeating.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from polytinker.errors import ConfigError
from polytinker.gateway.store import GatewayStore

if TYPE_CHECKING:
    from polytinker.gateway.tinker_backend import Tenant

log = logging.getLogger("polytinker.http")


class Sessions:
    """Ends sessions (``finish``, ``sweep``) over the gateway's store; ``tenant_of(owner)``: the
    tenant of a key this gateway has seen, or None."""

    def __init__(self, store: GatewayStore, tenant_of: Callable[[str], Tenant | None], timeout_s: float) -> None:
        self.store, self.tenant_of, self.timeout_s = store, tenant_of, timeout_s
        # Sweeps at a quarter of the timeout (a silent session ends within 1.25 timeouts), at most
        # every 5 s (within 5 s of its timeout for long ones).
        self.period_s = min(timeout_s / 4, 5.0)
        self._lock = threading.Lock()
        self._ending: set[str] = set()  # sessions being ended now: a close and a sweep may meet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        refreshed = store.refresh_heartbeats()
        if refreshed:
            log.info("%d open Tinker sessions get %.0f s from now to send a heartbeat", refreshed, timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="polytinker-http-sessions", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sweep()
            except Exception:  # the loop must outlive one bad sweep
                log.exception("the Tinker session sweep failed")

    def heartbeat(self, owner: str, session_id: str) -> bool:
        """Note a heartbeat of the owner's session; False when it has finished (ConfigError for
        a session that is not the owner's)."""
        if self.store.session_owner(session_id) != owner:
            raise ConfigError(f"unknown session {session_id!r}")
        if self.store.session_finished(session_id):
            return False
        self.store.heartbeat(session_id)
        return True

    def finish(self, t: Tenant, session_id: str, status: str, detail: str | None) -> None:
        """``ServiceClient.close(status)``: the session takes no more calls; its runs' jobs finish
        after the calls already made, and its holds go."""
        self.store.finish_session(session_id, status, detail)
        self._end(t, session_id, after_calls=True)

    def sweep(self, now: float | None = None) -> list[str]:
        """End the sessions silent for ``timeout_s``, and let go of what finished sessions still
        hold; the ids of the sessions ended now."""
        now = time.time() if now is None else now
        for session_id in self.store.silent_sessions(now - self.timeout_s):
            heard = self.store.last_heartbeat(session_id) or 0.0
            detail = f"no heartbeat for {now - heard:.0f} s (session_timeout_s {self.timeout_s:g}): its client is gone"
            if self.store.finish_session(session_id, "timeout", detail):
                log.warning(
                    "Tinker session %s ended: %s; its runs' jobs finish (saved weights stay)", session_id, detail
                )
        done = []
        for session_id, owner in self.store.endings():
            t = self.tenant_of(owner)
            if t is not None and self._end(t, session_id, after_calls=False):
                done.append(session_id)
        return done

    def _end(self, t: Tenant, session_id: str, *, after_calls: bool) -> bool:
        """Finish the session's runs' jobs and release its holds; whether it is all done (else it
        stays filed as ending and the next sweep tries again). ``after_calls``: a run's job
        finishes after the calls its client made (a close); else at once (the client is gone,
        and a call that waits for a queued job would wait for nothing)."""
        with self._lock:
            if session_id in self._ending:
                return False
            self._ending.add(session_id)
        try:
            for row in self.store.models(t.owner):
                if not row.model_id.startswith(f"{session_id}:"):
                    continue
                with t.lock:
                    tc = t.training.pop(row.job_id, None)
                with contextlib.suppress(ConfigError):  # finished already (by its tenant, or an earlier try)
                    if tc is not None and after_calls:
                        tc.finish()
                    else:
                        t.service.finish_job(row.job_id)
            t.service.release_weights(session_id)
            with t.lock:
                for sampler_id in self.store.session_samplers(session_id):
                    t.samplers.pop(sampler_id, None)
            self.store.ended(session_id)
        except Exception:
            log.exception("ending Tinker session %s failed; the next sweep tries again", session_id)
            return False
        finally:
            with self._lock:
                self._ending.discard(session_id)
        log.info("Tinker session %s ended: its runs' jobs are finished and its samplers' holds released", session_id)
        return True


__all__ = ["Sessions"]
