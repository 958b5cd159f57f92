"""`polytinker worker`: an engine or learner of a runtime, started by hand on another machine, and
what every command of the runtime shares (its config from ``--config`` and the flags, waiting for
a signal). ``serve`` and ``gateway`` are the gateway's (``polytinker/gateway/_cli.py``: serve
starts the HTTP front door with ``--http``); ``jobs``, ``checkpoints``, ``audit``, ``usage`` and
``status`` the client's (``polytinker/client/_cli.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from polytinker.engine.worker.server import WorkerProcess
from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.transport import ClientCurve, load_keypair


def wait_for_signal(dead: threading.Event | None = None) -> None:
    """Until SIGTERM or SIGINT, or until ``dead`` is set."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.2):
        if dead is not None and dead.is_set():
            return


def client_curve(args: argparse.Namespace) -> Any:
    """The ``ClientCurve`` of ``--curve-secret`` and ``--scheduler-key`` (None without them), for a
    command that dials a scheduler serving with Curve as a client (``jobs``, ``gateway``, ...)."""
    if not args.curve_secret:
        return None

    if not args.scheduler_key:
        raise ConfigError("--curve-secret needs --scheduler-key (the scheduler's .key file)")
    return ClientCurve.from_files(args.curve_secret, args.scheduler_key)


def runtime_config(args: argparse.Namespace) -> Any:
    cfg = RuntimeConfig.from_toml(args.config) if args.config else RuntimeConfig()
    changes: dict[str, Any] = {}
    if getattr(args, "model", None):
        changes["model"] = args.model
    if getattr(args, "address", None):
        changes["address"] = args.address
    if getattr(args, "state_dir", None):
        changes["state_dir"] = args.state_dir
    flags = {"address": getattr(args, "http", None), "session_timeout_s": getattr(args, "session_timeout_s", None)}
    if http := {k: v for k, v in flags.items() if v not in (None, "")}:  # the flags over [http]
        changes["http"] = dataclasses.replace(cfg.http, **http)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _loopback(address: str) -> bool:
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    return not address.startswith("tcp://") or host.startswith("127.") or host in ("localhost", "[::1]", "::1")


def _check_worker_addresses(args: argparse.Namespace) -> None:
    """Refuse a bad --bind or --scheduler, or missing Curve keys, before any model is loaded."""
    for flag, value in (("--bind", args.bind), ("--scheduler", args.scheduler)):
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("tcp", "ipc") or not rest or (scheme == "tcp" and ":" not in rest):
            raise ConfigError(f"{flag} {value!r}: use tcp://HOST:PORT or ipc://PATH")
    if bool(args.curve_secret) != bool(args.scheduler_key):
        raise ConfigError("pass --curve-secret (this worker's .key_secret) with --scheduler-key (the scheduler's .key)")
    if not _loopback(args.scheduler) and not args.curve_secret:
        # serve refuses a public address without Curve: a scheduler on another host serves with it.
        raise ConfigError(
            f"--scheduler {args.scheduler} is not on this machine, so it serves with Curve: pass --curve-secret "
            "(this worker's .key_secret from `polytinker keys generate`, its .key in the scheduler's "
            "curve_clients_dir) and --scheduler-key (the scheduler's .key)"
        )


def _placed(cfg: Any, args: argparse.Namespace, role: str) -> Any:
    """The config with ``--device`` / ``--dtype`` set on this worker (a learner group or an hf engine)."""
    chosen = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    if not chosen:
        return cfg
    if role == "engine":  # EngineWorkerConfig refuses them for a vllm engine (CUDA_VISIBLE_DEVICES places it)
        engines = tuple(dataclasses.replace(e, **chosen) if e.engine_id == args.id else e for e in cfg.engines)
        return dataclasses.replace(cfg, engines=engines)
    learners = tuple(dataclasses.replace(g, **chosen) if g.learner_id == args.id else g for g in cfg.learners)
    return dataclasses.replace(cfg, learners=learners)


def _worker(args: argparse.Namespace) -> int:
    cfg = runtime_config(args)
    if not cfg.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=str(Path("polytinker-runtime").resolve()))
    roles = {e.engine_id: "engine" for e in cfg.engines} | {g.learner_id: "learner" for g in cfg.learners}
    if args.id not in roles:
        raise ConfigError(f"--id {args.id!r} is not an engine or learner of the config; declared: {sorted(roles)}")
    cfg = _placed(cfg, args, roles[args.id])
    token = args.token or os.environ.get("POLYTINKER_WORKER_TOKEN", "")
    if not token:
        raise ConfigError("pass --token (the runtime's worker.token) or set POLYTINKER_WORKER_TOKEN")
    _check_worker_addresses(args)
    # The worker always serves with Curve (keys derived from the token, or these); these keys also
    # take it into a scheduler that serves with Curve.
    keypair, client_curve = None, None
    if args.curve_secret:
        public, secret = load_keypair(args.curve_secret)
        if secret is None:
            raise ConfigError(f"{args.curve_secret} holds no secret key: pass the .key_secret file")
        keypair = (public, secret)
        client_curve = ClientCurve(public, secret, load_keypair(args.scheduler_key)[0])
    failed = threading.Event()

    def fatal(reason: str) -> None:
        print(f"{args.id} failed: {reason}; exiting for its launcher to start it again", file=sys.stderr, flush=True)
        failed.set()

    process = WorkerProcess(
        cfg.worker_plan(args.id),
        scheduler=args.scheduler,
        token=token,
        on_fatal=fatal,
        bind=args.bind,
        keypair=keypair,
        client_curve=client_curve,
    )
    print(f"{args.id} serving at {process.server.server.address}, registering with {args.scheduler}", flush=True)
    try:
        wait_for_signal(dead=failed)
    finally:
        process.close()
    return 1 if failed.is_set() else 0


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="runtime.toml (see docs/scheduler-service.md)")
    p.add_argument("--model", help="base model (overrides the config)")


def register(sub: Any) -> None:
    _add_worker_parser(sub)


def _add_worker_parser(sub: Any) -> None:
    """``worker``: an engine or learner group joining a remote scheduler."""
    w = sub.add_parser("worker", help="run an engine or learner group that joins a remote scheduler")
    add_config_args(w)
    w.add_argument("--scheduler", required=True, help="the scheduler's address, tcp://HOST:PORT")
    w.add_argument("--id", required=True, help="the engine or learner id this worker takes (from the config)")
    w.add_argument("--token", help="the runtime's worker token (default $POLYTINKER_WORKER_TOKEN)")
    w.add_argument(
        "--bind", default="tcp://127.0.0.1:0", help="where this worker serves the scheduler (always with Curve)"
    )
    w.add_argument(
        "--state-dir",
        help="where this worker keeps checkpoints and adapter exports (default ./polytinker-runtime); "
        "engines must see the learners' files there",
    )
    w.add_argument(
        "--device", help="a learner group's or hf engine's device: auto, cpu, cuda or cuda:N (overrides the config)"
    )
    w.add_argument("--dtype", help="its dtype: auto, float32 or bfloat16 (overrides the config)")
    w.add_argument("--curve-secret", help="this worker's Curve .key_secret (polytinker keys generate)")
    w.add_argument("--scheduler-key", help="the scheduler's Curve .key (public) file")
    w.set_defaults(func=_worker)


__all__ = ["add_config_args", "client_curve", "register", "runtime_config", "wait_for_signal"]
