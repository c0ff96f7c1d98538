"""One update from the trainer to every engine, whatever carries its bytes: plan, Prepare, transfer, commit.

:class:`UpdateRunner` runs every kind of :class:`~wsync_grpc.trainer.request.UpdateRequest` the same
way, as vLLM's and SGLang's weight-update routes do for theirs:

1. **Plan** (:class:`~wsync_grpc.trainer.planning.Planner`, from the update's
   :class:`~wsync_grpc.trainer.source.WeightSource` metadata, no tensor's bytes read) where the
   trainer sends the bytes (:class:`~wsync_grpc.trainer.request.BroadcastRequest`); a
   :class:`~wsync_grpc.trainer.request.DiskRequest`'s engines plan their own buckets from the
   checkpoint's headers.
2. **Group**: (re-)initialized when stale where the bytes travel over it (a broadcast); without one,
   the engines' leases are held for the update (a disk read).
3. **Prepare** everywhere at once (:class:`~wsync_grpc.trainer.protocol.UpdateProtocol`), each engine
   replying once it is ready to receive (its receivers armed, or its checkpoint validated).
4. **Transfer**: the trainer's :class:`~wsync_grpc.trainer.sender.Sender` sends every bucket, the
   source asked for one bucket's tensors at a time; none where the engines read the bytes themselves.
5. **Commit**: the one protocol for every kind (two-phase Complete for a staged update), then one
   :class:`~wsync_grpc.trainer.results.SyncResult` built by :func:`sync_result`.

Digests (``ClientSettings.digests``, broadcasts): the sender hashes each bucket while it is on the
wire and a :class:`~wsync_grpc.trainer.digests.DigestCourier` declares the digest to every engine
right away (the header says ``digests_follow``); every digest is declared before Complete. A sender
whose ranks hash their own buckets before Prepare (a sharded trainer's direct send) puts them in the
bucket specs instead.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, total_wire_bytes
from wsync_grpc.trainer.deadline import CancelSignal
from wsync_grpc.trainer.digests import DigestCourier
from wsync_grpc.trainer.options import apply_mode_name, layout_name
from wsync_grpc.trainer.planning import Planner, set_spec_digests
from wsync_grpc.trainer.protocol import Prepared, UpdateProtocol
from wsync_grpc.trainer.request import BroadcastRequest, DiskRequest, UpdateRequest
from wsync_grpc.trainer.results import TRAINER, Commit, EngineFailure, SyncProgress, SyncResult
from wsync_grpc.trainer.sender import Sender
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.transports.broadcast.sender import SendJob


@dataclass(frozen=True)
class Shape:
    """What an update carried, as its result reports it.

    Attributes:
        bucket_count, tensor_count: buckets and tensors of the update.
        payload_bytes: the tensors' bytes, in the wire dtype.
        wire_bytes: bytes on the wire (0 when the engines read the bytes themselves).
        init_s: the group's (re-)initialization, in seconds (0 without a group).
        plan_s: the trainer's bucket planning, in seconds (0 when the engines plan).
    """

    bucket_count: int
    tensor_count: int
    payload_bytes: int
    wire_bytes: int
    init_s: float = 0.0
    plan_s: float = 0.0


def sync_result(request: UpdateRequest, shape: Shape, prepared: Prepared, commit: Commit) -> SyncResult:
    """The :class:`~wsync_grpc.trainer.results.SyncResult` of an update that committed: what it carried
    (``shape``) and how each phase went (``prepared``, ``commit``), for every kind of update.

    ``layout`` is what the engines were told (``"individual"`` for a disk read, tensor by tensor).
    """
    return SyncResult(
        update_id=request.update_id,
        weight_version=request.weight_version,
        layout=layout_name(request.header().layout),
        apply_mode=apply_mode_name(request.apply_mode),
        bucket_count=shape.bucket_count,
        tensor_count=shape.tensor_count,
        payload_bytes=shape.payload_bytes,
        wire_bytes=shape.wire_bytes,
        init_seconds=shape.init_s,
        plan_seconds=shape.plan_s,
        prepare_seconds=prepared.seconds,
        broadcast_seconds=commit.transfer_s,
        pack_seconds=commit.pack_s,
        complete_seconds=commit.done - commit.started,
        verify_seconds=commit.verify_s,
        total_seconds=commit.done - prepared.started,
        engines=commit.results,
    )


class UpdateRunner:
    """Runs one update at a time, of any kind (the caller holds the client's op lock).

    Args:
        calls: the update's calls over the engines and its failure protocol.
        settings: the client's settings (the planner and the digests read them at every update).
        sender: which trainer rank sends which bytes (broadcasts).
        cancel_event: the client's cancel signal (a cancel, or the sync's deadline); set, it stops the send
            at its next wait.
    """

    def __init__(
        self, calls: UpdateProtocol, settings: ClientSettings, sender: Sender, cancel_event: CancelSignal
    ) -> None:
        self._calls = calls
        self._settings = settings
        self._sender = sender
        self._cancel_event = cancel_event
        self._planner = Planner(settings)

    def broadcast(self, source: WeightSource, request: BroadcastRequest) -> SyncResult:
        """Send ``source``'s tensors to every engine as ``request`` says, as one trace.

        Raises:
            ValueError: nothing to send, or a planning error.
            SyncError: the update failed; it was abandoned on every engine.
            ClientError: the client was closed.
        """
        return self._calls.run(request, lambda: self._broadcast(source, request))

    def disk(self, request: DiskRequest) -> SyncResult:
        """Have every engine read ``request.checkpoint_path`` and commit it, as one trace.

        Raises:
            SyncError: some engine refused or failed; the update was cancelled everywhere.
            ClientError: the client was closed.
        """
        return self._calls.run(request, lambda: self._disk(request))

    # ------------------------------------------------------------------ each kind's steps

    def _broadcast(self, source: WeightSource, request: BroadcastRequest) -> SyncResult:
        calls = self._calls
        t_plan = time.monotonic()
        calls.phase("plan")
        buckets, messages = self._planner.plan(
            source.metadata(), request.bucket_bytes, request.dtype, request.layout, request.topology
        )
        if not buckets:
            raise ValueError("nothing to sync: no tensors given")
        wire_bytes = total_wire_bytes(buckets, request.layout)
        plan_s = time.monotonic() - t_plan
        request.report("planned")
        init_s, group = calls.ensure_group(request)
        job = SendJob(group, buckets, request.layout, source.bucket_tensors, request.topology, self._cancel_event)
        up_front = self._digests_before_send(request, job) if self._settings.digests else {}
        set_spec_digests(messages, up_front or {})
        courier = calls.digest_courier(request) if up_front is None else None
        header = request.header(len(buckets), wire_bytes, digests_follow=courier is not None)
        prepared = calls.prepare(request, header, messages)
        commit = calls.transfer_and_commit(request, prepared, lambda: self._send(request, job, wire_bytes, courier))
        shape = Shape(
            bucket_count=len(buckets),
            tensor_count=sum(len(b.tensors) for b in buckets),
            payload_bytes=sum(b.payload_bytes for b in buckets),
            wire_bytes=wire_bytes,
            init_s=init_s,
            plan_s=plan_s,
        )
        return calls.applied(request, sync_result(request, shape, prepared, commit))

    def _disk(self, request: DiskRequest) -> SyncResult:
        calls = self._calls
        calls.hold_engines()
        # A header-only Prepare: every engine replies once it validated the checkpoint (stage "prepare").
        prepared = calls.prepare(request, request.header())
        commit = calls.transfer_and_commit(request, prepared, None)  # the engines read the bytes themselves
        planned: pb.PrepareResponse = next(iter(prepared.replies.values()))  # every engine planned the same
        shape = Shape(planned.bucket_count, planned.tensor_count, planned.total_bytes, wire_bytes=0)
        return calls.applied(request, sync_result(request, shape, prepared, commit))

    # ------------------------------------------------------------------ a broadcast's send

    def _digests_before_send(self, request: BroadcastRequest, job: SendJob) -> Mapping[int, Digest] | None:
        """The digests the sender computed before Prepare (:meth:`Sender.digests_before_send`); ``None``: they follow.

        Raises:
            SyncError: a trainer rank failed while hashing (stage ``"prepare"``; no byte was sent).
        """
        try:
            return self._sender.digests_before_send(job)
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "digests", exc)
            raise self._calls.abandon(request, "prepare", {TRAINER: trainer}) from exc

    def _send(self, request: BroadcastRequest, job: SendJob, wire_bytes: int, courier: DigestCourier | None) -> float:
        """Send every bucket of ``job`` (``courier``: declaring each digest as it is hashed, ``request.progress``
        told of each bucket on every engine); returns the time spent packing, in seconds.

        Raises:
            SyncError: the trainer's send failed or was cancelled, or an engine refused a digest (stage
                ``"broadcast"``).
        """
        on_sent = None
        if request.progress is not None:
            progress, start, n = request.progress, time.monotonic(), len(job.buckets)

            def on_sent(b: Bucket, sent: int) -> None:
                elapsed = time.monotonic() - start
                progress(SyncProgress(request.update_id, b.index + 1, n, sent, wire_bytes, elapsed))

        on_digest = courier.add if courier is not None else None
        try:
            pack_s = self._sender.send(dataclasses.replace(job, on_sent=on_sent, on_digest=on_digest))
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "broadcast", exc)
            if self._cancel_event.expired:  # the deadline stopped the send: say so, not "cancelled"
                trainer = self._cancel_event.failure("broadcast")
            raise self._calls.abandon(request, "broadcast", {TRAINER: trainer}, broadcast_started=True) from exc
        except BaseException:  # KeyboardInterrupt and the like: clean up, then let it go
            self._calls.abandon(request, "broadcast", {}, broadcast_started=True)
            raise
        if courier is not None:  # every digest declared before Complete
            failures = courier.finish(self._settings.rpc_timeout_s)
            if failures:
                raise self._calls.abandon(request, "broadcast", failures, broadcast_started=True)
        return pack_s
