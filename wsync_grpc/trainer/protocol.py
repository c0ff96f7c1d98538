"""The calls of one update over every engine, and the failure protocol when it fails.

Whatever carries the bytes (a broadcast over the group, or each engine reading a checkpoint; both
run by :class:`~wsync_grpc.trainer.runner.UpdateRunner`), an update runs the same calls,
held by :class:`UpdateProtocol`: the streaming Prepare to every engine at once (each replying once
it is ready to receive), the held ``Watch`` calls that notice a dead engine or trainer
(:class:`~wsync_grpc.trainer.liveness.Holds`), the transfer, and Complete everywhere.

A staged update commits in two phases, so that the fleet publishes the new
version on every engine or on none (``docs/architecture.md``, "Fleet commit"):
``Complete(verify_only)`` everywhere, then, only once every engine verified,
the applying ``Complete`` everywhere. A failure before that cancels the update
everywhere; after it, the engines that can apply do, and the error names those
that could not (the one window: an engine failing in its own apply).

The failure protocol (:meth:`UpdateProtocol.abandon`): when any engine fails (or the trainer's
send does), no further byte is sent, the update is cancelled on every engine that did not
complete it, the trainer leaves the group, and one :class:`~wsync_grpc.trainer.results.SyncError`
names every failed engine with its gRPC code, ``google.rpc.ErrorInfo`` reason and message; the
next sync re-initializes the group.

Every update is one trace (:mod:`wsync_grpc.trainer.tracing`), opened and closed by
:meth:`UpdateProtocol.run`.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.deadline import CancelSignal
from wsync_grpc.trainer.digests import DigestCourier
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.liveness import Holds
from wsync_grpc.trainer.membership import Membership
from wsync_grpc.trainer.metrics import TrainerMetrics
from wsync_grpc.trainer.request import UpdateRequest
from wsync_grpc.trainer.results import (
    TRAINER,
    ClientError,
    Commit,
    EngineFailure,
    EngineSyncResult,
    InitError,
    SyncError,
    SyncResult,
    engine_result,
    failure_lines,
)
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.tracing import SyncTrace
from wsync_grpc.transports.sending import TrainerPeers
from wsync_grpc.wire.convert import duration, header_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """Every engine's Prepare reply, and when the update's first Prepare was sent.

    Attributes:
        replies: target -> ``PrepareResponse``.
        started: when the first Prepare was sent (``time.monotonic()``, seconds).
        seconds: from then to the last reply, in seconds.
    """

    replies: dict[str, pb.PrepareResponse]
    started: float
    seconds: float


class UpdateProtocol:
    """Runs the calls of one update at a time over the client's engines (the caller holds the client's op lock).

    Args:
        fleet: the engines.
        membership: the trainer's group membership (re-formed when stale, left when an update fails).
        settings: the client's settings (timeouts are read at every update).
        cancel_event: the client's cancel signal; set, it stops the update at its next wait.
        peers: the trainer's ranks (they follow an update run again).
        release: drops what the trainer's senders keep between updates (called when an update is abandoned).
        metrics: the client's Prometheus metrics.
    """

    def __init__(
        self,
        fleet: Fleet,
        membership: Membership,
        settings: ClientSettings,
        cancel_event: CancelSignal,
        peers: TrainerPeers,
        release: Callable[[], None],
        metrics: TrainerMetrics,
    ) -> None:
        self._fleet = fleet
        self._membership = membership
        self._settings = settings
        self._cancel_event = cancel_event
        self._peers = peers
        self._release = release
        self._metrics = metrics
        self._holds: Holds | None = None
        self._outer: list[Holds] = []  # the engines of updates waiting between their commit phases, still held
        self._trace: SyncTrace  # one per run

    # ------------------------------------------------------------------ the update as a whole

    def run(self, request: UpdateRequest, body: Callable[[], SyncResult]) -> SyncResult:
        """Run ``body`` (one whole update) as one trace, ended with its outcome.

        Raises:
            ClientError: the client was closed (before ``body`` runs); whatever ``body`` raises.
        """
        if self._membership.closed:
            raise ClientError("the client is closed")
        n = len(self._fleet.engines)
        self._trace = SyncTrace(request.update_id, request.weight_version, request.apply_mode.value, n)
        try:
            result = body()
        except BaseException as e:
            self._trace.end(e)
            raise
        self._trace.end()
        return result

    def phase(self, name: str) -> None:
        """Start the trace's span of phase ``name`` (``"plan"``, ``"broadcast"``...), ending the previous one."""
        self._trace.begin(name)

    def ensure_group(self, request: UpdateRequest) -> tuple[float, WeightSyncGroup]:
        """(Re-)initialize the group if it is stale; returns the time it took, in seconds, and the group.

        Raises:
            SyncError: the group did not form (stage ``"init"``).
        """
        t_init = time.monotonic()
        if self._membership.needs_init:
            self._trace.begin("init")
            try:
                self._membership.form()
            except InitError as e:
                raise self.abandon(request, "init", e.failures) from e
        init_s = time.monotonic() - t_init
        self._cancel_event.clear()
        group = self._membership.group
        assert group is not None
        return init_s, group

    def digest_courier(self, request: UpdateRequest) -> DigestCourier:
        """A courier that declares ``request``'s bucket digests to every engine as they are hashed."""
        return DigestCourier(self._fleet, request.update_id, self._settings.rpc_timeout_s)

    def hold_engines(self) -> tuple[float, None]:
        """For an update without a group (disk): clear the cancel signal and hold every engine's lease.

        The leases are released at once when the client closes, as after an init. Returns what
        :meth:`ensure_group` does for an update without a group: no time spent on it, no group.
        """
        self._cancel_event.clear()
        self._membership.hold_leases()
        return 0.0, None

    def repeating(self) -> None:
        """The update that failed runs again over fewer engines: the trainer's other ranks follow it
        (:meth:`TrainerPeers.repeating <wsync_grpc.transports.sending.TrainerPeers.repeating>`).

        Raises:
            Exception: a trainer rank is gone.
        """
        self._peers.repeating()

    def applied(self, request: UpdateRequest, result: SyncResult) -> SyncResult:
        """Record a successful update and report its last phase; returns ``result``."""
        self._metrics.sync_applied(result)
        request.report("applied")
        return result

    # ------------------------------------------------------------------ Prepare

    def prepare(
        self, request: UpdateRequest, header: UpdateHeader, messages: Sequence[pb.PrepareRequest] = ()
    ) -> Prepared:
        """One Prepare stream (``header``, then ``messages``) per engine, concurrently.

        Every engine replies once it is ready to receive (its receivers armed, or its checkpoint
        validated).

        Raises:
            SyncError: some engine failed, or ``cancel()`` was called meanwhile (stage ``"prepare"``).
        """
        first = pb.PrepareRequest(header=header_to_proto(header, self._fleet.owner))

        def stream(target: str) -> Iterator[pb.PrepareRequest]:
            own = request.header_for(header, target)  # a delta names each engine's own identity of its base
            yield first if own is header else pb.PrepareRequest(header=header_to_proto(own, self._fleet.owner))
            yield from messages

        t0 = time.monotonic()
        self._trace.begin("prepare")
        metadata = self._trace.metadata(self._fleet.metadata)
        replies, failures = self._fleet.gather(
            "Prepare",
            lambda e: self._fleet.aio(e).Prepare(
                stream(e.target), timeout=self._cancel_event.bound(self._settings.rpc_timeout_s), metadata=metadata
            ),
        )
        prepare_s = time.monotonic() - t0
        if not failures and self._cancel_event.is_set():
            failures[TRAINER] = self._cancel_event.failure("Prepare")
        if failures:
            raise self.abandon(request, "prepare", failures)
        return Prepared(replies, t0, prepare_s)

    # ------------------------------------------------------------------ transfer and commit

    def transfer_and_commit(
        self,
        request: UpdateRequest,
        prepared: Prepared,
        transfer: Callable[[], float] | None,
        before_commit: Callable[[], None] | None = None,
    ) -> Commit:
        """Everything after Prepare replied, every engine held: ``transfer`` (the send; it returns
        its packing seconds; ``None`` when the engines read the bytes themselves), then Complete, in
        two phases for a staged update.

        ``before_commit`` (a staged update's only) runs once every engine verified, before the applying
        Complete: another update over other engines that commits with this one (a delta to the engines at its
        base while this one carries the whole weights to those behind: :class:`~wsync_grpc.trainer.delta.DeltaSync`;
        the broadcast part of a mixed fleet: :mod:`~wsync_grpc.trainer.mixed`). The engines stay held while it runs
        (an engine whose update is held by no call takes the trainer for dead and abandons it), and the hook's
        update applies only while they still are; if it raises, this update is cancelled everywhere and its error
        goes on.

        Returns:
            The per-engine results in target order, and the phases' timings.

        Raises:
            SyncError: the transfer's own, or see :meth:`_verify` and :meth:`_complete`; ``before_commit``'s.
        """
        request.report("prepared")
        # Held from Prepare's reply to Complete's: a dead engine or trainer is noticed at once.
        self._holds = Holds(
            self._fleet.streams,
            self._fleet.engines,
            request.update_id,
            self._fleet.metadata,
            self._fleet.owner,
            self._cancel_event,
        )
        try:
            t_transfer, pack_s = time.monotonic(), 0.0
            if transfer is not None:
                self._trace.begin("broadcast")
                pack_s = transfer()
                request.report("broadcast")
            t_complete = time.monotonic()
            verify_s = 0.0
            if request.apply_mode is ApplyMode.STAGED:
                self._trace.begin("verify")
                self._verify(request)
                verify_s = time.monotonic() - t_complete
                request.report("verified")
                if before_commit is not None:
                    self._run_before_commit(request, before_commit)
                lost = {t: f for h in self._outer for t, f in h.failures.items()}
                if lost:  # an engine of an update this one commits with is gone: neither applies
                    raise self.abandon(request, "verify", lost, broadcast_started=True)
            results, done = self._complete(request, prepared.replies)
        finally:
            holds, self._holds = self._holds, None
            if holds is not None:
                holds.close()
        in_order = {e.target: results[e.target] for e in self._fleet.engines}
        return Commit(in_order, done, t_complete, verify_s, t_complete - t_transfer, pack_s)

    def _run_before_commit(self, request: UpdateRequest, before_commit: Callable[[], None]) -> None:
        """Run ``before_commit`` between this verified update's two phases, its engines still held (a death among them
        sets the cancel signal, which stops the hook's update, and the hook's update applies only while none is
        lost: :meth:`transfer_and_commit`); this update's holds and trace put back afterwards (the hook runs an
        update of its own through this protocol, holding its own engines).

        Raises:
            SyncError: an engine of this update was lost meanwhile (stage ``"verify"``), the hook's own failure its
                consequence; this update was cancelled everywhere.
            BaseException: otherwise ``before_commit``'s, once this update was cancelled everywhere.
        """
        holds, self._holds = self._holds, None
        if holds is not None:
            self._outer.append(holds)
        trace = self._trace
        try:
            before_commit()
        except BaseException as exc:
            self._trace, self._holds = trace, holds
            own = self.abandon(request, "verify", {}, broadcast_started=True)  # cancelled everywhere
            if own.failures and isinstance(exc, SyncError):  # an engine of this one was lost: the hook's cause
                raise own from exc
            raise
        finally:
            if holds is not None:
                self._outer.remove(holds)
        self._trace, self._holds = trace, holds

    def _verify(self, request: UpdateRequest) -> None:
        """The first phase of a staged update's commit: ``Complete(verify_only)`` everywhere.

        Raises:
            SyncError: some engine failed (stage ``"verify"``); the update was cancelled everywhere.
        """
        _, failures = self._complete_everywhere(request, verify_only=True)
        if self._cancel_event.is_set():  # the calls not waited for say nothing: why the sync was cancelled does
            failures = {t: f for t, f in failures.items() if f.code != grpc.StatusCode.CANCELLED}
            lost = self._holds.failures if self._holds is not None else {}
            if not lost:  # no engine lost: the deadline, or cancel()
                failures[TRAINER] = self._cancel_event.failure("verify")
            failures.update(lost)
        if failures:
            raise self.abandon(request, "verify", failures, broadcast_started=True)

    def _complete(
        self, request: UpdateRequest, prepared: Mapping[str, pb.PrepareResponse]
    ) -> tuple[dict[str, EngineSyncResult], float]:
        """Complete everywhere; returns target -> result and when the last reply came (``time.monotonic()``).

        Raises:
            SyncError: some engine failed (stage ``"apply"`` for a staged update, whose every engine had
                verified it; ``"complete"`` for a streaming one); ``results`` has the engines that applied it.
        """
        self._trace.begin("apply")
        completed, failures = self._complete_everywhere(request, verify_only=False)
        done = time.monotonic()
        results = {t: engine_result(t, r, prepared[t]) for t, r in completed.items()}
        if failures:
            stage = "apply" if request.apply_mode is ApplyMode.STAGED else "complete"
            raise self.abandon(request, stage, failures, results, broadcast_started=True)
        return results, done

    def _complete_everywhere(
        self, request: UpdateRequest, *, verify_only: bool
    ) -> tuple[dict[str, pb.CompleteResponse], dict[str, EngineFailure]]:
        """One ``Complete`` per engine, concurrently, carrying the current phase's trace context.

        A verifying Complete (and a streaming update's only one) ends by the sync's deadline
        (:meth:`CancelSignal.bound <wsync_grpc.trainer.deadline.CancelSignal.bound>`); the applying Complete
        of a staged update that every engine verified is the commit and gets its whole timeouts. The verifying
        ones are not waited for once the sync's cancel signal is set (an engine held was lost, the deadline
        passed, or ``cancel()``): the update is abandoned then whatever they answer, and an engine whose
        receive waits for bytes that will never come would hold it up to the group timeout.
        """
        commit = not verify_only and request.apply_mode is ApplyMode.STAGED
        engine_s, call_s = self._settings.group_timeout_s, self._settings.timeouts.group_rpc_s
        if not commit:
            engine_s, call_s = self._cancel_event.bound(engine_s), self._cancel_event.bound(call_s)
        req = pb.CompleteRequest(
            update_id=request.update_id,
            flush_cache=request.flush_cache and not verify_only,
            timeout=duration(engine_s),
            owner=self._fleet.owner,
            verify_only=verify_only,
        )
        metadata = self._trace.metadata(self._fleet.metadata)
        return self._fleet.gather(
            "Complete",
            lambda e: self._fleet.aio(e).Complete(req, timeout=call_s, metadata=metadata),
            stop=self._cancel_event if verify_only else None,
        )

    # ------------------------------------------------------------------ the failure protocol

    def _name_ended(self, update_id: str, cancelled: Mapping[str, bool], failures: dict[str, EngineFailure]) -> None:
        """Name why the update ended on engines not named yet: their ``GetStatus`` last error, when it is this
        update's and not the trainer's own cancel. An engine may have ended it on its own (Cancel found nothing
        to cancel), or its receiver may have quit on a finding of its own (a bucket that arrived corrupted, a
        storage that shrank) which broke the trainer's send before the engine's held ``Watch`` ended: the engine
        records that finding, not the cancel that followed it."""
        unnamed = [e for e in self._fleet.engines if e.target in cancelled and e.target not in failures]
        if not unnamed:
            return
        statuses, _ = self._fleet.gather("GetStatus", self._fleet.start_get_status, unnamed)
        for t, st in statuses.items():
            err = st.last_error
            ours = cancelled[t] and err.reason == "UPDATE_CANCELLED"
            if st.HasField("last_error") and err.update_id == update_id and err.reason and not ours:
                failures[t] = EngineFailure(t, "update", None, err.reason, err.message)

    def abandon(
        self,
        request: UpdateRequest,
        stage: str,
        failures: Mapping[str, EngineFailure],
        results: Mapping[str, EngineSyncResult] | None = None,
        broadcast_started: bool = False,
    ) -> SyncError:
        """The failure protocol: Cancel everywhere, leave the group (if one was formed), build the one error to raise.

        Args:
            stage: where it failed (:attr:`SyncError.stage`).
            failures: target (or :data:`~wsync_grpc.trainer.results.TRAINER`) -> why.
            results: the engines that applied it already (stage ``"apply"``/``"complete"``).
            broadcast_started: whether any byte was sent.

        Returns:
            The :class:`SyncError` to raise (this method raises nothing itself).
        """
        update_id, weight_version, results = request.update_id, request.weight_version, results or {}
        all_failures = dict(failures)
        lost: set[str] = set()
        if self._holds is not None:  # engines whose stream ended first: dead, or their update failed
            for t, f in self._holds.stop().items():
                all_failures.setdefault(t, f)
                lost.add(t)  # no Cancel: the end of its held Watch already failed its update, if it lives
        cancelled: dict[str, bool] = {}
        cancel_failures: dict[str, EngineFailure] = {}
        if stage != "init":
            # Cancel is idempotent: engines that rejected Prepare (or completed)
            # answer cancelled = false and keep their state.
            pending = [e for e in self._fleet.engines if e.target not in results and e.target not in lost]
            replies, cancel_failures = self._fleet.gather(
                "Cancel",
                lambda e: self._fleet.start_cancel(e, update_id, f"the trainer abandoned the update ({stage} failed)"),
                pending,
            )
            cancelled = {t: r.cancelled for t, r in replies.items()}
            if broadcast_started:
                self._name_ended(update_id, cancelled, all_failures)
        had_group = self._membership.group is not None
        self._membership.drop()
        self._release()  # a send abandoned half-way may still read its buffers
        for t, f in cancel_failures.items():
            all_failures.setdefault(t, f)
        engine_failures = len([t for t in all_failures if t != TRAINER])
        where = [f"{engine_failures} of {len(self._fleet.engines)} engine(s)"] if engine_failures else []
        where += ["the trainer"] if TRAINER in all_failures else []
        parts = [
            f"sync of weight version {weight_version!r} (update {update_id}) failed at {stage} on "
            f"{' and '.join(where) or 'no engine'}: {failure_lines(all_failures)}"
        ]
        if not broadcast_started and stage != "init":
            parts.append("no byte was broadcast")
        if any(cancelled.values()):
            parts.append("cancelled on " + ", ".join(t for t, c in cancelled.items() if c))
        if results:
            parts.append(f"applied on {', '.join(results)} (they serve {weight_version!r} now)")
        if had_group:
            parts.append("the trainer left the group; the next sync re-initializes it")
        log.warning("%s", "; ".join(parts))
        self._metrics.sync_failed(stage)
        return SyncError(
            "; ".join(parts),
            stage=stage,
            update_id=update_id,
            weight_version=weight_version,
            failures=all_failures,
            results=results,
            cancelled=cancelled,
            broadcast_started=broadcast_started,
        )
