"""A learner group's follower (ranks 1..K-1) as a supervised process actor.

Rank 0 (``LearnerGroup.start``) starts its followers with the actor framework, under a supervisor
of its own, so every process of a group is supervised like the runtime's other workers: a
follower dies with rank 0 (the framework's parent-death signal), logs JSON lines to
``<run_dir>/actors/<name>.log`` beside the runtime's actors, leaves its traceback when it fails,
and its exit reaches rank 0 at once. A gloo or NCCL group cannot take a rank back, so rank 0 then
counts the whole group broken (``FollowerSet``) and its owner starts a new one.

This module loads no torch: the actor reports ready first and loads the model on its own thread,
so rank 0 builds its replica while the followers build theirs.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from typing import Any, Literal

from polytinker.actors import Actor, ActorConfig, ChildReport, RestartPolicy, Supervisor
from polytinker.errors import PolytinkerError, WorkerFailed

log = logging.getLogger("polytinker.engine.learner.group")
JOIN_GRACE_S = 30.0  # a graceful stop waits this long for the rank to leave the process group
# How rank 0 starts its followers: process actors on its machine, or Ray actors (ray_followers).
FollowersKind = Literal["local", "ray"]
BROKEN_GRACE_S = 3.0  # how long a call that failed in a collective waits to hear that a rank died


class LearnerFollower(Actor):
    """Rank ``rank`` of a group of ``world`` whose rank 0 listens at ``addr`` (a TCP rendezvous)."""

    def __init__(
        self,
        rank: int,
        world: int,
        addr: str,
        model: str,
        config: dict[str, Any],
        device: str,
        dtype: str,
        threads: int,
        own_device: bool = False,
    ) -> None:
        self._args: tuple[Any, ...] = (rank, world, addr, model, config, device, dtype, threads, own_device)
        self._thread = threading.Thread(target=self._run, name=f"rank-{rank}", daemon=True)

    def on_start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # torch loads here, after the actor reported ready (see the module docstring).
        from polytinker.engine.learner.group import follow

        try:
            follow(*self._args)
        except BaseException as exc:  # the rank is gone: the actor ends as failed
            self.fail_self(exc)
            return
        self.stop_self()  # rank 0 said stop: the group closed

    def on_stop(self) -> None:
        self._thread.join(JOIN_GRACE_S)


class Followers(abc.ABC):
    """Ranks 1..K-1 of a group that rank 0 started, however they were launched: ``broken`` says
    why the group can run no more collectives ('' while every rank is there)."""

    def __init__(self, on_broken: Callable[[str], None] | None) -> None:
        self.broken = ""
        self._broken = threading.Event()
        self._closing = False
        self._on_broken = on_broken

    def _lost(self, reason: str, detail: str) -> None:
        """A rank is gone (``reason``, which travels: no traceback line, no path; ``detail`` goes to
        the log only): the group is broken for good, and its owner is told once."""
        if self._closing or self._broken.is_set():
            return
        self.broken = reason
        self._broken.set()
        log.error("%s (%s); the group is broken", reason, detail)
        if self._on_broken is not None:
            self._on_broken(reason)

    def check(self) -> None:
        if self.broken:
            raise WorkerFailed(self.broken)

    def died_under(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a call of rank 0, came from a rank that died under it (the
        collective's error is seen before the rank's exit is: wait a moment for the exit)."""
        if isinstance(exc, PolytinkerError):  # the learner's own refusal, the same on every rank
            return bool(self.broken)
        return self._broken.wait(BROKEN_GRACE_S)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every follower (each leaves the process group); one that does not is ended."""


class FollowerSet(Followers):
    """Ranks 1..K-1 as process actors on this machine, under a supervisor of rank 0's that
    restarts none of them (see the module docstring)."""

    def __init__(self, name: str, world_size: int, args: tuple[Any, ...], on_broken: Callable[[str], None] | None):
        super().__init__(on_broken)
        self._supervisor = Supervisor(name=f"{name}-followers", on_change=self._changed)
        config = ActorConfig(restart=RestartPolicy(mode="temporary"), stop_timeout_s=JOIN_GRACE_S + 5.0)
        try:
            for rank in range(1, world_size):
                self._supervisor.spawn(
                    LearnerFollower, rank, world_size, *args, name=f"{name}-rank{rank}", config=config
                )
        except BaseException:
            self.close()
            raise

    def _changed(self, report: ChildReport) -> None:
        if not report.alive:
            # Its error stays in the log: a traceback's line may name server paths, and the
            # reason travels (WorkerFailed, a worker's exit).
            why = f"learner group rank {report.name} exited with code {report.last_exit_code}"
            self._lost(why, report.last_error or "no traceback")

    def pids(self) -> list[int]:
        return [r.pid for r in self._supervisor.children().values() if r.pid is not None]

    def close(self) -> None:
        self._closing = True
        self._supervisor.stop()


__all__ = ["FollowerSet", "Followers", "FollowersKind", "LearnerFollower"]
