"""RPC over ZeroMQ: ``RpcServer`` (ROUTER) and ``RpcClient`` (DEALER).

The same API serves ``inproc://``, ``ipc://`` and ``tcp://`` addresses. The wire format is in
``docs/wire-protocol.md``; the envelope in :mod:`polytinker.transport.protocol`.
"""

from __future__ import annotations

from polytinker.transport.auth import ClientCurve, ServerCurve
from polytinker.transport.client import RpcClient
from polytinker.transport.config import TransportConfig
from polytinker.transport.server import CallContext, Handler, RpcServer, current_call

__all__ = [
    "CallContext",
    "ClientCurve",
    "Handler",
    "RpcClient",
    "RpcServer",
    "ServerCurve",
    "TransportConfig",
    "current_call",
]
