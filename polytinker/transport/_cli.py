"""`polytinker keys`: CurveZMQ key management."""

from __future__ import annotations

import argparse
from typing import Any

from polytinker.transport.auth import generate_keypair


def _generate(args: argparse.Namespace) -> int:
    public_file, secret_file = generate_keypair(args.dir, args.name)
    print(f"public key: {public_file}  (give this to the peers that must trust it)")
    print(f"secret key: {secret_file}  (mode 0600; keep it on this machine)")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="CurveZMQ key management")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="KEYS_COMMAND", required=True)
    g = keys_sub.add_parser("generate", help="write a Curve keypair (NAME.key and NAME.key_secret)")
    g.add_argument("--dir", default=".", help="directory to write the key files into (default: .)")
    g.add_argument("--name", default="polytinker", help="file name stem of the keypair (default: polytinker)")
    g.set_defaults(func=_generate)
