"""Every default timeout and deadline margin of wsync, in one value (seconds throughout).

A trainer's control RPC that waits on the group (Init joins it, Complete waits
for the last bucket) gets the group timeout plus the RPC timeout as its gRPC
deadline, so that the engine's own bounded wait always ends first and reports
why; :class:`Timeouts` computes those deadlines in one place
(``docs/architecture.md``, "Deadlines").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DEFAULT_RPC_TIMEOUT_S = 60.0
"""Deadline of a control RPC that does not wait on the group (GetStatus, Prepare, Cancel, Leave...), in seconds."""

DEFAULT_GROUP_TIMEOUT_S = 120.0
"""Group join and per-collective timeout when the caller gives none, in seconds."""

DEFAULT_PAUSE_TIMEOUT_S = 60.0
"""Drain bound of a WAIT pause when the request gives none, in seconds."""

DEFAULT_PREPARE_TIMEOUT_S = 30.0
"""An engine's default bound on arming its receivers at Prepare and on a Prepare stream's silence, in seconds."""

DEFAULT_MAX_TIMEOUT_S = 1800.0
"""An engine's default cap on the waits callers choose (Init's group timeout, Complete, Pause's drain), in seconds."""

DEFAULT_MAX_LEASE_TTL_S = 600.0
"""An engine's default cap on the lease ttl an owner asks for at Init, in seconds."""

DEFAULT_MIN_INTERVAL_S = 0.1
"""An engine's default floor on the interval between two messages of a Watch or KeepAlive stream, in seconds."""

MAX_INTERVAL_S = 60.0
"""The ceiling on the interval between two messages of a Watch or KeepAlive stream, in seconds."""

DEFAULT_UPDATE_IDLE_S = 600.0
"""An engine's default bound on an update's idleness (no bucket arriving, no Complete running), in seconds."""

JOIN_OVERRUN_S = 10.0
"""How long an engine waits for a join past the join's own timeout before it gives up on it, in seconds.

torch's store connect retries can overrun the timeout they were given.
"""


@dataclass(frozen=True)
class Timeouts:
    """The timeouts a trainer works with, and the RPC deadlines derived from them.

    Attributes:
        rpc_s: deadline of a control RPC, in seconds (> 0).
        group_s: group join and per-collective timeout, in seconds (> 0): a
            broadcast blocked on a dead peer fails after it.
        pause_s: the engines' drain bound of a WAIT pause when none is given, in seconds.

    Raises:
        ValueError: a timeout that is not positive.
    """

    rpc_s: float = DEFAULT_RPC_TIMEOUT_S
    group_s: float = DEFAULT_GROUP_TIMEOUT_S
    pause_s: float = DEFAULT_PAUSE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.rpc_s <= 0 or self.group_s <= 0 or self.pause_s <= 0:
            raise ValueError("timeouts must be positive")

    def waiting(self, wait_s: float) -> float:
        """Deadline of an RPC during which the engine may wait ``wait_s`` seconds: ``wait_s + rpc_s``."""
        return wait_s + self.rpc_s

    @property
    def group_rpc_s(self) -> float:
        """Deadline of an RPC that waits on the group (Init, Complete), in seconds."""
        return self.waiting(self.group_s)

    @property
    def round_s(self) -> float:
        """How long a sharded trainer's rank waits for the others in one round of its control group, in seconds.

        The longest trainer rank 0 may spend on the engines between two rounds of one sync: a verifying and an
        applying Complete (each :attr:`group_rpc_s`), then a Cancel and a Leave (each :attr:`rpc_s`). A rank
        that waits out rank 0's legitimate waits never fails a sync that would have succeeded; a rank that dies
        fails the others at once (its connections close), and only a rank that hangs is waited for this long.
        """
        return 2 * self.group_rpc_s + 2 * self.rpc_s

    def pause_rpc_s(self, drain_s: float | None) -> float:
        """Deadline of a Pause whose drain is bounded by ``drain_s`` seconds (``None``: the engine's default)."""
        return self.waiting(self.pause_s if drain_s is None else drain_s)


class Deadline:
    """A point on the monotonic clock, ``seconds`` from its creation.

    Args:
        seconds: time until the deadline, in seconds.
    """

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, minimum: float = 0.0) -> float:
        """Seconds until the deadline, never below ``minimum``."""
        return max(minimum, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.at


@dataclass(frozen=True)
class ServerBounds:
    """The engine operator's bounds on what callers choose: every wait a request asks for is capped by them.

    A duration over its cap is clamped (the reply or the status shows the value in force), never refused.

    Attributes:
        max_timeout_s: cap on Init's group timeout (the join and every collective), Complete's timeout and
            Pause's drain, in seconds (default :data:`DEFAULT_MAX_TIMEOUT_S`, 30 min).
        max_lease_ttl_s: cap on Init's lease ttl, in seconds (default :data:`DEFAULT_MAX_LEASE_TTL_S`, 10 min).
        min_interval_s: floor on the message interval of Watch and KeepAlive streams, in seconds (default
            :data:`DEFAULT_MIN_INTERVAL_S`); the ceiling is :data:`MAX_INTERVAL_S`.
        update_idle_s: an update in flight with no bucket arriving, no Update declaring more and no Complete
            running for this long fails (DEADLINE_EXCEEDED / ``UPDATE_IDLE``) and its owner loses the engine, in
            seconds (default :data:`DEFAULT_UPDATE_IDLE_S`, 10 min). It must exceed the longest gap a trainer
            leaves: before its first bucket, between two, and between the last one (or its fleet's slowest
            verification) and the applying Complete.

    Raises:
        ValueError: a bound that is not positive, or a floor above the ceiling.
    """

    max_timeout_s: float = DEFAULT_MAX_TIMEOUT_S
    max_lease_ttl_s: float = DEFAULT_MAX_LEASE_TTL_S
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    update_idle_s: float = DEFAULT_UPDATE_IDLE_S

    def __post_init__(self) -> None:
        if min(self.max_timeout_s, self.max_lease_ttl_s, self.min_interval_s, self.update_idle_s) <= 0:
            raise ValueError("server bounds must be positive")
        if self.min_interval_s > MAX_INTERVAL_S:
            raise ValueError(f"the minimum interval must not exceed {MAX_INTERVAL_S:g} s")

    def timeout(self, seconds: float) -> float:
        """A caller's wait (group timeout, Complete, Pause drain) in seconds, capped by :attr:`max_timeout_s`."""
        return min(seconds, self.max_timeout_s)

    def lease_ttl(self, seconds: float) -> float:
        """A caller's lease ttl in seconds, capped by :attr:`max_lease_ttl_s`."""
        return min(seconds, self.max_lease_ttl_s)

    def interval(self, seconds: float) -> float:
        """A stream's message interval in seconds, within [:attr:`min_interval_s`, :data:`MAX_INTERVAL_S`]."""
        return min(max(seconds, self.min_interval_s), MAX_INTERVAL_S)
