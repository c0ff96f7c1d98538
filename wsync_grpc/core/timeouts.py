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
