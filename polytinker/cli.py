"""The ``polytinker`` command.

Each subsystem contributes its own subcommands from a ``_cli.py`` module exposing
``register(subparsers)``; this module only assembles them, so command-line parsing stays out
of the library code. Subcommands set ``func`` on their parser; ``func(args) -> int`` is the
exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from polytinker.errors import PolytinkerError

# Modules that add subcommands, in the order they appear in --help.
_COMMAND_MODULES = (
    "polytinker.transport._cli",  # keys
    "polytinker.engine._cli",  # models
    "polytinker.envs._cli",  # env
    "polytinker.gateway._cli",  # serve, gateway
    "polytinker.scheduler._cli",  # worker
    "polytinker.client._cli",  # jobs, checkpoints, audit, usage, status
    "polytinker.agents._cli",  # train, show
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polytinker", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (`polytinker jobs list | head`): stop quietly with SIGPIPE's status,
        # as a Unix tool does. Python flushes stdout again at exit, so that goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except PolytinkerError as exc:
        print(f"polytinker {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
