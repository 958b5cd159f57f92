"""A reference server for tests, benchmarks and peers written in other languages.

``python -m polytinker.transport._echo ADDRESS [--handler-threads N]`` serves these kinds and
prints ``READY <bound address>`` on stdout once bound:

- ``echo``: returns the payload;
- ``sleep``: sleeps ``payload`` seconds, returns it;
- ``fail``: raises ``ValueError(payload)``;
- ``nbytes``: returns the total size of the arrays/tensors/bytes in the payload (a sink for
  throughput tests that would otherwise send the data back).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from typing import Any

from polytinker.transport.config import TransportConfig
from polytinker.transport.server import RpcServer


def _fail(payload: Any) -> None:
    raise ValueError(payload)


def _sleep(seconds: Any) -> Any:
    time.sleep(float(seconds))
    return seconds


def _nbytes(payload: Any) -> int:
    if isinstance(payload, list | tuple):
        return sum(_nbytes(p) for p in payload)
    if isinstance(payload, dict):
        return sum(_nbytes(v) for v in payload.values())
    nbytes = getattr(payload, "nbytes", None)
    if nbytes is None and hasattr(payload, "element_size"):
        nbytes = payload.numel() * payload.element_size()
    if isinstance(payload, bytes):
        nbytes = len(payload)
    return int(nbytes or 0)


HANDLERS = {"echo": lambda payload: payload, "sleep": _sleep, "fail": _fail, "nbytes": _nbytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--handler-threads", type=int, default=TransportConfig.handler_threads)
    args = parser.parse_args(argv)
    cfg = TransportConfig(handler_threads=args.handler_threads)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with RpcServer(args.address, HANDLERS, config=cfg) as server:
        print(f"READY {server.address}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
