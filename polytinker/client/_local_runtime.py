"""The runtime a ``ServiceClient`` without an address starts for its script, or attaches to.

``connect_local_runtime(runtime_config, base_model, ...)`` answers the ``Connection`` to it and
the runtime the client started (which it stops at ``close()``; None when it attached):

- without a ``RuntimeConfig``, the default runtime of the base model: persistent, its state in
  this user's ``home.default_state_dir(model)`` (so paths stay valid for later scripts), and
  shared: when another script's runtime holds that directory (``home.running_holder``), the
  client attaches to it with the holder's address and API key instead of starting a second;
- with a ``RuntimeConfig``, a ``LocalRuntime`` of the client's own on the config's directory;
- with ``inproc``, an ``InprocRuntime`` (the same scheduler, engine and learner as objects in
  this process, no sockets), whose calls go through its in-process link.

A runtime the client started is watched through ``check``: if it stops by itself (an actor
stayed down), the connection's calls raise its ``RuntimeDead``.
"""

from __future__ import annotations

import dataclasses

from polytinker.client._connection import Connection
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.home import StateDirInUse, default_state_dir, running_holder
from polytinker.scheduler.service.inproc import InprocRuntime
from polytinker.scheduler.service.runtime import LocalRuntime


def connect_local_runtime(
    runtime_config: RuntimeConfig | None,
    base_model: str | None,
    inproc: bool,
    timeout_s: float,
    job_wait_s: float,
) -> tuple[Connection, LocalRuntime | InprocRuntime | None]:
    """A runtime for a client (of ``base_model`` when given, else the config's model): the
    default one (persistent, shared with this user's other scripts: attach to it when it runs)
    without a runtime config, else one of its own; its connection, and the runtime when started."""
    cfg = runtime_config or RuntimeConfig()
    if base_model:
        cfg = dataclasses.replace(cfg, model=base_model)
    shared = runtime_config is None and not inproc
    if shared:
        cfg = dataclasses.replace(cfg, state_dir=str(default_state_dir(cfg.model)))
    for _ in range(2):  # a second try: another script may take the directory between look and start
        holder = running_holder(cfg.state_path) if shared else None
        if holder is not None and holder.api_key:
            return Connection(holder.address, holder.api_key, timeout_s=timeout_s, job_wait_s=job_wait_s), None
        try:
            runtime = InprocRuntime(cfg).start() if inproc else LocalRuntime(cfg).start()
            break
        except StateDirInUse:
            if not shared:
                raise
    else:
        raise StateDirInUse(f"{cfg.state_dir}: held by a runtime this client could not reach")
    conn = Connection(
        runtime.local_address,
        runtime.api_key,
        timeout_s=timeout_s,
        job_wait_s=job_wait_s,
        check=runtime.check,
        rpc=runtime.client() if isinstance(runtime, InprocRuntime) else None,
    )
    return conn, runtime


__all__ = ["connect_local_runtime"]
