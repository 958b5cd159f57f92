"""`polytinker env`: list, check, play and serve text environments."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from polytinker.envs.checker import check_env, format_findings
from polytinker.envs.config import EnvServerConfig
from polytinker.envs.play import play
from polytinker.envs.registry import env_specs
from polytinker.envs.remote.server import EnvServer
from polytinker.errors import ConfigError
from polytinker.transport.auth import ServerCurve, load_keypair, load_public_keys


def _list(args: argparse.Namespace) -> int:
    specs = env_specs()
    width = max(len(i) for i in specs)
    for env_id, spec in sorted(specs.items()):
        extra = f" {dict(spec.kwargs)}" if spec.kwargs else ""
        print(f"{env_id:<{width}}  {spec.entry_point_name}{extra}  [{spec.source}]")
    return 0


def _check(args: argparse.Namespace) -> int:
    findings = check_env(args.target, seed=args.seed, address=args.env_address)
    shown = f"{args.target} at {args.env_address}" if args.env_address else args.target
    print(format_findings(shown, findings))
    return 0 if all(f.passed for f in findings) else 1


def _play(args: argparse.Namespace) -> int:
    result = play(args.env_id, agent=args.agent, opponent=args.opponent, seed=args.seed, address=args.env_address)
    if result is not None and result.aborted:
        print(f"polytinker env play: error: the env failed: {result.aborted}", file=sys.stderr)
        return 1
    return 0 if result is not None else 1


def _serve(args: argparse.Namespace) -> int:
    curve = None
    if args.curve_key:
        if not args.allow:
            raise ConfigError("--curve-key needs --allow DIR (the public keys of the clients to admit)")
        public, secret = load_keypair(args.curve_key)
        if secret is None:
            raise ConfigError(f"{args.curve_key} holds no secret key; pass the NAME.key_secret file")
        curve = ServerCurve(public, secret, load_public_keys(args.allow))
    config = EnvServerConfig(max_episodes=args.max_episodes, step_timeout_s=args.step_timeout_s)
    server = EnvServer(args.bind, env_ids=args.env_ids, config=config, curve=curve, insecure=args.insecure)
    with server:
        print(f"serving {', '.join(args.env_ids)} on {server.address} (Ctrl-C stops)", file=sys.stderr, flush=True)
        server.wait()
    return 0


def _address_flag(q: Any) -> None:
    # The same flag, with the same meaning, as `polytinker train --env-address`.
    q.add_argument(
        "--env-address",
        default="",
        metavar="ADDRESS",
        help="an env server's address (tcp://HOST:PORT, see `env serve`): the id is one it serves",
    )


def register(sub: Any) -> None:
    p = sub.add_parser("env", help="text environments: list, check, play, serve")
    env_sub = p.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)

    q = env_sub.add_parser("list", help="registered env ids (built-in and plugins)")
    q.set_defaults(func=_list)

    q = env_sub.add_parser("check", help="run the conformance checks on an env and say what to fix")
    q.add_argument("target", help="a registered id (tictactoe-v0) or an entry point (package.module:Class)")
    q.add_argument("--seed", type=int, default=0)
    _address_flag(q)
    q.set_defaults(func=_check)

    q = env_sub.add_parser("play", help="play an env in the terminal against scripted opponents")
    q.add_argument("env_id")
    q.add_argument("--agent", default=None, help="the agent you play (default: the first)")
    q.add_argument("--opponent", default="heuristic", choices=["heuristic", "random"])
    q.add_argument("--seed", type=int, default=None)
    _address_flag(q)
    q.set_defaults(func=_play)

    q = env_sub.add_parser("serve", help="serve registered envs to remote clients over ZeroMQ")
    q.add_argument("env_ids", nargs="+", metavar="ID", help="env ids that clients may open")
    q.add_argument("--bind", default="tcp://127.0.0.1:5599", help="ZeroMQ address to bind (tcp://HOST:PORT)")
    q.add_argument("--max-episodes", type=int, default=1024)
    q.add_argument("--step-timeout-s", type=float, default=30.0)
    q.add_argument("--curve-key", default=None, help="the server's Curve secret key file (NAME.key_secret)")
    q.add_argument("--allow", default=None, help="directory of the admitted clients' public *.key files")
    q.add_argument("--insecure", action="store_true", help="bind beyond loopback without Curve")
    q.set_defaults(func=_serve)
