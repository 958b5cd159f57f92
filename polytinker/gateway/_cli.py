"""`polytinker serve` (a runtime on this machine, with its HTTP front door at ``--http``) and
`polytinker gateway` (the HTTP front door alone, in front of a scheduler that runs elsewhere).
The gateway's ``[http]`` settings come from ``--config``'s table, with the flags over it.
``serve`` exits 1, after one line on stderr that names the actor and why, when an actor of its
runtime stays down (its restart limit hit): the runtime has stopped by then."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from polytinker.scheduler._cli import add_config_args, client_curve, runtime_config, wait_for_signal
from polytinker.scheduler.service.http_config import HttpConfig
from polytinker.scheduler.service.runtime import check_servable


def gateway_config(args: argparse.Namespace) -> Any:
    """``--config``'s ``[http]`` table (defaults without one), served at ``--http``; ``--tokenizer-id``
    and ``--session-timeout-s`` over it (HttpConfig checks them)."""
    config = HttpConfig.from_toml(args.config) if args.config else HttpConfig()
    flags = {"tokenizer_id": args.tokenizer_id or None, "session_timeout_s": args.session_timeout_s}
    return dataclasses.replace(config, address=args.http, **{k: v for k, v in flags.items() if v is not None})


def _serve(args: argparse.Namespace) -> int:
    from polytinker.gateway.runtime import HttpRuntime  # the runtime and FastAPI load when it runs, not for --help

    cfg = runtime_config(args)
    if not cfg.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=str(Path("polytinker-runtime").resolve()))
    check_servable(cfg)
    runtime = HttpRuntime(cfg)
    generated = not cfg.tenants
    runtime.start()
    try:
        state = runtime.config.state_path
        if generated:
            key_file = state / "local.api_key"
            key_file.write_text(runtime.api_key + "\n")
            os.chmod(key_file, 0o600)
            print(f"tenant 'local': API key in {key_file}")
        token_file = state / "worker.token"
        token_file.write_text(runtime.config.worker_token + "\n")
        os.chmod(token_file, 0o600)
        print(f"scheduler at {runtime.address}  (state in {state}; worker token in {token_file})", flush=True)
        if runtime.http_url:
            print(f"HTTP at {runtime.http_url}: the Tinker API (TINKER_BASE_URL) and OpenAI's at /v1", flush=True)
        wait_for_signal(runtime.dead)
    finally:
        runtime.stop()
    if runtime.failure is not None:
        print(f"polytinker serve: {runtime.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _gateway(args: argparse.Namespace) -> int:
    """The HTTP front door alone, in front of a scheduler that runs elsewhere."""
    from polytinker.gateway.app import Gateway  # FastAPI and the gateway load when it runs, not for --help

    curve = client_curve(args)
    config = gateway_config(args)
    tokenizers = {args.model: config.tokenizer_id} if config.tokenizer_id else None
    state = Path(args.state_dir).expanduser()
    gateway = Gateway(args.scheduler, state, config, base_models=(args.model,), curve=curve, tokenizer_ids=tokenizers)
    gateway.start()
    print(f"HTTP at {gateway.url} in front of {args.scheduler}: the Tinker API and OpenAI's at /v1", flush=True)
    try:
        wait_for_signal()
    finally:
        gateway.stop()
    return 0


def add_session_timeout_arg(p: argparse.ArgumentParser) -> None:
    """``--session-timeout-s`` (``serve`` and ``gateway``): ``[http] session_timeout_s`` from the shell."""
    p.add_argument(
        "--session-timeout-s",
        type=float,
        metavar="S",
        help="end a Tinker session after this long without a heartbeat (overrides [http] session_timeout_s; 180)",
    )


def register(sub: Any) -> None:
    """``serve``, then ``gateway``, in ``polytinker --help``."""
    _add_serve_parser(sub)
    _add_gateway_parser(sub)


def _add_serve_parser(sub: Any) -> None:
    """``serve``: the scheduler service, with its local engines and learners."""
    p = sub.add_parser("serve", help="run the scheduler service (and its local engines and learners)")
    add_config_args(p)
    p.add_argument("--address", help="where the scheduler listens, e.g. tcp://127.0.0.1:7000 (overrides the config)")
    p.add_argument("--state-dir", help="SQLite state, checkpoints, adapters (default ./polytinker-runtime)")
    p.add_argument("--http", metavar="HOST:PORT", help="serve the Tinker API and OpenAI-compatible inference here")
    add_session_timeout_arg(p)
    p.set_defaults(func=_serve)


def _add_gateway_parser(sub: Any) -> None:
    g = sub.add_parser("gateway", help="serve the Tinker API and OpenAI-compatible inference for a scheduler elsewhere")
    g.add_argument("--scheduler", required=True, help="the scheduler's address, tcp://HOST:PORT")
    g.add_argument("--config", help="a runtime.toml: its [http] table configures the gateway (the rest is not read)")
    g.add_argument("--http", required=True, metavar="HOST:PORT", help="where to serve HTTP")
    g.add_argument("--model", required=True, help="the scheduler's base model, by the name clients use")
    g.add_argument("--state-dir", default="polytinker-gateway", help="where the gateway keeps its names (SQLite)")
    g.add_argument("--tokenizer-id", help="what get_info names as the tokenizer (a hub id or a directory)")
    add_session_timeout_arg(g)
    g.add_argument("--curve-secret", help="your Curve .key_secret, for a scheduler that serves with Curve")
    g.add_argument("--scheduler-key", help="the scheduler's Curve .key (public) file")
    g.set_defaults(func=_gateway)


__all__ = ["add_session_timeout_arg", "gateway_config", "register"]
