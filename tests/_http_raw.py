"""Raw HTTP requests over sockets, for what no client library sends on purpose: uploads that
declare a length, send a few bytes and hang."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def stalled(
    port: int, path: str, key: str, count: int, *, length: int, kind: str = "application/json"
) -> Iterator[None]:
    """``count`` requests to ``127.0.0.1:port`` that declare ``length`` bytes, send a few and hang
    until the block ends."""
    socks = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {key}\r\n"
                f"Content-Type: {kind}\r\nContent-Length: {length}\r\n\r\n"
            )
            s.sendall(head.encode() + b"\0" * 16)
            socks.append(s)
        yield
    finally:
        for s in socks:
            s.close()


__all__ = ["stalled"]
