"""`polytinker models`: fetch, list and locate models.

- ``polytinker models fetch NAME``: build or download NAME into the cache now (it also happens on
  first use); NAME is a preset, a hub id or a local directory (which is only checked).
- ``polytinker models list``: the presets, and which are built in the cache.
- ``polytinker models path NAME``: print the local directory of NAME, fetching it if needed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from polytinker.engine.models import PRESETS, ModelConfig, cached_models, resolve_model


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(cache_dir=Path(args.cache_dir)) if args.cache_dir else ModelConfig()


def _fetch(args: argparse.Namespace) -> int:
    start = time.monotonic()
    path = resolve_model(args.name, _config(args))
    print(f"{args.name}: {path} ({time.monotonic() - start:.1f} s)")
    return 0


def _list(args: argparse.Namespace) -> int:
    config = _config(args)
    built = cached_models(config)
    print(f"cache: {config.cache_dir}")
    for name, what in PRESETS.items():
        state = f"built at {built[name]}" if name in built else "not built (fetched on first use)"
        print(f"  {name:24s} {what}\n  {'':24s} {state}")
    return 0


def _path(args: argparse.Namespace) -> int:
    print(resolve_model(args.name, _config(args)))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("models", help="fetch, list and locate models", description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None, help="model cache (default: $POLYTINKER_CACHE or ~/.cache/polytinker)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch = actions.add_parser("fetch", help="build or download a model into the cache now")
    fetch.add_argument("name", help="a preset (see `list`), a Hugging Face hub id or a local directory")
    fetch.set_defaults(func=_fetch)
    listing = actions.add_parser("list", help="presets and what the cache holds")
    listing.set_defaults(func=_list)
    path = actions.add_parser("path", help="print a model's local directory (fetching it if needed)")
    path.add_argument("name")
    path.set_defaults(func=_path)
