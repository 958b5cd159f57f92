"""`polytinker gateway`: the HTTP front door alone (the Tinker API, OpenAI's at /v1), in front of a
scheduler that runs elsewhere. ``polytinker.scheduler._cli`` registers it after ``serve``; its
``[http]`` settings come from ``--config``'s table, with the flags over it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from polytinker.errors import ConfigError


def gateway_config(args: argparse.Namespace) -> Any:
    """``--config``'s ``[http]`` table (defaults without one), served at ``--http``; ``--tokenizer-id``
    and ``--session-timeout-s`` over it (HttpConfig checks them)."""
    from polytinker.scheduler.service.http_config import HttpConfig

    config = HttpConfig.from_toml(args.config) if args.config else HttpConfig()
    flags = {"tokenizer_id": args.tokenizer_id or None, "session_timeout_s": args.session_timeout_s}
    return dataclasses.replace(config, address=args.http, **{k: v for k, v in flags.items() if v is not None})


def _gateway(args: argparse.Namespace) -> int:
    """The HTTP front door alone, in front of a scheduler that runs elsewhere."""
    from polytinker.scheduler._cli import _wait_for_signal
    from polytinker.scheduler.http.app import Gateway

    curve = None
    if args.curve_secret:
        from polytinker.transport import ClientCurve

        if not args.scheduler_key:
            raise ConfigError("--curve-secret needs --scheduler-key (the scheduler's .key file)")
        curve = ClientCurve.from_files(args.curve_secret, args.scheduler_key)
    config = gateway_config(args)
    tokenizers = {args.model: config.tokenizer_id} if config.tokenizer_id else None
    state = Path(args.state_dir).expanduser()
    gateway = Gateway(args.scheduler, state, config, base_models=(args.model,), curve=curve, tokenizer_ids=tokenizers)
    gateway.start()
    print(f"HTTP at {gateway.url} in front of {args.scheduler}: the Tinker API and OpenAI's at /v1", flush=True)
    try:
        _wait_for_signal()
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


def add_gateway_parser(sub: Any) -> None:
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


__all__ = ["add_gateway_parser", "add_session_timeout_arg", "gateway_config"]
