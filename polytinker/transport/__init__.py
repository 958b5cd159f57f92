"""polytinker.transport: ZeroMQ + msgpack.

- ``encode`` / ``decode``: msgpack bodies with arrays and tensors as out-of-band frames.
- ``message`` / ``register_message``: typed messages (frozen dataclasses) by name.
- ``TransportConfig``: timeouts, heartbeats, limits and queue depths.
"""

from __future__ import annotations

from polytinker.transport.codec import decode, encode
from polytinker.transport.config import TransportConfig
from polytinker.transport.messages import message, message_name, message_type, register_message

__all__ = [
    "TransportConfig",
    "decode",
    "encode",
    "message",
    "message_name",
    "message_type",
    "register_message",
]
