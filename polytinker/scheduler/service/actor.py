"""The scheduler as a process actor: what ``LocalRuntime`` spawns and supervises (``runtime.py``).

``SchedulerActor`` builds the ``SchedulerService`` in its own process from the runtime's config
(as a dict: it crosses the process boundary), serves it at the runtime's address, and stops it
on a graceful stop. The runtime restarts the process if it dies; the restarted service recovers
its jobs from its state (``JobManager.recover``).
"""

from __future__ import annotations

import os
from typing import Any

from polytinker.actors import Actor
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.scheduler import SchedulerService


class SchedulerActor(Actor):
    """The scheduler as a supervised process actor (the runtime restarts it if it dies)."""

    def __init__(self, config: dict[str, Any], address: str, token: str) -> None:
        self._config = RuntimeConfig.from_dict(config)
        self._address, self._token = address, token
        self._service: SchedulerService | None = None

    def on_start(self) -> None:
        os.umask(0o077)  # the database and everything else it writes: for this user alone
        self._service = SchedulerService(self._config, self._token).start(self._address)

    def on_stop(self) -> None:
        if self._service is not None:
            self._service.stop()


__all__ = ["SchedulerActor"]
