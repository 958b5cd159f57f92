"""`polytinker models`: model provisioning (placeholder until the subsystem lands)."""

from __future__ import annotations

import argparse
from typing import Any

from polytinker.errors import NotBuiltError


def _run(args: argparse.Namespace) -> int:
    raise NotBuiltError("`polytinker models` is not built yet")


def register(sub: Any) -> None:
    p = sub.add_parser("models", help="model provisioning (not built yet)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)
