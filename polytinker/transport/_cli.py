"""`polytinker keys`: CurveZMQ key management (placeholder until the subsystem lands)."""

from __future__ import annotations

import argparse
from typing import Any

from polytinker.errors import NotBuiltError


def _run(args: argparse.Namespace) -> int:
    raise NotBuiltError("`polytinker keys` is not built yet")


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="CurveZMQ key management (not built yet)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)
