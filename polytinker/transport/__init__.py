"""polytinker.transport: ZeroMQ + msgpack.

- ``encode`` / ``decode``: msgpack bodies with arrays and tensors as out-of-band frames.
- ``message`` / ``register_message``: typed messages (frozen dataclasses) by name.
- ``Request[R]``: a message that declares its reply; ``ask(link, msg)`` sends it as its class's
  kind and returns the checked ``R``; ``handler_table`` keys handlers by request class.
- ``RpcServer``, ``RpcClient``: request/reply and tells over ROUTER/DEALER;
  ``current_call()`` tells a handler which request it serves and whether it was cancelled.
- ``DirectClient``: a server's handlers called in this process as over the wire, with no socket
  (the in-process runtime's); ``Link``: what a caller needs of it or of an ``RpcClient``.
- ``ServerCurve``, ``ClientCurve``, ``generate_keypair``: CurveZMQ keys and allow-lists.
- ``TransportConfig``: timeouts, heartbeats, limits and queue depths.
"""

from __future__ import annotations

from polytinker.transport.auth import ClientCurve, ServerCurve, generate_keypair, load_keypair, load_public_keys
from polytinker.transport.codec import decode, encode
from polytinker.transport.config import TransportConfig
from polytinker.transport.direct import DirectClient, Link
from polytinker.transport.messages import message, message_name, message_type, register_message
from polytinker.transport.protocol import PROTOCOL_VERSION, ErrorCode, MsgType
from polytinker.transport.requests import Request, ask, handler_table, kind_of, reply_of
from polytinker.transport.rpc import CallContext, Handler, RpcClient, RpcServer, current_call

__all__ = [
    "PROTOCOL_VERSION",
    "CallContext",
    "ClientCurve",
    "DirectClient",
    "ErrorCode",
    "Handler",
    "Link",
    "MsgType",
    "Request",
    "RpcClient",
    "RpcServer",
    "ServerCurve",
    "TransportConfig",
    "ask",
    "current_call",
    "decode",
    "encode",
    "generate_keypair",
    "handler_table",
    "kind_of",
    "load_keypair",
    "load_public_keys",
    "message",
    "message_name",
    "message_type",
    "register_message",
    "reply_of",
]
