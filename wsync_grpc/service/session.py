"""One weight update on the engine side, from its Prepare to its Complete or its failure.

An :class:`UpdateSession` owns what one update needs: its header; its
validator, kept for the whole update so that every Update is checked against
what Prepare and earlier Updates declared; the bucket feed its receivers
read; its cancel event; its receivers, one per worker, made by its transport
(:mod:`wsync_grpc.transports`) wherever the engine's weights live
(:mod:`wsync_grpc.service.workers`); its progress counters; the apply of its
payload at Complete (base weights or a LoRA adapter); and the failure policy.

Failure policy (``docs/architecture.md``, "Invariants"): a failed, timed-out
or cancelled update is abandoned: its receivers are cancelled, its feed
closed and its buffers released (never reused while a receive may still be
posted into them); the engine moves to FAILED and leaves the group, because
collectives already posted can no longer be matched, and a fresh Init starts
over. With staged apply the served weights are untouched. A streaming update
that already changed weights, or a staged apply that broke half-way, marks
the weights dirty and keeps the engine paused until an update succeeds or an
operator forces a Resume.

An update is also abandoned when it stays idle past the operator's limit (``--update-idle-timeout``):
no bucket arriving, no Update declaring more, no Complete running. A trainer that stalls with its
connection alive (its held ``Watch`` and ``KeepAlive`` still open) would otherwise hold the engine
forever; the update fails with DEADLINE_EXCEEDED / ``UPDATE_IDLE`` by the policy above, and the owner
loses the engine, so that another trainer can claim it.

Locking: the engine's lock (:attr:`~wsync_grpc.service.engine_state.EngineState.lock`)
comes before the adapter's own locks. Each method says whether it expects the
lock held, takes it, or must run without it (the bounded waits).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from opentelemetry.context import Context

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.engine import PauseMode, RemoteWorkers
from wsync_grpc.core.errors import (
    Aborted,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Phase,
    WsyncError,
    clip,
    domain_error,
)
from wsync_grpc.core.header import DELTA_TRANSPORTS
from wsync_grpc.core.layout import with_digests
from wsync_grpc.core.lifecycle import Event
from wsync_grpc.core.lora import LoraAdapters
from wsync_grpc.core.ownership import describe
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S, DEFAULT_UPDATE_IDLE_S, Deadline
from wsync_grpc.core.update import Payload, PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import BucketSpecFields, UpdateValidator
from wsync_grpc.service.engine_state import EngineState, may_step
from wsync_grpc.service.outcome import CompleteResult, PrepareResult, last_arrival
from wsync_grpc.service.status import Progress
from wsync_grpc.service.tracing import record_span
from wsync_grpc.service.workers import UpdateWorkers, update_workers
from wsync_grpc.transports import TransportPart
from wsync_grpc.worker.feed import BucketFeed
from wsync_grpc.worker.receiver import Receiver

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0
"""Longest time between two looks at an update's progress by its idle watch, in seconds."""


class UpdateSession:
    """One update in flight on one engine.

    Args:
        state: the engine-wide state.
        planned: what Prepare settled: the validated header, buckets and their source.
        transport: the update's transport (:func:`~wsync_grpc.transports.transport_for`).
        validator: the validator that read the Prepare stream (it holds what was declared).
        started: when the Prepare began, on the monotonic clock (seconds).
        idle_s: once armed, the update fails when idle (no bucket arriving, no Update, no Complete running)
            for this long, in seconds (default :data:`~wsync_grpc.core.timeouts.DEFAULT_UPDATE_IDLE_S`).

    Attributes:
        feed: the declared buckets, read by every receiver; closed at Complete or failure (at once if not incremental).
        cancel: set when the update is abandoned; every receiver's wait ends on it.
        header: the validated header.
        payload: base weights or a LoRA adapter.
        workers: where its receivers run, once :meth:`start` ran.
        receivers: one per worker, in worker order, once :meth:`start` ran.
        tensors: tensors declared so far.
        bytes: bytes declared so far (``size_bytes`` of every bucket), in bytes.
        armed_at: when the receivers were armed, on the monotonic clock (seconds).
        completing: the applying Complete was called (a held ``Watch`` no longer fails the update).
        verifying: a verifying Complete (``verify_only``) was called; no bucket may be declared any more.
        verified: every bucket arrived and was verified; the applying Complete only applies.
        auto_paused: the session paused the engine for a streaming update and resumes it afterwards.
        held_watches: the trainer's held ``Watch`` calls open on the update (:mod:`wsync_grpc.service.watch`).
        error: why the update failed; ``None`` while it has not.
        trace_context: the OpenTelemetry context of its Prepare span (:mod:`wsync_grpc.service.tracing`).
    """

    def __init__(
        self,
        state: EngineState[UpdateSession],
        planned: PlannedUpdate,
        transport: TransportPart,
        validator: UpdateValidator,
        started: float,
        idle_s: float = DEFAULT_UPDATE_IDLE_S,
    ) -> None:
        self.state = state
        self.idle_s = idle_s
        self.header = header = planned.header
        self.payload = Payload.of(header)
        self.transport = transport
        self.validator = validator
        buckets = planned.buckets
        self._buckets = tuple(buckets)
        self._files = planned.files
        self.started = started
        self.feed = BucketFeed()
        self.feed.extend(buckets)
        if not header.incremental:
            self.feed.close()
        self.cancel = threading.Event()
        self.workers: UpdateWorkers | None = None
        self.receivers: Sequence[Receiver] = []
        self.prepared_buckets = len(buckets)
        self.tensors = sum(len(b.tensors) for b in buckets)
        self.bytes = sum(b.size_bytes for b in buckets)
        self.armed_at: float | None = None
        self.completing = self.verifying = self.verified = False
        self.verify_s = 0.0
        self.auto_paused = False
        self.keeps_base = False
        """The engine's workers keep this update's tensors as the base of a later delta (set at :meth:`start`)."""
        self.held_watches = 0
        self.error: WsyncError | None = None
        self.trace_context: Context | None = None
        self.ended = threading.Event()
        """Set once the update was applied or failed (``Watch`` streams end on it)."""

    # ------------------------------------------------------------------ Prepare

    def start(self) -> None:
        """Freeze the engine for a streaming update, become the engine's update, start the receivers. Lock held."""
        eng = self.state
        if self.header.streaming and may_step(eng.engine):
            # Streaming apply changes weights bucket by bucket: freeze requests
            # between two steps until Complete. A WAIT pause does not stop the
            # requests it is draining (or failed to drain): freeze them too.
            self.auto_paused = not eng.engine.is_paused()
            eng.engine.pause(PauseMode.KEEP, DEFAULT_PAUSE_TIMEOUT_S)
        eng.start_update(self)
        h = self.header
        self.keeps_base = (
            h.delta_base
            and self.payload is Payload.WEIGHTS
            and h.transport in DELTA_TRANSPORTS
            and isinstance(eng.engine, RemoteWorkers)
        )
        plan = ReceivePlan(
            transport=h.transport,
            payload=self.payload,
            layout=h.layout,
            apply_mode=h.apply_mode,
            buckets=self._buckets,
            closed=self.feed.closed,
            files=self._files,
            timeout_s=eng.membership.group_timeout_s,
            digests_follow=h.digests_follow,
            update_id=h.update_id,
            shared_memory=h.shared_memory,
            shared_memory_ranks=h.shared_memory_ranks,
            keep_base=self.keeps_base,
        )
        self.workers = update_workers(
            eng.engine,
            eng.membership,
            eng.pools,
            self.transport,
            plan,
            self.feed,
            self.cancel,
            self._on_receiver_event,
        )
        self.receivers = self.workers.receivers
        self.workers.start()

    def wait_armed(self, timeout_s: float) -> None:
        """Wait until every receiver has posted its first receive, at most ``timeout_s`` seconds. Lock not held.

        Raises:
            DeadlineExceeded: ARM_TIMEOUT; the update has failed.
        """
        deadline = Deadline(timeout_s)
        for r in self.receivers:
            if not r.armed.wait(deadline.left()):
                err = DeadlineExceeded("ARM_TIMEOUT", f"the receivers were not armed within {timeout_s:g} s")
                self.fail(err)
                raise err
            if r.error is not None:
                failure = domain_error(r.error, Phase.RECEIVE, timeout_s=r.timeout_s)
                self.fail(failure)
                raise failure

    def armed(self) -> PrepareResult:
        """Move to RECEIVING (RECEIVED when every bucket already arrived). Lock held.

        Raises:
            WsyncError: the update failed while it was being armed.
        """
        if self.error is not None:
            raise self.error
        self.state.lifecycle.fire(Event.ARMED)
        self.armed_at = time.monotonic()
        threading.Thread(target=self._watch_idle, name="wsync-idle", daemon=True).start()
        # Receivers may have finished already (tiny updates): re-check.
        if self.receivers and all(r.buckets_done == len(self.feed) for r in self.receivers):
            self.state.lifecycle.fire_if(Event.ALL_RECEIVED)
        h = self.header
        result = PrepareResult(
            h.update_id, self.prepared_buckets, self.tensors, self.bytes, self.armed_at - self.started
        )
        log.info(
            "update %s (version %s): %d buckets, %d tensors, %d bytes armed in %.1f ms",
            clip(h.update_id),
            clip(h.weight_version),
            result.bucket_count,
            result.tensor_count,
            result.total_bytes,
            result.ready_seconds * 1e3,
        )
        return result

    # ------------------------------------------------------------------- Update

    def check_accepts_buckets(self) -> None:
        """Refuse further buckets for an update not prepared as incremental, or already completing. Lock held.

        Raises:
            FailedPrecondition: NOT_INCREMENTAL, COMPLETING.
        """
        if not self.header.incremental:
            raise FailedPrecondition("NOT_INCREMENTAL", "the update in flight was not prepared with incremental = true")
        if self.completing or self.verifying:
            raise FailedPrecondition("COMPLETING", "Complete was already called for this update")

    def check_accepts_digests(self) -> None:
        """Refuse digests declared after their buckets for an update that did not promise them, or one completing.

        Lock held.

        Raises:
            FailedPrecondition: DIGESTS_NOT_FOLLOWING, COMPLETING.
        """
        if not self.header.digests_follow:
            raise FailedPrecondition(
                "DIGESTS_NOT_FOLLOWING",
                "the update in flight was not prepared with digests_follow = true: its digests travel in its "
                "bucket specs, or not at all",
            )
        if self.completing or self.verifying:
            raise FailedPrecondition("COMPLETING", "Complete was already called for this update")

    def declare_digests(self, digests: Mapping[int, Digest]) -> None:
        """Record digests of buckets already declared (bucket index -> digest) for every worker. Lock held.

        All or none. The same digest declared again is accepted.

        Raises:
            InvalidArgument: UNKNOWN_BUCKET (an index not declared yet), DIGEST_CONFLICT (another digest
                than the bucket's spec's, or than one declared before).
        """
        declared = len(self.feed)
        for i, d in digests.items():
            if i >= declared:
                raise InvalidArgument(
                    "UNKNOWN_BUCKET",
                    f"a digest names bucket {i}, but {declared} bucket(s) are declared (0..{declared - 1})",
                    bucket=str(i),
                )
            bucket = self.feed.get(i, 0)
            known = (bucket.digest if bucket is not None else None) or self.feed.declared_digest(i)
            if known is not None and known != d:
                raise InvalidArgument(
                    "DIGEST_CONFLICT", f"bucket {i} has digest {known} already; {d} was declared", bucket=str(i)
                )
        if self.workers is not None:
            self.workers.declare([], closed=False, digests=digests)
        self.feed.add_digests(digests)

    def declare(self, specs: Sequence[BucketSpecFields], digests: Sequence[Digest | None] = ()) -> None:
        """Validate further buckets against what this update declared, and feed them to the receivers. Lock held.

        All or none: a refused batch changes nothing. ``digests`` are the specs' own (``None``: none;
        empty: no spec has one).

        Raises:
            InvalidArgument: see :meth:`~wsync_grpc.core.validation.UpdateValidator.bucket_messages`.
        """
        new = with_digests(self.validator.bucket_messages(specs), digests)
        if self.workers is not None:
            self.workers.declare(new, closed=False)
        self.feed.extend(new)
        self.tensors += sum(len(b.tensors) for b in new)
        self.bytes += sum(b.size_bytes for b in new)
        self.state.lifecycle.fire(Event.MORE_BUCKETS)

    # ----------------------------------------------------------------- Complete

    def begin_complete(self, verify_only: bool = False) -> None:
        """Mark the update completing (or verifying): no bucket may be declared any more. Lock held.

        Raises:
            Aborted: COMPLETE_IN_PROGRESS, Complete is already running.
            InvalidArgument: PARTIAL_FUSED_GROUP (incremental update; the update has failed).
        """
        if self.completing or (verify_only and self.verifying and not self.verified):
            raise Aborted("COMPLETE_IN_PROGRESS", "Complete is already running for this update")
        if not (self.verifying or self.completing):  # the first Complete: the declarations end here
            if self.header.incremental:
                try:
                    self.validator.check_whole()
                except WsyncError as e:
                    self.fail(e)
                    raise
            if self.workers is not None and (not self.feed.closed or self.header.digests_follow):
                self.workers.declare([], closed=True)  # no bucket, no digest any more
            self.feed.close_digests()
        if verify_only:
            self.verifying = True
        else:
            self.completing = True

    def wait_received(self, timeout_s: float) -> None:
        """Wait for every bucket on every worker (at most ``timeout_s`` seconds); move to RECEIVED. Lock not held.

        Raises:
            DeadlineExceeded: RECEIVE_TIMEOUT (the update has failed).
            WsyncError: a receiver failed, or the update failed meanwhile.
        """
        deadline = Deadline(timeout_s)
        for r in self.receivers:
            if not r.done.wait(deadline.left()):
                self.fail(
                    DeadlineExceeded(
                        "RECEIVE_TIMEOUT",
                        f"{r.buckets_done} of {len(self.feed)} buckets arrived within the Complete timeout "
                        f"of {timeout_s:g} s",
                    )
                )
                break
            if r.error is not None:
                self.fail(domain_error(r.error, Phase.RECEIVE, timeout_s=r.timeout_s))
                break
        with self.state.lock:
            if self.error is not None:
                raise self.error
            self.state.lifecycle.fire_if(Event.ALL_RECEIVED)

    def verify(self, timeout_s: float) -> CompleteResult:
        """The first phase of a two-phase Complete: wait for every bucket, apply nothing. Lock not held.

        Staged updates are then ready beside the served weights (on engines
        that prepare them, such as vLLM's, prepared too); the engine keeps
        serving the old ones until the applying :meth:`complete`.

        Raises:
            see :meth:`wait_received`.
        """
        t0 = time.monotonic()
        self.wait_received(timeout_s)
        with self.state.lock:
            if self.error is not None:
                raise self.error
            self.verified = True
            self.verify_s = time.monotonic() - t0
            return self._verified_result(time.monotonic())

    def complete(self, timeout_s: float, flush_cache: bool) -> CompleteResult:
        """Wait for every bucket (at most ``timeout_s`` seconds), apply, publish the weight version. Lock not held.

        Raises:
            DeadlineExceeded: RECEIVE_TIMEOUT.
            WsyncError: the receive or the apply failed (the update has failed).
        """
        deadline = Deadline(timeout_s)
        self.wait_received(deadline.left())
        with self.state.lock:
            if self.error is not None:
                raise self.error
            self.state.lifecycle.fire(Event.APPLY)
        return self._apply(flush_cache, deadline.left(minimum=1.0))

    def _apply(self, flush_cache: bool, timeout_s: float) -> CompleteResult:
        eng = self.state
        t0 = time.monotonic()
        try:
            with eng.engine.weights_lock():
                self._apply_payload(timeout_s)
                if flush_cache:
                    eng.engine.flush_cache()
        except BaseException as e:
            err = domain_error(e)
            with eng.lock:
                self.fail(err)
                if not self.header.streaming and self.payload is Payload.WEIGHTS:
                    # A staged apply that broke half-way is as dirty as a streaming one.
                    eng.mark_dirty(self.auto_paused)
            raise err from e
        done = time.monotonic()
        with eng.lock:
            for r in self.receivers:
                r.release(reuse=True)
            eng.record_applied(self, base=self.payload is Payload.WEIGHTS)
            self.ended.set()
        result = self._applied_result(t0, done, flush_cache)
        self._record_applied(result)
        return result

    def _apply_payload(self, timeout_s: float) -> None:
        """Base weights into the served model (the version published with them), or the LoRA adapter. Weights lock.

        An adapter keeps its own version; the base weights and their version stay.
        """
        assert self.workers is not None
        h = self.header
        if self.payload is Payload.WEIGHTS:
            self.workers.apply_weights(timeout_s, h.weight_version)
            return
        engine = self.state.engine
        assert isinstance(engine, LoraAdapters) and h.adapter is not None, "validated at Prepare"
        tensors = self.workers.adapter_tensors(timeout_s)
        self.receivers[0].tensors_applied = engine.load_adapter(h.adapter, h.weight_version, tensors)

    # ----------------------------------------------------------------- progress

    def progress_mark(self) -> tuple[int, int, int, bool]:
        """What changes whenever the update moves: buckets and bytes received, buckets declared, verified."""
        received = sum(r.buckets_done for r in self.receivers)
        return received, sum(r.bytes_done for r in self.receivers), len(self.feed), self.verified

    def _watch_idle(self) -> None:
        """Fail the update once it has been idle for :attr:`idle_s` seconds (runs until it ends).

        A Complete running is not idleness (its own timeout bounds it); the end of a verifying Complete is progress.
        """
        mark, since = self.progress_mark(), time.monotonic()
        while not self.ended.wait(min(IDLE_POLL_S, self.idle_s / 4)):
            now, current = time.monotonic(), self.progress_mark()
            if current != mark or self.completing or (self.verifying and not self.verified):
                mark, since = current, now
            elif now - since >= self.idle_s:
                self._fail_idle(now - since)
                return

    def _fail_idle(self, idle_s: float) -> None:
        """Abandon the idle update and take the engine from its owner, so that another trainer may claim it."""
        eng = self.state
        err = DeadlineExceeded(
            "UPDATE_IDLE",
            f"no bucket arrived and no Complete came for {idle_s:.1f} s (the engine's update idle limit is "
            f"{self.idle_s:g} s); the update is abandoned and its owner loses the engine",
        )
        with eng.lock:
            if eng.update is not self:
                return
            self.fail(err)
            owner = eng.ownership.owner
            eng.ownership.release()
        log.warning(
            "update %s idle for %.1f s: abandoned; %s loses the engine",
            clip(self.header.update_id),
            idle_s,
            describe(owner) if owner is not None else "no owner",
        )

    def progress(self) -> Progress:
        """Where the update stands (the slowest worker's counts; sizes in bytes, times in seconds). Lock held."""
        h = self.header
        return Progress(
            update_id=h.update_id,
            weight_version=h.weight_version,
            layout=h.layout,
            apply_mode=h.apply_mode,
            buckets_expected=len(self.feed),
            buckets_received=min((r.buckets_done for r in self.receivers), default=0),
            bytes_expected=self.bytes,
            bytes_received=min((r.bytes_done for r in self.receivers), default=0),
            elapsed_seconds=time.monotonic() - self.started,
            incremental=h.incremental,
        )

    # ----------------------------------------------------------------- results

    def _result(
        self, done: float, *, version: str, applied: int, apply_s: float, flushed: bool, verified_only: bool
    ) -> CompleteResult:
        """What the update reports at ``done`` (monotonic seconds); the keywords are what differs between replies."""
        armed = self.armed_at or self.started
        r0 = self.receivers[0] if self.receivers else None
        return CompleteResult(
            update_id=self.header.update_id,
            weight_version=version,
            bucket_count=r0.buckets_done if r0 else 0,
            tensor_count=applied,
            bytes_received=r0.bytes_done if r0 else 0,
            receive_seconds=max(0.0, last_arrival(self.receivers, done) - armed),
            apply_seconds=apply_s,
            total_seconds=done - self.started,
            cache_flushed=flushed,
            verified_only=verified_only,
            prepare_seconds=armed - self.started,
            verify_seconds=self.verify_s,
            buckets_verified=min((r.buckets_verified for r in self.receivers), default=0),
        )

    def _verified_result(self, done: float) -> CompleteResult:
        """The result of the update verified at ``done`` (monotonic seconds): the served version is unchanged."""
        log.info(
            "update %s verified: every bucket arrived; waiting for the applying Complete", clip(self.header.update_id)
        )
        served = self.state.weight_version
        return self._result(done, version=served, applied=0, apply_s=0.0, flushed=False, verified_only=True)

    def _applied_result(self, t0: float, done: float, flush_cache: bool) -> CompleteResult:
        """The result of the update applied from ``t0`` to ``done`` (monotonic seconds), logged."""
        applied = self.receivers[0].tensors_applied if self.receivers else 0
        result = self._result(
            done,
            version=self.header.weight_version,
            applied=applied,
            apply_s=done - t0,
            flushed=flush_cache,
            verified_only=False,
        )
        if self.payload is Payload.WEIGHTS:
            result = dataclasses.replace(result, weight_identity=self.state.weight_identity)
        log.info(
            "update %s applied: version %s, %d tensors, %d bytes, %.3f s total",
            clip(result.update_id),
            clip(result.weight_version),
            result.tensor_count,
            result.bytes_received,
            result.total_seconds,
        )
        return result

    def _record_applied(self, result: CompleteResult) -> None:
        """Count the applied update in the engine's metrics (its phases, in seconds)."""
        phases = {"prepare": result.prepare_seconds, "receive": result.receive_seconds}
        if self.verified:
            phases["verify"] = result.verify_seconds
        phases["apply"] = result.apply_seconds
        self.state.metrics.update_applied(phases, result.total_seconds, sum(r.bytes_done for r in self.receivers))

    def _record_failed(self, err: WsyncError) -> None:
        """Count the failed update in the engine's metrics (cancelled when ``err`` says it was asked for)."""
        cancelled = err.reason in ("UPDATE_CANCELLED", "SHUTDOWN")
        received = sum(r.bytes_done for r in self.receivers)
        self.state.metrics.update_failed(err.reason, cancelled, time.monotonic() - self.started, received)

    def trace_receive(self) -> None:
        """Record the ``wsync.engine.receive`` span: armed receivers to the last bucket's arrival."""
        if self.trace_context is None or self.armed_at is None or not self.receivers:
            return
        last = last_arrival(self.receivers, self.armed_at)
        record_span(
            "wsync.engine.receive",
            self.trace_context,
            self.armed_at,
            last,
            update_id=self.header.update_id,
            buckets=len(self.feed),
        )

    # ------------------------------------------------------------------ failure

    def fail(self, err: WsyncError) -> None:
        """Abandon the update: stop its receivers, leave the group, move to FAILED, record ``err``.

        Idempotent, and a no-op once the update is no longer the engine's
        update (applied, or failed already). Takes the lock. A cancel (UPDATE_CANCELLED) that
        follows a receiver's finding about what the trainer sent (a :class:`DataLoss` it raised: a
        digest mismatch, a shrunk shared-memory storage; an :class:`InvalidArgument`: a storage that
        is no shared-memory file) records that finding: the receiver quit first, and the trainer's
        cancel only answered the transfer it broke. A receiver's other
        errors (the trainer's socket closed, a peer lost) may follow from the trainer's own abort:
        the cancel stands.
        """
        eng = self.state
        with eng.lock:
            if self.error is not None or eng.update is not self:
                return
            if err.reason == "UPDATE_CANCELLED":
                err = next((r.error for r in self.receivers if isinstance(r.error, DataLoss | InvalidArgument)), err)
            self.error = err
            self.cancel.set()
            self.feed.close_digests()
            applied = any(r.tensors_applied or r.wrote_served for r in self.receivers)
            for r in self.receivers:
                # A receive may still be posted into these buffers: never reuse them.
                r.release(reuse=r.done.is_set() and r.error is None)
            eng.record_failed(self, err)
            self.ended.set()
            self._record_failed(err)
            log.warning(
                "update %s (version %s) failed: %s %s",
                clip(self.header.update_id),
                clip(self.header.weight_version),
                err.reason,
                clip(err.message),
            )
            if self.header.streaming and applied:
                eng.mark_dirty(self.auto_paused)
                log.error("streaming update failed half-way: weights are dirty, the engine stays paused")
            elif self.auto_paused:
                eng.engine.resume()

    def _on_receiver_event(self, r: Receiver) -> None:
        """A receiver got a bucket or ended: fail the update on an error, move to RECEIVED once all arrived."""
        eng = self.state
        with eng.lock:
            if eng.update is not self or r not in self.receivers:
                return
            if r.error is not None:
                err = domain_error(r.error, Phase.RECEIVE, timeout_s=r.timeout_s)
                threading.Thread(target=self.fail, args=(err,), daemon=True).start()
                return
            declared = len(self.feed)
            if all(x.buckets_done == declared for x in self.receivers):
                eng.lifecycle.fire_if(Event.ALL_RECEIVED)
