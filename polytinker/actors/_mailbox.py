"""The actor mailbox on the wire: ``polytinker.transport.rpc`` with the settings actors need.

``MailboxServer`` is an RpcServer whose handler-thread count is chosen by the actor (one for the
ordered mailbox; several for concurrent handlers); ``MailboxClient`` is an RpcClient. Payloads
and replies go through the transport codec, so numpy arrays and torch tensors travel out of band.
Heartbeats (answered by the server's I/O thread, never behind a slow handler) tell a client that
its actor died.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from polytinker.transport.config import DEFAULT_CONFIG, TransportConfig
from polytinker.transport.rpc import RpcClient, RpcServer


def _config(threads: int) -> TransportConfig:
    # An actor's mailbox is for the process that spawned it and refs it handed out, all of one
    # runtime: its errors carry their traceback to the caller, to debug an actor from its parent.
    return dataclasses.replace(DEFAULT_CONFIG, handler_threads=threads, expose_tracebacks=True)


class MailboxServer(RpcServer):
    """Serves ``handlers[kind](payload)`` at ``address`` with ``threads`` handler threads."""

    def __init__(self, address: str, handlers: Mapping[str, Callable[[Any], Any]], *, threads: int) -> None:
        super().__init__(address, handlers, config=_config(threads))


class MailboxClient(RpcClient):
    """Sends requests to one actor's mailbox; thread-safe, many calls in flight, FIFO on the wire."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
