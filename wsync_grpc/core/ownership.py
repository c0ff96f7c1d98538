"""One owner per engine: the lease a trainer holds on it (in the spirit of etcd's leases).

The engine issues its owner a **lease credential** (:data:`CREDENTIAL_BYTES` random bytes, URL-safe,
prefixed with the lease's generation) when a caller becomes the owner: a successful ``Init``, or the
first ``KeepAlive`` or ``Prepare`` of a caller when the engine has no live owner. The credential, not
the owner's name, proves the ownership: while the owner is *alive*, calls that change the engine's
weights or membership without it are refused with FAILED_PRECONDITION, reason ``NOT_OWNER``, naming
the owner by its display name (never its credential). The owner is alive while

- one of its ``KeepAlive`` calls is open (the trainer client holds one for
  as long as it is a member of the group), or
- an update it prepared is in flight, or its ``Init`` is joining the group, or
- less than its lease's ttl has passed since its last call (``Leave`` ends
  the ttl at once).

The credential doubles as a fencing token: each owner gets a new generation, and the credential of
an earlier one never proves anything again (refused while another owner is alive; a ``KeepAlive``
presenting it is refused even when none is). The end of the owner's last ``KeepAlive`` call releases
the lease at once (its process died), so that another trainer can take the engine over without
waiting for the ttl. An operator can force the ownership away (``force`` on Init, Cancel and Leave);
every ``KeepAlive`` call of the previous owner then ends with ``NOT_OWNER``.

Owner names are display names chosen by the callers (``InitRequest.owner``; empty: anonymous).
No gRPC here: the servicer passes the caller's name, the credential it presented and whether an
update is in flight. Not thread-safe: the engine's lock guards it.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from wsync_grpc.core.errors import FailedPrecondition, clip

DEFAULT_LEASE_TTL_S = 60.0
"""How long the ownership outlives the owner's last call while none of its KeepAlive calls is open, in seconds."""

CREDENTIAL_BYTES = 32
"""Random bytes of a lease credential (``secrets.token_urlsafe``)."""


@dataclass(frozen=True)
class OwnerView:
    """The live owner, as GetStatus reports it (never its credential).

    Attributes:
        owner: its display name (``""``: anonymous).
        since_unix_s: when it became the owner, seconds since the Unix epoch.
        keepalive_calls: its KeepAlive calls open now.
        lease_ttl_s: the lease's ttl, in seconds.
        expires_in_s: seconds left before the lease expires; ``None`` while it cannot
            (a KeepAlive call is open, or an update is in flight).
        generation: the lease's generation (its fencing number; a new owner gets a higher one).
    """

    owner: str
    since_unix_s: float
    keepalive_calls: int
    lease_ttl_s: float
    expires_in_s: float | None
    generation: int = 0


@dataclass(frozen=True)
class Lease:
    """What a caller holds after a successful claim.

    Attributes:
        credential: the lease credential that proves the ownership (secret: only this caller sees it).
        generation: the lease's generation.
        changed: the caller became the owner with this claim (a new lease was issued).
    """

    credential: str
    generation: int
    changed: bool


def describe(owner: str) -> str:
    """``owner`` quoted for a message (clipped), or "an anonymous owner"."""
    return repr(clip(owner, 200)) if owner else "an anonymous owner (a caller that sent no owner name)"


def credential_generation(credential: str) -> int | None:
    """The generation a credential says it belongs to; ``None`` for one that is not a lease credential."""
    head, dot, _ = credential.partition(".")
    return int(head) if dot and head.isdigit() and len(head) < 20 else None


class Ownership:
    """The engine's owner and its lease.

    Args:
        clock: the monotonic clock, in seconds (tests may pass their own).
        wall: the wall clock, seconds since the Unix epoch.

    Attributes:
        owner: the owner's display name; ``None`` when the engine has never been owned or was released.
        generation: incremented whenever the owner changes (a new lease, a new credential) or is
            released; a KeepAlive call remembers the generation it was opened in and ends once it changed.
        max_ttl_s: the operator's cap on a lease's ttl, in seconds (every ttl is clamped to it, the
            default one included).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self.owner: str | None = None
        self.generation = 0
        self.max_ttl_s = float("inf")
        self._credential = ""
        self._since_unix_s = 0.0
        self._ttl_s = DEFAULT_LEASE_TTL_S
        self._renewed_at = 0.0
        self._keepalives = 0

    def holds(self, credential: str) -> bool:
        """Whether ``credential`` is the current owner's (compared in constant time)."""
        if self.owner is None or not credential:
            return False
        return hmac.compare_digest(credential.encode(), self._credential.encode())

    def alive(self, busy: bool) -> bool:
        """Whether the owner is alive; ``busy``: an update (or a join) of the owner is in flight."""
        if self.owner is None:
            return False
        return busy or self._keepalives > 0 or self._clock() - self._renewed_at < self._ttl_s

    def _refuse(self, credential: str, what: str) -> FailedPrecondition:
        """NOT_OWNER for a caller presenting ``credential`` (a stale one is told so); names the owner only."""
        held = self.owner if self.owner is not None else ""
        generation = credential_generation(credential) if credential else None
        if generation is not None and generation < self.generation:
            why = (
                f"the lease credential it presents is of an ended lease (generation {generation}; the engine's "
                f"lease is at generation {self.generation}: it was taken over, released or expired since)"
            )
        elif credential:
            why = "the lease credential it presents is not the owner's"
        else:
            why = "it presents no lease credential (the 'wsync-lease' header; Init, KeepAlive or Prepare issue it)"
        holder = f"owned by {describe(held)}, which is alive" if self.owner is not None else "not owned by it"
        return FailedPrecondition(
            "NOT_OWNER",
            f"{what} refused: the engine is {holder}, and {why}; "
            "wait until the owner leaves or dies, or take it over with force (an operator's decision)",
            owner=clip(held, 200),
        )

    def check(self, credential: str, busy: bool, *, what: str) -> None:
        """Refuse a caller presenting ``credential`` when another owner is alive; renew the owner's lease.

        Args:
            credential: the lease credential the caller presented (``""``: none).
            busy: an update is in flight.
            what: the call, for the message (e.g. ``"Prepare"``).

        Raises:
            FailedPrecondition: NOT_OWNER (metadata ``owner``: the owner's display name).
        """
        if self.holds(credential):
            self._renewed_at = self._clock()
            return
        if self.owner is not None and self.alive(busy):
            raise self._refuse(credential, what)

    def check_holder(self, credential: str, *, what: str) -> None:
        """Refuse a credential that is not the current one although it is a credential (a fenced lease).

        Raises:
            FailedPrecondition: NOT_OWNER.
        """
        if credential and not self.holds(credential):
            raise self._refuse(credential, what)

    def claim(
        self, caller: str, credential: str, busy: bool, *, what: str, ttl_s: float | None = None, force: bool = False
    ) -> Lease:
        """Keep the owner presenting its ``credential``, or make ``caller`` the owner with a new lease.

        A new lease (a new generation and credential) is issued when ``credential`` is not the current
        owner's and no other owner is alive (or ``force``).

        Args:
            caller: the caller's display name (kept for the lease's life).
            credential: the lease credential the caller presented (``""``: none).
            busy: an update is in flight.
            what: the call, for the message.
            ttl_s: the lease's new ttl, in seconds (clamped to :attr:`max_ttl_s`); ``None`` keeps the
                current one, and gives a new lease :data:`DEFAULT_LEASE_TTL_S` (clamped).
            force: take the engine from a live owner.

        Returns:
            The caller's lease.

        Raises:
            FailedPrecondition: NOT_OWNER, another owner is alive and ``force`` is not set.
        """
        if self.holds(credential):
            if ttl_s is not None:
                self._ttl_s = min(ttl_s, self.max_ttl_s)
            self._renewed_at = self._clock()
            return Lease(self._credential, self.generation, changed=False)
        if not force:
            self.check(credential, busy, what=what)
        self.owner = caller
        self.generation += 1
        self._credential = f"{self.generation}.{secrets.token_urlsafe(CREDENTIAL_BYTES)}"
        self._since_unix_s = self._wall()
        self._keepalives = 0
        self._ttl_s = min(ttl_s if ttl_s is not None else DEFAULT_LEASE_TTL_S, self.max_ttl_s)
        self._renewed_at = self._clock()
        return Lease(self._credential, self.generation, changed=True)

    def expire(self) -> None:
        """End the lease's ttl now (the owner left): it lives on only while a KeepAlive call of it is open."""
        self._renewed_at = self._clock() - self._ttl_s

    def release(self) -> None:
        """The engine has no owner any more (it left, or an operator forced it); its KeepAlive calls end.

        The credential is void from now on (a new owner gets a new generation).
        """
        if self.owner is not None:
            self.owner = None
            self._credential = ""
            self.generation += 1
            self._keepalives = 0

    def undo(self, lease: Lease) -> None:
        """A claim that issued ``lease`` failed (Init, Prepare): it claims nothing; the lease is void."""
        if lease.changed and lease.generation == self.generation:
            self.release()

    def force_release(self, credential: str, busy: bool) -> str | None:
        """An operator's force: a live owner other than the caller (``credential``) loses the engine;
        returns its display name, if any."""
        lost = self.owner
        if lost is None or self.holds(credential) or not self.alive(busy):
            return None
        self.release()
        return lost

    def keepalive_opened(self) -> int:
        """Count a KeepAlive call of the owner (call :meth:`claim` first); returns the generation it holds."""
        self._keepalives += 1
        self._renewed_at = self._clock()
        return self.generation

    def keepalive_closed(self, generation: int) -> bool:
        """A KeepAlive call opened in ``generation`` ended; the owner's last one ends the lease at once.

        Returns:
            Whether it was the current owner's last KeepAlive call (the caller then fails an update of the owner's
            that no held ``Watch`` stands for: :func:`wsync_grpc.service.watch.owner_gone`).
        """
        if generation != self.generation or self._keepalives == 0:
            return False
        self._keepalives -= 1
        if self._keepalives == 0:
            self._renewed_at = self._clock() - self._ttl_s  # expired, unless an update is in flight
            return True
        return False

    def view(self, busy: bool) -> OwnerView | None:
        """The live owner; ``None`` when there is none."""
        if self.owner is None or not self.alive(busy):
            return None
        expires: float | None = None
        if not busy and self._keepalives == 0:
            expires = max(0.0, self._ttl_s - (self._clock() - self._renewed_at))
        return OwnerView(self.owner, self._since_unix_s, self._keepalives, self._ttl_s, expires, self.generation)
