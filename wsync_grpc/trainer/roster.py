"""Which engines take part in each update: the fleet policy, exclusion, engines that come back or fall behind.

A client's members are the engines it was given plus those added since
(:meth:`Roster.add`), minus those removed (:meth:`Roster.remove`), in rank order.
Every update runs over the members *taking part* (:attr:`Fleet.engines
<wsync_grpc.trainer.fleet.Fleet.engines>`), under a :class:`FleetPolicy`:

- ``fail`` (the default): every member takes part; any engine failing fails
  the whole update (all or nothing across the fleet, as before).
- ``exclude``: before the update every member is asked for its status
  (``GetStatus``, bounded by :data:`PROBE_TIMEOUT_S`); members that do not
  answer are left out. When an attempt fails before the commit decision
  (stages ``init``, ``prepare``, ``broadcast``, ``verify``), it was already
  abandoned everywhere (nothing published); the engines that no longer answer,
  or that refused the update on their own while every other engine lived, are
  left out too, the group is re-formed over the others, and the update runs
  again from the start under a fresh update id. The update is then published
  all or nothing across the members that remain (the same two-phase commit).
  If fewer than :meth:`FleetPolicy.required` members would remain, nothing is
  published anywhere and :class:`~wsync_grpc.trainer.results.SyncError` says so.
  :attr:`SyncResult.excluded <wsync_grpc.trainer.results.SyncResult.excluded>`
  names who was left out and why.

An excluded member is asked again before the next update and takes part as soon
as it answers. A member that serves another version than the fleet's last one
(it was excluded, it restarted with its base weights, it was just added) is
*behind*: the next full update brings it to the new version with everyone, or
:meth:`Roster.catch_up` brings it to the current one between updates, from the
trainer's latest checkpoint when the current version came from disk, else by
broadcasting the tensors the caller passes. A restarted engine is recognised by
its ``GetStatus().updates_completed`` going down or its version going back.

An engine that a supervisor restarts elsewhere (a Ray actor restarted on a new port or node:
:mod:`wsync_grpc.ray`) serves at a new address. With a :attr:`Roster.resolver` set, the members that do
not answer the status probe before an update under ``exclude``, or the one before a catch-up
(:meth:`Roster.behind`), are looked up by it: a member found at another address is replaced there, in its place
(:meth:`Fleet.replace <wsync_grpc.trainer.fleet.Fleet.replace>`), asked again, and counts as a restarted
engine (behind until it catches up). Without a resolver, or under ``fail``, members keep their addresses.

Units: times in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import Fleet, RemoteEngine
from wsync_grpc.trainer.lease import Leases
from wsync_grpc.trainer.membership import Membership
from wsync_grpc.trainer.metrics import TrainerMetrics
from wsync_grpc.trainer.protocol import UpdateProtocol
from wsync_grpc.trainer.request import UpdateRequest
from wsync_grpc.trainer.results import TRAINER, EngineFailure, SyncError, SyncResult, failure_lines
from wsync_grpc.trainer.settings import ClientSettings

log = logging.getLogger(__name__)

Request = TypeVar("Request", bound=UpdateRequest)
"""The kind of update :meth:`Roster.run` runs (each attempt gets the same kind, with a fresh id)."""

__all__ = ["PROBE_TIMEOUT_S", "FailurePolicy", "FleetPolicy", "Member", "MemberState", "Roster", "TargetResolver"]

PROBE_TIMEOUT_S = 5.0
"""Deadline of the ``GetStatus`` asked of every member before an update under ``exclude``, in seconds
(at most the client's ``rpc_timeout_s``): a member that does not answer within it is left out."""

FailurePolicy = Literal["fail", "exclude"]
"""What an update does when some engine is unreachable or fails before the commit decision."""

MemberState = Literal["in_sync", "behind", "excluded"]
"""A member as the client last saw it: serving the fleet's version, serving another, or left out."""

TargetResolver = Callable[[list[str]], Mapping[str, str]]
"""Where members that did not answer serve now: called with their addresses (``host:port``), returns
old address -> new address for those that moved (a member left out, or mapped to its own address, did not).

Called on the client's calling thread, with its op lock held, before the update or catch-up goes on: it
should return within a few seconds (:data:`PROBE_TIMEOUT_S`) whatever happens. What it raises is logged and
taken for "none moved". :class:`wsync_grpc.ray.HandleResolver` asks the engines' Ray actors.
"""

_BEFORE_DECISION = ("init", "prepare", "broadcast", "verify")
"""The stages of a failed update at which nothing was published anywhere (:attr:`SyncError.stage`)."""

_OWN_REFUSALS = ("Init", "Prepare", "Complete")
"""RPCs whose failure on a live engine, when no other engine was lost, is that engine's own refusal."""


@dataclass(frozen=True)
class FleetPolicy:
    """What an update does when engines are unreachable or fail before the commit decision.

    ``FleetPolicy()`` (``fail``) fails the update; ``FleetPolicy.exclude(min_engines=2)`` leaves
    those engines out and publishes on the others, all or nothing, provided at least
    :meth:`required` of them remain (:mod:`wsync_grpc.trainer.roster`).

    Attributes:
        on_failure: ``"fail"`` (default) or ``"exclude"``.
        min_engines: ``exclude``: the fewest engines an update may be published on (default 1).
        min_fraction: ``exclude``: the smallest fraction of the members (0 to 1) it may be
            published on, rounded up (default 0: no fraction); the larger of the two bounds holds.

    Raises:
        ValueError: an unknown ``on_failure``, ``min_engines`` below 1, ``min_fraction`` outside [0, 1].
    """

    on_failure: FailurePolicy = "fail"
    min_engines: int = 1
    min_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.on_failure not in ("fail", "exclude"):
            raise ValueError(f"unknown fleet policy {self.on_failure!r}; use 'fail' or 'exclude'")
        if self.min_engines < 1:
            raise ValueError(f"min_engines must be at least 1, got {self.min_engines}")
        if not 0.0 <= self.min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be between 0 and 1, got {self.min_fraction}")

    @classmethod
    def exclude(cls, min_engines: int = 1, min_fraction: float = 0.0) -> FleetPolicy:
        """The ``exclude`` policy with its minimum (a count, a fraction of the members, or both).

        Raises:
            ValueError: as the class.
        """
        return cls("exclude", min_engines, min_fraction)

    @property
    def excludes(self) -> bool:
        """Whether failing engines are left out (``exclude``) rather than failing the update."""
        return self.on_failure == "exclude"

    def required(self, members: int) -> int:
        """The fewest engines an update over ``members`` members may be published on."""
        return max(self.min_engines, math.ceil(self.min_fraction * members - 1e-9))


@dataclass(frozen=True)
class Member:
    """One member of the client's fleet as the client last saw it (:meth:`TrainerClient.members`).

    Attributes:
        target: the engine's ``host:port``.
        state: ``"in_sync"`` (serves the fleet's last version), ``"behind"`` (answers but serves
            another one: excluded earlier, restarted, or added) or ``"excluded"`` (left out of the
            last update: :attr:`reason` says why).
        weight_version: the version it served when last seen; ``None`` when never seen.
        reason: why it was left out; ``None`` unless excluded.
    """

    target: str
    state: MemberState
    weight_version: str | None
    reason: EngineFailure | None = None


class Roster:
    """Chooses the engines that take part in each update and runs the update under a fleet policy.

    The caller holds the client's op lock around every method but :attr:`members`.

    Args:
        fleet: the engines (members, and which of them take part).
        membership: the trainer's group membership (re-formed when the engines taking part change).
        settings: the client's settings (``rpc_timeout_s`` bounds the status probe).
        calls: the update protocol (its failure protocol builds the errors raised here).
        leases: the client's KeepAlive calls (a removed engine's is ended).
        metrics: the client's Prometheus metrics (exclusions, members by state).

    Attributes:
        version: the fleet's last published base weight version; ``None`` before the first.
        checkpoint: the checkpoint the last published version was read from (as the engines see
            it), when it came from disk; ``None`` after a broadcast update.
        cancelled: set by ``TrainerClient.cancel``; an update cancelled by the caller is never retried.
        resolver: where members that do not answer serve now (:data:`TargetResolver`); ``None`` (default):
            nowhere else.
    """

    def __init__(
        self,
        fleet: Fleet,
        membership: Membership,
        settings: ClientSettings,
        calls: UpdateProtocol,
        leases: Leases,
        metrics: TrainerMetrics,
    ) -> None:
        self._fleet = fleet
        self._membership = membership
        self._settings = settings
        self._calls = calls
        self._leases = leases
        self._metrics = metrics
        self.version: str | None = None
        self.checkpoint: str | None = None
        self.cancelled = False
        self.resolver: TargetResolver | None = None

    # ------------------------------------------------------------------ what the client shows

    def members(self) -> dict[str, Member]:
        """target -> :class:`Member`, in rank order (no call is made)."""
        return {e.target: self._member(e) for e in self._fleet.members}

    def _member(self, e: RemoteEngine) -> Member:
        if e.excluded is not None and not e.taking_part:
            return Member(e.target, "excluded", e.version, e.excluded)
        if self.version is not None and e.version != self.version:
            return Member(e.target, "behind", e.version)
        return Member(e.target, "in_sync", e.version)

    def _count(self) -> None:
        states = [m.state for m in self.members().values()]
        for state in ("in_sync", "behind", "excluded"):
            self._metrics.members.labels(state=state).set(states.count(state))

    # ------------------------------------------------------------------ membership between updates

    def add(self, target: str, workers: int | None) -> Member:
        """Make ``target`` a member (the last ranks); it takes part from the next update, behind until then.

        Raises:
            ValueError: it is a member already, or ``workers`` is below 1.
        """
        e = self._fleet.add(target, workers)
        self._count()
        return self._member(e)

    def remove(self, target: str) -> pb.LeaveResponse | None:
        """Forget member ``target``: it leaves the client's group (best effort), its lease is released.

        Returns:
            Its ``LeaveResponse``; ``None`` when it did not answer (an excluded, dead engine).

        Raises:
            KeyError: no member has that address.
        """
        e = self._fleet.member(target)
        reply: pb.LeaveResponse | None = None
        try:
            reply = e.stub.Leave(
                pb.LeaveRequest(owner=self._fleet.owner),
                timeout=min(self._settings.rpc_timeout_s, PROBE_TIMEOUT_S),
                metadata=self._fleet.metadata,
            )
        except Exception as exc:
            log.warning("%s: leaving on removal failed: %s", target, EngineFailure.from_exception(target, "Leave", exc))
        self._leases.forget(target)
        self._fleet.remove(target)
        self._count()
        return reply

    # ------------------------------------------------------------------ one update under the policy

    def run(self, policy: FleetPolicy, request: Request, attempt: Callable[[Request], SyncResult]) -> SyncResult:
        """Run ``attempt`` (one whole update over the engines taking part) under ``policy``.

        Returns:
            ``attempt``'s result, with :attr:`~SyncResult.excluded`, :attr:`~SyncResult.rejoined` and
            :attr:`~SyncResult.attempts` filled in.

        Raises:
            SyncError: the update failed (``fail``), failed after the commit decision, was cancelled
                by the caller, or would be published on fewer engines than the policy requires (nothing
                published anywhere then).
        """
        self.cancelled = False
        excluded: dict[str, EngineFailure] = {}
        if policy.excludes:
            excluded.update(self._probe(policy, request))
        else:
            for e in self._fleet.members:
                e.taking_part, e.excluded = True, None
        before = {e.target: self._member(e).state for e in self._fleet.engines}
        attempts = 1
        try:
            while True:
                try:
                    result = attempt(request)
                    break
                except SyncError as err:
                    self._membership.fresh_statuses = {}  # the engines' states changed since the probe
                    left_out = self._after_failure(policy, err)
                    if not left_out:
                        raise
                    excluded.update(left_out)
                    self._check_minimum(policy, request, err.stage, excluded)
                    self._calls.repeating()  # a sharded trainer's other ranks follow the next attempt
                    attempts += 1
                    request = dataclasses.replace(request, update_id=uuid.uuid4().hex)
                    log.warning(
                        "sync of %r: left out %s, trying again over %d engine(s) as update %s",
                        request.weight_version,
                        ", ".join(left_out),
                        len(self._fleet.engines),
                        request.update_id,
                    )
        finally:
            self._membership.fresh_statuses = {}
            self._count()
        self._published(request, result)
        rejoined = [t for t, state in before.items() if state != "in_sync" and t in result.engines]
        if self.version is None or request.adapter_name:
            rejoined = []
        return dataclasses.replace(result, excluded=excluded, rejoined=rejoined, attempts=attempts)

    def _probe(self, policy: FleetPolicy, request: UpdateRequest) -> dict[str, EngineFailure]:
        """Ask every member for its status; those that answer take part, the others are left out.

        Returns:
            target -> why, for the members left out.

        Raises:
            SyncError: fewer members answer than ``policy`` requires (stage ``"init"``).
        """
        replies, failures = self._status_of_members()
        for e in self._fleet.members:
            if e.target in failures:
                self._exclude(e, failures[e.target])
                continue
            e.taking_part, e.excluded = True, None
            self._seen(e, replies[e.target])
        self._check_minimum(policy, request, "init", failures)
        self._membership.fresh_statuses = replies  # a group formed for this update needs not ask again
        return failures

    def _status_of(
        self, engines: list[RemoteEngine]
    ) -> tuple[dict[str, pb.GetStatusResponse], dict[str, EngineFailure]]:
        """``GetStatus`` on ``engines``, each within :data:`PROBE_TIMEOUT_S`: target -> reply, target -> failure.

        An engine that was unreachable (UNAVAILABLE) is asked once more on a fresh channel: its old one
        may still be waiting out its reconnection backoff after the engine restarted.
        """
        timeout = min(self._settings.rpc_timeout_s, PROBE_TIMEOUT_S)

        def ask(e: RemoteEngine) -> Awaitable[pb.GetStatusResponse]:
            return self._fleet.aio(e).GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self._fleet.metadata)

        replies, failures = self._fleet.gather("GetStatus", ask, engines)
        again = [e for e in engines if e.target in failures and failures[e.target].code == grpc.StatusCode.UNAVAILABLE]
        for e in again:
            self._fleet.reconnect(e)
        if again:
            more, still = self._fleet.gather("GetStatus", ask, again)
            replies.update(more)
            for t in more:
                failures.pop(t)
            failures.update(still)
        return replies, failures

    def _status_of_members(self) -> tuple[dict[str, pb.GetStatusResponse], dict[str, EngineFailure]]:
        """:meth:`_status_of` every member; those that failed and moved (:attr:`resolver`) are asked again there."""
        replies, failures = self._status_of(self._fleet.members)
        moved = self._moved(failures)
        if moved:
            more, still = self._status_of(moved)
            replies.update(more)
            failures.update(still)
        return replies, failures

    def _moved(self, failures: dict[str, EngineFailure]) -> list[RemoteEngine]:
        """Replace the members of ``failures`` that :attr:`resolver` finds elsewhere (popped from ``failures``).

        Returns:
            The members at their new addresses (fresh: behind until they catch up).
        """
        if self.resolver is None or not failures:
            return []
        try:
            found = dict(self.resolver(list(failures)))
        except Exception:
            log.exception("looking up where %s serve now failed", ", ".join(failures))
            return []
        moved: list[RemoteEngine] = []
        for old, new in found.items():
            taken = {e.target for e in self._fleet.members}
            if old not in failures or not new or new == old or new in taken:
                continue
            try:
                e = self._fleet.replace(old, new)
            except ValueError as exc:  # a token that would travel in clear to it
                log.warning("%s: not following its engine to %s: %s", old, new, exc)
                continue
            why = failures.pop(old)
            log.warning("%s did not answer (%s); its engine serves at %s now", old, why.message or why.reason, new)
            self._leases.forget(old)
            moved.append(e)
        return moved

    def _seen(self, e: RemoteEngine, status: pb.GetStatusResponse) -> None:
        """Record what ``e`` serves; a restarted engine, or one out of the client's group, re-forms the group."""
        restarted = status.updates_completed < e.updates_completed or (
            bool(e.version) and status.weight_version != e.version
        )
        if restarted:
            log.warning(
                "%s restarted or went back (serves %r, %d updates; was %r, %d)",
                e.target,
                status.weight_version,
                status.updates_completed,
                e.version,
                e.updates_completed,
            )
        group = self._membership.group
        if group is not None and (restarted or status.group.master_port != self._membership.port):
            self._membership.drop()  # it is no member of the trainer's group any more
        e.version = status.weight_version
        e.updates_completed = status.updates_completed

    def _exclude(self, e: RemoteEngine, why: EngineFailure) -> None:
        e.taking_part, e.excluded = False, why
        self._metrics.excluded.labels(target=e.target).inc()
        log.warning("%s is left out of the fleet's updates: %s", e.target, why.message or why.reason)

    def _after_failure(self, policy: FleetPolicy, err: SyncError) -> dict[str, EngineFailure]:
        """The engines to leave out after ``err`` (already abandoned everywhere); empty: raise ``err``."""
        if not policy.excludes or self.cancelled or err.stage not in _BEFORE_DECISION:
            return {}
        engines = self._fleet.engines
        _, unreachable = self._status_of(engines)
        if unreachable:  # the others' failures followed from those (a broken group): they stay in
            left_out = {t: err.failures.get(t, f) for t, f in unreachable.items()}
        else:  # every engine lives: those that refused the update on their own
            taking_part = {e.target for e in engines}
            left_out = {
                t: f for t, f in err.failures.items() if t != TRAINER and t in taking_part and f.rpc in _OWN_REFUSALS
            }
        for e in engines:
            if e.target in left_out:
                self._exclude(e, left_out[e.target])
        return left_out

    def _check_minimum(
        self, policy: FleetPolicy, request: UpdateRequest, stage: str, excluded: Mapping[str, EngineFailure]
    ) -> None:
        """Raise when fewer engines take part than ``policy`` requires (nothing was published).

        Raises:
            SyncError: too few engines left (stage ``stage``).
        """
        taking_part, members = len(self._fleet.engines), len(self._fleet.members)
        required = policy.required(members)
        if taking_part >= required:
            return
        self._membership.drop()
        self._metrics.sync_failed(stage)
        raise SyncError(
            f"sync of weight version {request.weight_version!r} published on no engine: {taking_part} of "
            f"{members} engine(s) left, the fleet policy requires {required}; left out: "
            f"{failure_lines(dict(excluded))}",
            stage=stage,
            update_id=request.update_id,
            weight_version=request.weight_version,
            failures=excluded,
            results={},
            cancelled={},
            broadcast_started=False,
        )

    def _published(self, request: UpdateRequest, result: SyncResult) -> None:
        """Record the version every engine that took part serves now."""
        if request.adapter_name:
            return  # adapters do not change the base weights' version
        self._applied(self._fleet.engines, result)
        if len(result.engines) == len(self._fleet.engines):
            self.version = request.weight_version
            self.checkpoint = request.checkpoint

    # ------------------------------------------------------------------ catching up between updates

    def behind(self) -> list[RemoteEngine]:
        """Ask every member for its status; the members that answer and serve another version than the fleet's.

        Excluded members that answer take part again (they are behind until they catch up).
        """
        if self.version is None:
            return []
        replies, failures = self._status_of_members()
        late: list[RemoteEngine] = []
        for e in self._fleet.members:
            if e.target in replies:
                e.taking_part, e.excluded = True, None
                self._seen(e, replies[e.target])
                if e.version != self.version:
                    late.append(e)
            elif e.excluded is None:
                self._exclude(e, failures[e.target])
        self._count()
        return late

    @contextlib.contextmanager
    def taking_part(self, targets: Collection[str]) -> Iterator[None]:
        """Only the members of ``targets`` take part inside the block; those that did before it, afterwards."""
        was = {e.target: e.taking_part for e in self._fleet.members}
        for e in self._fleet.members:
            e.taking_part = e.target in targets
        try:
            yield
        finally:
            for e in self._fleet.members:
                e.taking_part = was[e.target]

    def only(self, engines: list[RemoteEngine], attempt: Callable[[], SyncResult]) -> SyncResult:
        """Run ``attempt`` with only ``engines`` taking part, then every answering member again.

        Raises:
            whatever ``attempt`` raises.
        """
        with self.taking_part({e.target for e in engines}):
            result = attempt()
        self._applied(engines, result)
        self._count()
        return result

    @staticmethod
    def _applied(engines: list[RemoteEngine], result: SyncResult) -> None:
        """Those of ``engines`` that applied ``result`` serve its version now, one more update completed."""
        for e in engines:
            if e.target in result.engines:
                e.version, e.excluded = result.weight_version, None
                e.updates_completed += 1
