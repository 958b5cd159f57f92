"""The one configuration of the transport: :class:`TransportConfig`.

Every server and client takes one; the defaults suit a single machine. The wire limits here are
also the limits ``docs/wire-protocol.md`` promises a peer.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytinker.errors import ConfigError

_MIB = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    """Timeouts, heartbeats, size limits and queue depths of the ZeroMQ transport."""

    request_timeout_s: float | None = 30.0
    # Default per-call timeout of RpcClient.call; None waits for ever (dead-peer detection still applies).
    heartbeat_interval_s: float = 1.0
    # A client pings its server this often; the server's socket thread answers at once, even while
    # handlers run.
    heartbeat_liveness: int = 30
    # A peer whose connection stays open is dead after this many intervals with nothing received
    # (or four times its slowest answer to a ping, if longer); pending calls fail with
    # PeerDeadError. A peer whose process exits closes its connection, which fails them at once:
    # this limit is for a machine gone without a word, and must outlast a slow peer on a
    # saturated machine (3 s declared live peers dead there).
    max_message_bytes: int = 1 << 31
    # Largest single frame a socket accepts (ZMQ_MAXMSGSIZE; libzmq drops the connection of a peer that
    # sends a bigger one) and the largest whole message (all frames) a server handles.
    max_body_bytes: int = 64 * _MIB
    # Largest msgpack body frame (frame 1); a bigger one gets a `too_large` error reply.
    max_queued_bytes: int = 1 << 30
    # Bytes of requests a server holds waiting for a handler thread; a request that would exceed it gets a
    # `busy` error reply at once (memory stays bounded whatever a peer sends; the caller may retry).
    max_frames: int = 1024
    # Most out-of-band buffer frames in one message.
    max_container_len: int = 1 << 24
    # Most elements in one msgpack array or map (bounds what a hostile header can make us allocate).
    max_depth: int = 32
    # Deepest nesting of arrays, maps and typed messages in one body (a message's fields are one level
    # below it). Checked before each nested decode, so a hostile body costs bounded stack and time.
    inline_max_bytes: int = 1024
    # Arrays and tensors at most this large travel inside the msgpack body; bigger ones as their own frame.
    sndhwm: int = 100_000
    # ZMQ_SNDHWM: messages queued per peer before sends fail (client) or drop (server).
    rcvhwm: int = 100_000
    # ZMQ_RCVHWM: messages queued on receive per peer.
    handler_threads: int = 8
    # Handler threads of a server: the thread that owns the socket hands each request to one, so a slow
    # handler never delays the socket or the heartbeat answers; 1 runs them one at a time, in order.
    # Coroutine handlers run on the server's asyncio loop and are not counted. 0 runs every handler on the
    # socket's thread, for handlers that never block (a slow one then delays every other request and the
    # heartbeat answers).
    idle_caller_sockets: int = 8
    # A client's blocking call() runs on its caller's thread over a socket of its own (one per call
    # running at once): this many idle ones stay open for the next calls, more are closed after
    # their call. 0 connects a socket per call.
    expose_tracebacks: bool = False
    # Put the server's traceback into the ERROR body of a failed handler. Off by default: a caller gets
    # the error's type, message and id, the server logs the traceback under that id. Only for servers
    # whose every client is trusted with the server's code and paths (an actor and its own parent).

    def __post_init__(self) -> None:
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(
                f"TransportConfig.request_timeout_s must be > 0 or None (no timeout), got {self.request_timeout_s}"
            )
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"TransportConfig.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.heartbeat_liveness < 2:
            raise ConfigError(
                f"TransportConfig.heartbeat_liveness must be >= 2 (one missed ping is not a death), "
                f"got {self.heartbeat_liveness}"
            )
        for name in (
            "max_message_bytes",
            "max_body_bytes",
            "max_queued_bytes",
            "max_frames",
            "max_container_len",
            "sndhwm",
            "rcvhwm",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"TransportConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes > self.max_message_bytes:
            raise ConfigError(
                f"TransportConfig.max_body_bytes ({self.max_body_bytes}) must not exceed "
                f"max_message_bytes ({self.max_message_bytes}); raise max_message_bytes or lower max_body_bytes"
            )
        if self.inline_max_bytes < 0:
            raise ConfigError(f"TransportConfig.inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if not 2 <= self.max_depth <= 256:
            raise ConfigError(f"TransportConfig.max_depth must be in 2..256, got {self.max_depth}")
        if self.idle_caller_sockets < 0:
            raise ConfigError(f"TransportConfig.idle_caller_sockets must be >= 0, got {self.idle_caller_sockets}")
        if self.handler_threads < 0:
            raise ConfigError(
                "TransportConfig.handler_threads must be >= 0 (0 runs handlers on the I/O thread), "
                f"got {self.handler_threads}"
            )

    @property
    def dead_after_s(self) -> float:
        """Silence after which the peer counts as dead."""
        return self.heartbeat_interval_s * self.heartbeat_liveness


DEFAULT_CONFIG = TransportConfig()

__all__ = ["DEFAULT_CONFIG", "TransportConfig"]
