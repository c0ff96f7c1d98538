"""One update pushed from the trainer to every engine, and the failure protocol when it fails.

Steps (:meth:`SyncRunner.run`): bucket planning (:class:`~wsync_grpc.trainer.planning.Planner`);
(re-)initializing a stale group; the streaming Prepare (header, then the bucket messages) to every
engine at once, each replying once its receivers are armed; the broadcast of every bucket
(:mod:`wsync_grpc.transports.broadcast.sender`); Complete everywhere; per-engine results and timings.
A disk update (:mod:`wsync_grpc.trainer.disk`) shares everything after Prepare.

A staged update commits in two phases, so that the fleet publishes the new
version on every engine or on none (``docs/architecture.md``, "Fleet commit"):
``Complete(verify_only)`` everywhere, then, only once every engine verified,
the applying ``Complete`` everywhere. A failure before that cancels the update
everywhere; after it, the engines that can apply do, and the error names those
that could not (the one window: an engine failing in its own apply).

The failure protocol (:meth:`SyncRunner._abandon`): when any engine fails (or the trainer's
broadcast does), no further byte is broadcast, the update is cancelled on every engine that did not
complete it, the trainer leaves the group, and one :class:`~wsync_grpc.trainer.results.SyncError`
names every failed engine with its gRPC code, ``google.rpc.ErrorInfo`` reason and message; the next
sync re-initializes the group.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core import layout as core_layout
from wsync_grpc.core.layout import Bucket, total_wire_bytes
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.liveness import Holds
from wsync_grpc.trainer.membership import Membership
from wsync_grpc.trainer.metrics import TrainerMetrics
from wsync_grpc.trainer.options import ApplyMode, Layout
from wsync_grpc.trainer.planning import Planner
from wsync_grpc.trainer.results import (
    TRAINER,
    ClientError,
    Commit,
    EngineFailure,
    EngineSyncResult,
    InitError,
    SyncError,
    SyncProgress,
    SyncResult,
    engine_result,
    failure_lines,
)
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.tracing import SyncTrace
from wsync_grpc.transports.broadcast.sender import Broadcast, PackBuffers
from wsync_grpc.wire.convert import APPLY_MODES, LAYOUTS, adapter_to_proto, duration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateRequest:
    """One update, as ``TrainerClient.sync`` was asked for it (bucket size and id resolved).

    Attributes:
        weight_version: the version the engines serve once it succeeded.
        layout: ``"flattened"`` or ``"individual"``.
        apply_mode: ``"staged"`` or ``"streaming"``.
        bucket_bytes: bucket capacity, in bytes.
        dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
        flush_cache: whether the engines flush their prefix/KV cache.
        progress: called after every bucket, or ``None``.
        update_id: the update's id.
        on_phase: called with each phase's name as it ends (:data:`PHASES`), or ``None``.
        checkpoint_path: a disk update's checkpoint, as the engines see it; empty for a broadcast.
        adapter: the LoRA adapter the update loads; ``None`` for base weights.
    """

    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    bucket_bytes: int
    dtype: torch.dtype | None
    flush_cache: bool
    progress: Callable[[SyncProgress], None] | None
    update_id: str
    on_phase: Callable[[str], None] | None = None
    checkpoint_path: str = ""
    adapter: LoraSpec | None = None


PHASES = ("planned", "prepared", "broadcast", "verified", "applied")
"""The phases ``TrainerClient.sync`` reports to ``on_phase`` as each ends (``"verified"``: staged only)."""


class SyncRunner:
    """Runs one update at a time over the client's engines (the caller holds the client's op lock).

    Args:
        fleet: the engines.
        membership: the trainer's group membership (re-formed when stale).
        settings: the client's settings (timeouts are read at every update).
        cancel_event: the client's cancel signal; set, it stops the update at its next wait.
        buffers: the trainer's pack buffers.
        metrics: the client's Prometheus metrics.
    """

    def __init__(
        self,
        fleet: Fleet,
        membership: Membership,
        settings: ClientSettings,
        cancel_event: threading.Event,
        buffers: PackBuffers,
        metrics: TrainerMetrics,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._membership = membership
        self._settings = settings
        self._cancel_event = cancel_event
        self._buffers = buffers
        self._planner = Planner(settings)
        self._holds: Holds | None = None
        self._trace: SyncTrace  # one per run

    def run(self, named_tensors: Iterable[tuple[str, torch.Tensor]], request: UpdateRequest) -> SyncResult:
        """Push ``named_tensors`` to every engine as ``request`` says, as one trace (:mod:`.tracing`).

        Raises:
            ValueError: nothing to send, or a planning error.
            SyncError: the update failed; it was abandoned on every engine.
            ClientError: the client was closed.
        """
        n = len(self._fleet.engines)
        self._trace = SyncTrace(request.update_id, request.weight_version, request.apply_mode, n)
        try:
            result = self._run(named_tensors, request)
        except BaseException as e:
            self._trace.end(e)
            raise
        self._trace.end()
        return result

    def _run(self, named_tensors: Iterable[tuple[str, torch.Tensor]], request: UpdateRequest) -> SyncResult:
        if self._membership.closed:
            raise ClientError("the client is closed")
        t_plan = time.monotonic()
        self._trace.begin("plan")
        pairs = list(named_tensors)
        layout_enum = core_layout.Layout(request.layout)
        buckets, messages = self._planner.plan(pairs, request.bucket_bytes, request.dtype, layout_enum)
        if not buckets:
            raise ValueError("nothing to sync: no tensors given")
        by_name = dict(pairs)
        wire_bytes = total_wire_bytes(buckets, layout_enum)
        plan_s = time.monotonic() - t_plan
        report(request, "planned")
        init_s, group = self._ensure_group(request)
        prepared, t0, prepare_s = self._prepare(request, buckets, messages, wire_bytes)
        c = self._transfer_and_commit(
            request, prepared, lambda: self._broadcast(request, group, buckets, by_name, wire_bytes)
        )
        return self._applied(
            request,
            SyncResult(
                **_sizes(request, buckets, wire_bytes),
                init_seconds=init_s,
                plan_seconds=plan_s,
                prepare_seconds=prepare_s,
                broadcast_seconds=c.transfer_s,
                pack_seconds=c.pack_s,
                complete_seconds=c.done - c.started,
                verify_seconds=c.verify_s,
                total_seconds=c.done - t0,
                engines={e.target: c.results[e.target] for e in self._fleet.engines},
            ),
        )

    def _transfer_and_commit(
        self,
        request: UpdateRequest,
        prepared: Mapping[str, pb.PrepareResponse],
        transfer: Callable[[], float] | None,
    ) -> Commit:
        """Everything after Prepare replied, every engine held: ``transfer`` (the broadcast; it returns
        its packing seconds; ``None`` when the engines read the bytes themselves), then Complete, in
        two phases for a staged update.

        Raises:
            SyncError: see :meth:`_broadcast`, :meth:`_verify` and :meth:`_complete`.
        """
        report(request, "prepared")
        # Held from Prepare's reply to Complete's: a dead engine or trainer is noticed at once.
        self._holds = Holds(
            self._fleet.engines, request.update_id, self._fleet.metadata, self._fleet.owner, self._cancel_event
        )
        try:
            t_transfer, pack_s = time.monotonic(), 0.0
            if transfer is not None:
                self._trace.begin("broadcast")
                pack_s = transfer()
                report(request, "broadcast")
            t_complete = time.monotonic()
            verify_s = 0.0
            if request.apply_mode == "staged":
                self._trace.begin("verify")
                self._verify(request)
                verify_s = time.monotonic() - t_complete
                report(request, "verified")
            results, done = self._complete(request, prepared)
        finally:
            holds, self._holds = self._holds, None
            holds.close()
        return Commit(results, done, t_complete, verify_s, t_complete - t_transfer, pack_s)

    def _applied(self, request: UpdateRequest, result: SyncResult) -> SyncResult:
        """Record a successful update and report its last phase."""
        self._metrics.sync_applied(result)
        report(request, "applied")
        return result

    def _ensure_group(self, request: UpdateRequest) -> tuple[float, WeightSyncGroup]:
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
                raise self._abandon(request, "init", e.failures) from e
        init_s = time.monotonic() - t_init
        self._cancel_event.clear()
        group = self._membership.group
        assert group is not None
        return init_s, group

    def _prepare(
        self, request: UpdateRequest, buckets: Sequence[Bucket], messages: Sequence[pb.PrepareRequest], wire_bytes: int
    ) -> tuple[dict[str, pb.PrepareResponse], float, float]:
        """Prepare everywhere; every engine replies once its receivers are armed.

        Returns:
            target -> reply; when the first Prepare was sent (``time.monotonic()``); the
            seconds from then to the last reply.

        Raises:
            SyncError: some engine failed, or ``cancel()`` was called meanwhile (stage ``"prepare"``).
        """
        header = pb.PrepareHeader(
            update_id=request.update_id,
            weight_version=request.weight_version,
            transport=pb.TRANSPORT_BROADCAST,
            owner=self._fleet.owner,
            layout=LAYOUTS[core_layout.Layout(request.layout)],
            apply_mode=APPLY_MODES[core_layout.ApplyMode(request.apply_mode)],
            bucket_count=len(buckets),
            total_bytes=wire_bytes,
            adapter=adapter_to_proto(request.adapter) if request.adapter else None,
        )
        return self._prepare_everywhere(request, header, messages)

    def _prepare_everywhere(
        self, request: UpdateRequest, header: pb.PrepareHeader, messages: Sequence[pb.PrepareRequest] = ()
    ) -> tuple[dict[str, pb.PrepareResponse], float, float]:
        """One Prepare stream (``header``, then ``messages``) per engine, concurrently; see :meth:`_prepare`."""

        def stream() -> Iterator[pb.PrepareRequest]:
            yield pb.PrepareRequest(header=header)
            yield from messages

        t0 = time.monotonic()
        self._trace.begin("prepare")
        metadata = self._trace.metadata(self._fleet.metadata)
        prepared, failures = self._fleet.gather(
            "Prepare",
            lambda e: e.stub.Prepare.future(stream(), timeout=self._settings.rpc_timeout_s, metadata=metadata),
        )
        prepare_s = time.monotonic() - t0
        if not failures and self._cancel_event.is_set():
            failures[TRAINER] = EngineFailure(TRAINER, "Prepare", None, "CANCELLED", "cancel() was called")
        if failures:
            raise self._abandon(request, "prepare", failures)
        return prepared, t0, prepare_s

    def _broadcast(
        self,
        request: UpdateRequest,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        by_name: Mapping[str, torch.Tensor],
        wire_bytes: int,
    ) -> float:
        """Broadcast every bucket in the request's layout; returns the time spent packing, in seconds.

        Raises:
            SyncError: the trainer's broadcast failed or was cancelled (stage ``"broadcast"``).
        """
        on_sent = None
        if request.progress is not None:
            progress, start = request.progress, time.monotonic()

            def on_sent(b: Bucket, sent: int) -> None:
                elapsed = time.monotonic() - start
                progress(SyncProgress(request.update_id, b.index + 1, len(buckets), sent, wire_bytes, elapsed))

        job = Broadcast(group, buckets, by_name, on_sent, self._cancel_event)
        try:
            if request.layout == "flattened":
                return job.flattened(self._buffers.for_update())
            return job.individual()
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "broadcast", exc)
            raise self._abandon(request, "broadcast", {TRAINER: trainer}, broadcast_started=True) from exc
        except BaseException:  # KeyboardInterrupt and the like: clean up, then let it go
            self._abandon(request, "broadcast", {}, broadcast_started=True)
            raise

    def _verify(self, request: UpdateRequest) -> None:
        """The first phase of a staged update's commit: ``Complete(verify_only)`` everywhere.

        Raises:
            SyncError: some engine failed (stage ``"verify"``); the update was cancelled everywhere.
        """
        _, failures = self._complete_everywhere(request, verify_only=True)
        if not failures and self._cancel_event.is_set():
            failures[TRAINER] = EngineFailure(TRAINER, "verify", None, "CANCELLED", "cancel() was called")
        if failures:
            raise self._abandon(request, "verify", failures, broadcast_started=True)

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
            stage = "apply" if request.apply_mode == "staged" else "complete"
            raise self._abandon(request, stage, failures, results, broadcast_started=True)
        return results, done

    def _complete_everywhere(
        self, request: UpdateRequest, *, verify_only: bool
    ) -> tuple[dict[str, pb.CompleteResponse], dict[str, EngineFailure]]:
        """One ``Complete`` per engine, concurrently, carrying the current phase's trace context."""
        req = pb.CompleteRequest(
            update_id=request.update_id,
            flush_cache=request.flush_cache and not verify_only,
            timeout=duration(self._settings.group_timeout_s),
            owner=self._fleet.owner,
            verify_only=verify_only,
        )
        metadata = self._trace.metadata(self._fleet.metadata)
        return self._fleet.gather(
            "Complete",
            lambda e: e.stub.Complete.future(req, timeout=self._settings.timeouts.group_rpc_s, metadata=metadata),
        )

    def _abandon(
        self,
        request: UpdateRequest,
        stage: str,
        failures: Mapping[str, EngineFailure],
        results: Mapping[str, EngineSyncResult] | None = None,
        broadcast_started: bool = False,
    ) -> SyncError:
        """The failure protocol: Cancel everywhere, leave the group, build the one error to raise."""
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
        self._membership.drop()
        self._buffers.release()  # a broadcast abandoned half-way may still read them
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


def _sizes(request: UpdateRequest, buckets: Sequence[Bucket], wire_bytes: int) -> dict[str, Any]:
    """The fields of a :class:`SyncResult` that describe the update and its sizes (bytes)."""
    return {
        "update_id": request.update_id,
        "weight_version": request.weight_version,
        "layout": request.layout,
        "apply_mode": request.apply_mode,
        "bucket_count": len(buckets),
        "tensor_count": sum(len(b.tensors) for b in buckets),
        "payload_bytes": sum(b.payload_bytes for b in buckets),
        "wire_bytes": wire_bytes,
    }


def report(request: UpdateRequest, phase: str) -> None:
    """Tell ``request.on_phase`` that ``phase`` ended; an exception it raises is logged, not raised."""
    if request.on_phase is None:
        return
    try:
        request.on_phase(phase)
    except Exception:
        log.exception("the on_phase callback failed for phase %r", phase)
