"""The trainer's membership of the weight-sync group: forming it, leaving it, knowing when it is stale.

Forming the group (:meth:`Membership.form`): ask every engine for its worker
count, compute rank offsets (the trainer's ranks first, as many as its
:class:`~wsync_grpc.transports.sending.TrainerPeers` say, ``M``; engine *i* from
``M + sum(workers[:i])``; a trainer that is one process: ``M = 1``, the trainer at
rank 0), free engines still holding an old membership, choose the store's
address (``master_address``; ``"auto"``: the local address of the route to
the first engine, looked up at every formation), then send Init to every
engine concurrently *while* the trainer creates its side of the group in a
helper thread (asking the engines only after the trainer blocked in group
creation is the classic deadlock). An engine's Init
that fails before the group forms ends the formation at once instead of
after the join timeout.

The group goes stale (the next sync re-initializes it) when it is left or
dropped, when a formation fails, when Cancel abandoned an update on some
engine (engines that abandon an update leave the group), and when an engine's
lease was lost (an operator forced it away).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Awaitable, Mapping
from concurrent.futures import Future
from typing import Any

from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.group.process_group import WeightSyncGroup, free_port, join_group
from wsync_grpc.group.routes import route_address
from wsync_grpc.trainer.fleet import Fleet, RemoteEngine
from wsync_grpc.trainer.lease import Leases
from wsync_grpc.trainer.results import (
    TRAINER,
    ClientError,
    EngineCallError,
    EngineFailure,
    InitError,
    failure_lines,
)
from wsync_grpc.trainer.settings import AUTO_MASTER_ADDRESS, ClientSettings
from wsync_grpc.transports.sending import TrainerPeers
from wsync_grpc.wire.convert import backend_to_proto, duration

log = logging.getLogger(__name__)

_FREE = (pb.LIFECYCLE_STATE_UNINITIALIZED, pb.LIFECYCLE_STATE_FAILED)
"""States in which Init joins a new group."""

_ARMED = (pb.LIFECYCLE_STATE_PREPARING, pb.LIFECYCLE_STATE_RECEIVING, pb.LIFECYCLE_STATE_RECEIVED)
"""States with an update armed (Cancel frees them)."""


class Membership:
    """The trainer's side of the group (its rank among the trainer's peers) and the Init replies it was formed with.

    Args:
        fleet: the engines.
        settings: the client's settings (read at every formation).
        cancel_event: the client's cancel signal, cleared when a formation starts.
        leases: the client's KeepAlive calls, (re)started by every formation.
        peers: the trainer's ranks: how many group ranks it holds (engines' workers follow them) and
            which one this process joins as.

    Attributes:
        group: the trainer's membership, ``None`` before a formation and after a drop.
        closed: set when the client closed; no group is formed after it.
    """

    def __init__(
        self, fleet: Fleet, settings: ClientSettings, cancel_event: threading.Event, leases: Leases, peers: TrainerPeers
    ) -> None:
        self._fleet = fleet
        self._peers = peers
        self._leases = leases
        self._settings = settings
        self._cancel_event = cancel_event
        self.group: WeightSyncGroup | None = None
        self.closed = False
        self._needs_init = True
        self._init_replies: dict[str, pb.InitResponse] = {}
        self._port_in_use: int | None = None
        self._init_attempted = False
        self._formed_with: tuple[str, ...] = ()
        self.fresh_statuses: dict[str, pb.GetStatusResponse] = {}
        """target -> a ``GetStatus`` reply asked for the update about to run; the next formation uses
        them instead of asking again, then forgets them."""
        self.master_address = settings.master_address
        """The store's address at the last formation (``"auto"`` resolved)."""

    @property
    def needs_init(self) -> bool:
        """Whether the next sync (re-)initializes the group first: also when an engine's lease was lost, or
        when the engines taking part are not those the group was formed with (one was excluded, added,
        removed or came back)."""
        return (
            self._needs_init
            or self.group is None
            or bool(self._leases.lost)
            or self._formed_with != tuple(e.target for e in self._fleet.engines)
        )

    @property
    def trainer_ranks(self) -> int:
        """How many group ranks the trainer holds (its peers')."""
        return self._peers.trainer_ranks

    @property
    def world_size(self) -> int:
        """The trainer's ranks plus every engine's workers, as of the last formation (the trainer's alone before)."""
        return self._peers.trainer_ranks + sum(e.workers for e in self._fleet.engines)

    @property
    def port(self) -> int | None:
        """The TCP port of the trainer's store in the current group; ``None`` when not joined."""
        return self._port_in_use if self.group is not None else None

    # ------------------------------------------------------------------ forming the group

    def init(self, force: bool) -> dict[str, pb.InitResponse]:
        """The current Init replies when the group is current and ``force`` is not set; else :meth:`form`."""
        if not self.needs_init and not force:
            return dict(self._init_replies)
        return self.form()

    def form(self) -> dict[str, pb.InitResponse]:
        """Form a new group: status, rank offsets, freeing engines, then Init everywhere while the trainer joins.

        Returns:
            target -> ``InitResponse``.

        Raises:
            InitError: an engine failed (status, cleanup or Init), the
                trainer's join failed, or an engine reports other ranks than
                assigned; the group stays stale.
            ClientError: the client was closed.
        """
        if self.closed:
            raise ClientError("the client is closed")
        self.drop()
        self._cancel_event.clear()
        self._init_attempted = True
        fresh, self.fresh_statuses = self.fresh_statuses, {}
        if all(e.target in fresh for e in self._fleet.engines):
            statuses: dict[str, pb.GetStatusResponse] = dict(fresh)  # just asked (the roster's probe)
            failures: dict[str, EngineFailure] = {}
        else:
            statuses, failures = self._fleet.gather("GetStatus", self._fleet.start_get_status)
        if failures:
            raise InitError(f"cannot initialize: {failure_lines(failures)}", rpc="Init", failures=failures, results={})
        self._leases.start()
        world_size = self._assign_ranks(statuses)
        self._free_all(statuses)
        self.master_address = address = self._store_address()
        port = self._settings.master_port or free_port(address)
        self._peers.forming(port, world_size)
        replies = self._join_all(address, port, world_size)
        self._port_in_use = port
        self._init_replies = replies
        self._needs_init = False
        self._formed_with = tuple(e.target for e in self._fleet.engines)
        log.info(
            "weight-sync group %r formed: world size %d, %d engine(s), store %s:%d",
            self._settings.group_name,
            world_size,
            len(self._fleet.engines),
            address,
            port,
        )
        return dict(replies)

    def _store_address(self) -> str:
        """The address the trainer's store listens on and the engines are told: ``master_address``, or for
        ``"auto"`` the local address of the route to the first engine.

        Raises:
            InitError: ``"auto"`` and no route leads to the first engine.
        """
        address = self._settings.master_address
        if address != AUTO_MASTER_ADDRESS:
            return address
        target = self._fleet.engines[0].target
        try:
            return route_address(target)
        except ValueError as e:
            failure = EngineFailure(TRAINER, "Init", None, "NO_ROUTE", f"master_address='auto': {e}")
            raise InitError(
                f"cannot choose the store's address: {e}", rpc="Init", failures={TRAINER: failure}, results={}
            ) from e

    def _assign_ranks(self, statuses: Mapping[str, pb.GetStatusResponse]) -> int:
        """Set every engine's worker count and rank offset, in target order after the trainer's ranks.

        Returns:
            The world size: the trainer's ranks plus every engine's workers.

        Raises:
            InitError: an engine reports no workers.
        """
        offset = self._peers.trainer_ranks
        for e in self._fleet.engines:
            e.workers = e.fixed_workers if e.fixed_workers is not None else int(statuses[e.target].engine.workers)
            if e.workers < 1:
                raise InitError(
                    f"{e.target} reports {e.workers} workers",
                    rpc="Init",
                    failures={
                        e.target: EngineFailure(e.target, "GetStatus", None, "NO_WORKERS", "engine.workers is 0")
                    },
                    results={},
                )
            e.rank_offset = offset
            offset += e.workers
        return offset

    def _free_all(self, statuses: Mapping[str, pb.GetStatusResponse]) -> None:
        """Bring every engine to UNINITIALIZED or FAILED, the states in which Init joins a new group.

        All engines at once, in rounds: ``Leave`` to those READY (still in an old group), ``Cancel``
        to those with an update armed, then ``GetStatus`` of those touched; engines JOINING or
        APPLYING are waited for (both end by the engine's own deadlines), 0.1 s between rounds.

        Raises:
            InitError: a Leave, Cancel or GetStatus call failed on some engine, or an engine stayed
                JOINING/APPLYING past the group timeout.
        """
        s = self._settings
        deadline = time.monotonic() + s.timeouts.group_rpc_s
        kw: dict[str, Any] = {"timeout": s.rpc_timeout_s, "metadata": self._fleet.metadata}
        owner = self._fleet.owner
        busy = {e.target: (e, statuses[e.target]) for e in self._fleet.engines}
        failures: dict[str, EngineFailure] = {}
        while True:
            busy = {t: (e, st) for t, (e, st) in busy.items() if st.state not in _FREE}
            if not busy:
                break
            leave = [e for e, st in busy.values() if st.state == pb.LIFECYCLE_STATE_READY]
            cancel = [e for e, st in busy.values() if st.state in _ARMED]
            if not (leave or cancel):  # JOINING or APPLYING only
                if time.monotonic() > deadline:
                    for t, (_, st) in busy.items():
                        state = pb.LifecycleState.Name(st.state)
                        why = TimeoutError(f"the engine stayed in {state} for more than {s.timeouts.group_rpc_s:g} s")
                        failures[t] = EngineFailure.from_exception(t, "GetStatus", why)
                    break
                time.sleep(0.1)
            left, leave_failures = self._fleet.gather(
                "Leave", lambda e: self._fleet.aio(e).Leave(pb.LeaveRequest(owner=owner), **kw), leave
            )
            cancelled, cancel_failures = self._fleet.gather(
                "Cancel",
                lambda e: self._fleet.start_cancel(e, "", "the trainer re-initializes the group"),
                cancel,
            )
            for t in left:
                log.info("%s left its previous weight-sync group", t)
            for t in cancelled:
                log.info("%s: cancelled the update in flight", t)
            failures.update(leave_failures)
            failures.update(cancel_failures)
            again = [e for e, _ in busy.values() if e.target not in failures]
            replies, status_failures = self._fleet.gather("GetStatus", self._fleet.start_get_status, again)
            failures.update(status_failures)
            busy = {t: (busy[t][0], r) for t, r in replies.items()}
        if failures:
            raise InitError(f"cannot initialize: {failure_lines(failures)}", rpc="Init", failures=failures, results={})

    def _join_all(self, address: str, port: int, world_size: int) -> dict[str, pb.InitResponse]:
        """Send Init to every engine, join as this process's rank meanwhile, then collect the Init replies.

        Raises:
            InitError: an Init or the trainer's join failed, or an engine joined at other ranks.
        """
        events = threading.Event()  # set whenever a future or the join finishes
        futures, failures = self._start_inits(address, port, world_size, events)
        # The trainer joins in a helper thread so that a fast Init failure is noticed at once.
        join = _TrainerJoin(self._settings, self._peers, address, port, world_size, events)
        if not failures:
            join.run_until_done_or_failed(futures)
        if join.thread.is_alive() or failures:
            # An engine's Init failed while the trainer was still joining: give up now.
            join.abandoned.set()
        for fut in futures.values():
            if join.group is None and not fut.done():
                fut.cancel()
        replies, init_failures = _collect_inits(futures)
        failures.update(init_failures)
        trainer_failure = join.failure(others_failed=bool(failures))
        if trainer_failure is not None:
            failures[TRAINER] = trainer_failure
        failures.update(self._rank_mismatches(replies))
        if failures:
            if join.group is not None:
                join.group.destroy()
            # Engines that did join are members of a group that will never be used.
            self._needs_init = True
            raise InitError(
                f"the weight-sync group did not form (store {address}:{port}, "
                f"world size {world_size}): {failure_lines(failures)}",
                rpc="Init",
                failures=failures,
                results=replies,
            )
        assert join.group is not None  # no failure means the trainer joined
        self.group = join.group
        return replies

    def _start_inits(
        self, address: str, port: int, world_size: int, events: threading.Event
    ) -> tuple[dict[str, Future[pb.InitResponse]], dict[str, EngineFailure]]:
        """Start Init on every engine; ``events`` is set whenever one finishes.

        Returns:
            target -> the call in flight, target -> failure for the engines where it did not start.
        """
        s = self._settings
        rpc_deadline = s.timeouts.group_rpc_s
        futures: dict[str, Future[pb.InitResponse]] = {}
        failures: dict[str, EngineFailure] = {}
        for e in self._fleet.engines:
            req = pb.InitRequest(
                master_address=address,
                master_port=port,
                rank_offset=e.rank_offset,
                world_size=world_size,
                group_name=s.group_name,
                backend=backend_to_proto(s.backend),
                timeout=duration(s.group_timeout_s),
                owner=self._fleet.owner,
                trainer_ranks=self._peers.trainer_ranks,
            )
            try:
                call = self._fleet.submit(functools.partial(self._start_init, e, req, rpc_deadline))
            except Exception as exc:
                failures[e.target] = EngineFailure.from_exception(e.target, "Init", exc)
                continue
            call.add_done_callback(lambda _f: events.set())
            futures[e.target] = call
        return futures, failures

    def _start_init(self, e: RemoteEngine, req: pb.InitRequest, deadline: float) -> Awaitable[pb.InitResponse]:
        """Start ``Init`` on ``e`` (on the client's event loop)."""
        return self._fleet.aio(e).Init(req, timeout=deadline, metadata=self._fleet.metadata)

    def _rank_mismatches(self, replies: Mapping[str, pb.InitResponse]) -> dict[str, EngineFailure]:
        """target -> failure for every engine whose Init reply has other ranks than assigned."""
        failures: dict[str, EngineFailure] = {}
        for e in self._fleet.engines:
            r = replies.get(e.target)
            expected = list(range(e.rank_offset, e.rank_offset + e.workers))
            if r is not None and list(r.group.ranks) != expected:
                failures[e.target] = EngineFailure(
                    e.target,
                    "Init",
                    None,
                    "RANK_MISMATCH",
                    f"joined at ranks {list(r.group.ranks)}, expected {expected}",
                )
        return failures

    # ------------------------------------------------------------------ leaving the group

    def cancel_updates(self, reason: str) -> dict[str, pb.CancelResponse]:
        """Cancel whatever update is in flight on every engine; the group goes stale where one was abandoned.

        Raises:
            EngineCallError: some engine failed.
        """
        results, failures = self._fleet.gather("Cancel", lambda e: self._fleet.start_cancel(e, "", reason))
        if any(r.cancelled for r in results.values()) or failures:
            self._needs_init = True
        if failures:
            raise EngineCallError(
                f"Cancel failed on {len(failures)} engine(s): {failure_lines(failures)}",
                rpc="Cancel",
                failures=failures,
                results=results,
            )
        return results

    def leave(self) -> dict[str, pb.LeaveResponse]:
        """Every engine leaves the group, then the trainer does (even when some engine failed).

        Raises:
            EngineCallError: some engine failed.
        """
        try:
            return self._fleet.leave(self._settings.rpc_timeout_s)
        finally:
            self.drop()

    def leave_on_close(self) -> None:
        """Best effort :meth:`leave` (calls of at most 10 s; errors logged, not raised), if a group was ever formed."""
        if self._init_attempted:
            try:
                self._fleet.leave(min(self._settings.rpc_timeout_s, 10.0))
            except EngineCallError as err:
                log.warning("leaving the weight-sync group on close: %s", err)
        self.drop()

    def hold_leases(self) -> None:
        """Hold the client's lease on every engine (one ``KeepAlive`` each) until :meth:`close`; no group needed."""
        self._leases.start()

    def drop(self) -> None:
        """Destroy the trainer's side of the group and mark the client for re-init."""
        self._needs_init = True
        self._init_replies = {}
        self._formed_with = ()
        group, self.group = self.group, None
        if group is not None:
            group.destroy()


class _TrainerJoin:
    """The trainer's own join (at its rank), in a helper thread, while the engines' Init calls are in flight.

    Attributes:
        thread: the helper thread (started by :meth:`run_until_done_or_failed`).
        group: the trainer's membership once joined (unless abandoned first).
        error: why the join failed, if it did.
        abandoned: set when the formation gave up; a join that ends after it destroys its group.
    """

    def __init__(
        self,
        settings: ClientSettings,
        peers: TrainerPeers,
        address: str,
        port: int,
        world_size: int,
        events: threading.Event,
    ) -> None:
        self._settings = settings
        self._address = address
        self._rank = peers.rank
        self._trainer_ranks = peers.trainer_ranks
        self._port = port
        self._world_size = world_size
        self._events = events
        self.group: WeightSyncGroup | None = None
        self.error: BaseException | None = None
        self.abandoned = threading.Event()
        self.thread = threading.Thread(target=self._join, name="wsync-trainer-join", daemon=True)

    def _join(self) -> None:
        s = self._settings
        try:
            g = join_group(
                master_address=self._address,
                master_port=self._port,
                rank=self._rank,
                world_size=self._world_size,
                group_name=s.group_name,
                backend=s.backend,
                device=s.device,
                timeout_s=s.group_timeout_s,
                trainer_ranks=self._trainer_ranks,
            )
        except BaseException as exc:
            self.error = exc
        else:
            if self.abandoned.is_set():
                g.destroy()
            else:
                self.group = g
        finally:
            self._events.set()

    def run_until_done_or_failed(self, futures: Mapping[str, Future[pb.InitResponse]]) -> None:
        """Start the join; return when it ended, or as soon as one of ``futures`` (the Init calls) failed."""
        self.thread.start()
        while True:
            self._events.wait(0.5)
            self._events.clear()
            if not self.thread.is_alive():
                break
            failed_early = [t for t, f in futures.items() if f.done() and f.exception() is not None]
            if failed_early:
                break
        self.thread.join(0)

    def failure(self, *, others_failed: bool) -> EngineFailure | None:
        """The trainer's failure: its join's error, or ABANDONED when it did not join and nothing else failed."""
        if self.error is not None:
            return EngineFailure.from_exception(TRAINER, "join", self.error)
        if self.group is None and not others_failed:
            return EngineFailure(
                TRAINER,
                "join",
                None,
                "ABANDONED",
                "the trainer stopped joining after an engine's Init failed",
            )
        return None


def _collect_inits(
    futures: Mapping[str, Future[pb.InitResponse]],
) -> tuple[dict[str, pb.InitResponse], dict[str, EngineFailure]]:
    """Wait for every Init call (each bounded by its deadline): target -> reply, target -> failure."""
    replies: dict[str, pb.InitResponse] = {}
    failures: dict[str, EngineFailure] = {}
    for target, fut in futures.items():
        try:
            replies[target] = fut.result()
        except Exception as exc:
            failures[target] = EngineFailure.from_exception(target, "Init", exc)
    return replies, failures
