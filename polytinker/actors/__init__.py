"""Process actors with supervision.

An actor is a process with a mailbox: subclass :class:`Actor`, mark handlers with
``@handler("kind")``, start it with :func:`spawn` (or :meth:`Supervisor.spawn`) and talk to it
through the returned :class:`ActorRef` (``ask``, ``ask_async``, ``tell``, ``stop``, ``kill``).
Each actor logs JSON lines to ``<run_dir>/actors/<name>.log`` (:func:`read_log`).
See ``docs/actors.md``.
"""

from __future__ import annotations

from polytinker.actors._actor import Actor, HandlerSpec, handler
from polytinker.actors._logs import log_path, read_log
from polytinker.actors._protocol import EXIT_FAILED, EXIT_OK, EXIT_ORPHANED
from polytinker.actors._ref import ActorRef
from polytinker.actors._spawn import default_run_dir, spawn
from polytinker.actors._supervisor import ChildExit, ChildReport, Supervisor
from polytinker.actors.config import ActorConfig, RestartPolicy
from polytinker.errors import ActorStartError  # its home is polytinker.errors; docs/actors.md names it here

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_ORPHANED",
    "Actor",
    "ActorConfig",
    "ActorRef",
    "ActorStartError",
    "ChildExit",
    "ChildReport",
    "HandlerSpec",
    "RestartPolicy",
    "Supervisor",
    "default_run_dir",
    "handler",
    "log_path",
    "read_log",
    "spawn",
]
