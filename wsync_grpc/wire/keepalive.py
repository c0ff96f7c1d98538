"""HTTP/2 keepalive of both ends of the control plane: how a frozen or partitioned peer is noticed.

A peer whose process dies is noticed at once: the kernel closes its sockets (FIN or RST), which ends
every call on the connection, the held ``Watch`` of the update included (``docs/architecture.md``,
"Liveness"). A peer that freezes (SIGSTOP, a stalled VM) or is cut off by a partition announces
nothing; keepalive covers it: each end pings the other every :attr:`Keepalive.interval_s` and drops the
connection when a ping is not answered within :attr:`Keepalive.timeout_s`, which ends the held calls as
a death would. A stall shorter than the timeout (garbage collection, a swapped-out page, a loaded
host) is therefore never taken for a death; a frozen peer is noticed within ``interval_s + timeout_s``
(:attr:`Keepalive.bound_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KEEPALIVE_INTERVAL_S = 10.0
"""Time between two keepalive pings on an idle connection, in seconds."""

DEFAULT_KEEPALIVE_TIMEOUT_S = 20.0
"""How long a ping may go unanswered before the connection is dropped, in seconds (the stall tolerated)."""

MIN_RECEIVED_PING_INTERVAL_MS = 1000
"""The engine's server accepts pings down to one a second (gRPC's A8 client-side keepalive), in milliseconds."""


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive of one end of the control plane.

    Attributes:
        interval_s: time between two pings, in seconds (default 10).
        timeout_s: how long a ping may go unanswered before the connection is dropped, in seconds
            (default 20): the longest stall of the peer that is not taken for its death.

    Raises:
        ValueError: a value that is not positive.
    """

    interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("the keepalive interval and timeout must be positive")

    @property
    def bound_s(self) -> float:
        """The longest a frozen or partitioned peer goes unnoticed: ``interval_s + timeout_s``, in seconds."""
        return self.interval_s + self.timeout_s

    def _common(self) -> list[tuple[str, int]]:
        timeout_ms = round(self.timeout_s * 1000)
        return [
            ("grpc.keepalive_time_ms", round(self.interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),  # the same bound in gRPC's current core
            ("grpc.keepalive_permit_without_calls", 1),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """The gRPC server options: ping every connection, accept the clients' pings (never a GOAWAY for them)."""
        return [
            *self._common(),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_RECEIVED_PING_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ]

    def channel_options(self) -> list[tuple[str, int]]:
        """The gRPC channel options of a client: ping the engine, with or without calls in flight."""
        return [*self._common(), ("grpc.http2.max_pings_without_data", 0)]
