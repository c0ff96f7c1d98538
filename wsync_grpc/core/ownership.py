"""One owner per engine: the lease a trainer holds on it (in the spirit of etcd's leases).

``Init`` makes its caller the engine's owner. While the owner is *alive*,
calls that change the engine's weights or membership from anyone else are
refused with FAILED_PRECONDITION, reason ``NOT_OWNER``, naming the owner.
The owner is alive while

- one of its ``KeepAlive`` calls is open (the trainer client holds one for
  as long as it is a member of the group), or
- an update it prepared is in flight (that update has its own proof of life,
  the held ``Watch``), or
- less than its lease's ttl has passed since its last call (``Leave`` ends
  the ttl at once).

The end of the owner's last ``KeepAlive`` call releases the lease at once
(its process died), so that another trainer can take the engine over
without waiting for the ttl. An operator can force the ownership away
(``force`` on Init, Cancel and Leave); every ``KeepAlive`` call of the
previous owner then ends with ``NOT_OWNER``.

Owners are opaque names chosen by the callers (``InitRequest.owner``); the
empty name is the anonymous owner that every caller sending none shares.
No gRPC here: the servicer passes the caller's name and whether an update is
in flight. Not thread-safe: the engine's lock guards it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from wsync_grpc.core.errors import FailedPrecondition, clip

DEFAULT_LEASE_TTL_S = 60.0
"""How long the ownership outlives the owner's last call while none of its KeepAlive calls is open, in seconds."""


@dataclass(frozen=True)
class OwnerView:
    """The live owner, as GetStatus reports it.

    Attributes:
        owner: its name (``""``: the anonymous owner).
        since_unix_s: when it became the owner, seconds since the Unix epoch.
        keepalive_calls: its KeepAlive calls open now.
        lease_ttl_s: the lease's ttl, in seconds.
        expires_in_s: seconds left before the lease expires; ``None`` while it cannot
            (a KeepAlive call is open, or an update is in flight).
    """

    owner: str
    since_unix_s: float
    keepalive_calls: int
    lease_ttl_s: float
    expires_in_s: float | None


def describe(owner: str) -> str:
    """``owner`` quoted for a message (clipped), or "the anonymous owner"."""
    return repr(clip(owner, 200)) if owner else "the anonymous owner (a caller that sends no owner name)"


class Ownership:
    """The engine's owner and its lease.

    Args:
        clock: the monotonic clock, in seconds (tests may pass their own).
        wall: the wall clock, seconds since the Unix epoch.

    Attributes:
        owner: the owner's name; ``None`` when the engine has never been owned or was released.
        generation: incremented whenever the owner changes; a KeepAlive call remembers the
            generation it was opened in and ends once it changed.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self.owner: str | None = None
        self.generation = 0
        self._since_unix_s = 0.0
        self._ttl_s = DEFAULT_LEASE_TTL_S
        self._renewed_at = 0.0
        self._keepalives = 0

    def alive(self, busy: bool) -> bool:
        """Whether the owner is alive; ``busy``: an update (necessarily the owner's) is in flight."""
        if self.owner is None:
            return False
        return busy or self._keepalives > 0 or self._clock() - self._renewed_at < self._ttl_s

    def check(self, caller: str, busy: bool, *, what: str) -> None:
        """Refuse ``caller`` when another owner is alive; renew the lease when ``caller`` is the owner.

        Args:
            caller: the caller's owner name.
            busy: an update is in flight.
            what: the call, for the message (e.g. ``"Prepare"``).

        Raises:
            FailedPrecondition: NOT_OWNER (metadata ``owner``).
        """
        if self.owner is not None and self.owner != caller and self.alive(busy):
            raise FailedPrecondition(
                "NOT_OWNER",
                f"{what} refused: the engine is owned by {describe(self.owner)}, which is alive; "
                "wait until it leaves or dies, or take it over with force (an operator's decision)",
                owner=clip(self.owner, 200),
            )
        if self.owner == caller:
            self._renewed_at = self._clock()

    def claim(self, caller: str, busy: bool, *, what: str, ttl_s: float | None = None, force: bool = False) -> bool:
        """Make ``caller`` the owner (unless another owner is alive and not ``force``); renew its lease.

        Args:
            caller: the caller's owner name.
            busy: an update is in flight.
            what: the call, for the message.
            ttl_s: the lease's new ttl, in seconds; ``None`` keeps the current one.
            force: take the engine from a live owner.

        Returns:
            Whether the owner changed (the previous owner's KeepAlive calls end).

        Raises:
            FailedPrecondition: NOT_OWNER, another owner is alive and ``force`` is not set.
        """
        if not force:
            self.check(caller, busy, what=what)
        changed = self.owner != caller
        if changed:
            self.owner = caller
            self.generation += 1
            self._since_unix_s = self._wall()
            self._keepalives = 0
        if ttl_s is not None:
            self._ttl_s = ttl_s
        self._renewed_at = self._clock()
        return changed

    def expire(self) -> None:
        """End the lease's ttl now (the owner left): it lives on only while a KeepAlive call of it is open."""
        self._renewed_at = self._clock() - self._ttl_s

    def release(self) -> None:
        """The engine has no owner any more (it left, or an operator forced it); its KeepAlive calls end."""
        if self.owner is not None:
            self.owner = None
            self.generation += 1
            self._keepalives = 0

    def force_release(self, caller: str, busy: bool) -> str | None:
        """An operator's force: a live owner other than ``caller`` loses the engine; returns its name, if any."""
        lost = self.owner
        if lost is None or lost == caller or not self.alive(busy):
            return None
        self.release()
        return lost

    def keepalive_opened(self) -> int:
        """Count a KeepAlive call of the owner (call :meth:`claim` first); returns the generation it holds."""
        self._keepalives += 1
        self._renewed_at = self._clock()
        return self.generation

    def keepalive_closed(self, generation: int) -> None:
        """A KeepAlive call opened in ``generation`` ended; the owner's last one ends the lease at once."""
        if generation != self.generation or self._keepalives == 0:
            return
        self._keepalives -= 1
        if self._keepalives == 0:
            self._renewed_at = self._clock() - self._ttl_s  # expired, unless an update is in flight

    def view(self, busy: bool) -> OwnerView | None:
        """The live owner; ``None`` when there is none."""
        if self.owner is None or not self.alive(busy):
            return None
        expires: float | None = None
        if not busy and self._keepalives == 0:
            expires = max(0.0, self._ttl_s - (self._clock() - self._renewed_at))
        return OwnerView(self.owner, self._since_unix_s, self._keepalives, self._ttl_s, expires)
