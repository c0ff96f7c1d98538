"""One update from the trainer to every engine, whatever carries its bytes: plan, Prepare, transfer, commit.

:class:`UpdateRunner` runs every kind of :class:`~wsync_grpc.trainer.request.UpdateRequest` the same
way, as vLLM's and SGLang's weight-update routes do for theirs; the transport part
(:func:`~wsync_grpc.transports.transport_for` of the request's ``transport``) decides each step by its
rules, not by the request's kind:

1. **Plan** (:class:`~wsync_grpc.trainer.planning.Planner`, from the update's
   :class:`~wsync_grpc.trainer.source.WeightSource` metadata, no tensor's bytes read) unless the
   transport's engines build the buckets (``engine_builds_buckets``: a
   :class:`~wsync_grpc.trainer.request.DiskRequest`'s engines plan their own from the checkpoint's
   headers).
2. **Group**: (re-)initialized when stale where the transport needs one (``needs_group``: a broadcast);
   without one, the engines' leases are held for the update (a disk read).
3. **Prepare** everywhere at once (:class:`~wsync_grpc.trainer.protocol.UpdateProtocol`), each engine
   replying once it is ready to receive (its receivers armed, or its checkpoint validated).
4. **Transfer**: the request's transport's sender (its trainer half,
   :class:`~wsync_grpc.transports.sending.TransportSender`, built once per client by
   :meth:`TransportPart.sender <wsync_grpc.transports.TransportPart.sender>` and kept in :class:`Senders`)
   sends every bucket, the source asked for one bucket's tensors at a time; none where the engines read the
   bytes themselves.
5. **Commit**: the one protocol for every kind (two-phase Complete for a staged update), then one
   :class:`~wsync_grpc.trainer.results.SyncResult` built by :func:`sync_result`.

Digests (``ClientSettings.digests``, broadcasts): the sender hashes each bucket while it is on the
wire and a :class:`~wsync_grpc.trainer.digests.DigestCourier` declares the digest to every engine
right away (the header says ``digests_follow``); every digest is declared before Complete. A delta's
digests are of the whole tensors its buckets result in, not of their bytes: the trainer hashes those
as each bucket is sent, while the engines rebuild it, and declares them the same way. A sender
whose ranks hash their own buckets before Prepare (a sharded trainer's direct send) puts them in the
bucket specs instead.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, Transport, total_wire_bytes
from wsync_grpc.trainer.deadline import CancelSignal
from wsync_grpc.trainer.digests import DigestCourier
from wsync_grpc.trainer.options import apply_mode_name, layout_name
from wsync_grpc.trainer.planning import Planner, set_spec_digests
from wsync_grpc.trainer.protocol import Prepared, UpdateProtocol
from wsync_grpc.trainer.request import BroadcastRequest, UpdateRequest
from wsync_grpc.trainer.results import TRAINER, Commit, EngineFailure, SyncProgress, SyncResult
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.transports import TransportPart, transport_for
from wsync_grpc.transports.sending import ChecksSend, SendJob, SendSite, TransportSender, ZeroCopySender

T = TypeVar("T")


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
        delta=request.delta.summary if isinstance(request, BroadcastRequest) and request.delta is not None else None,
    )


class Senders:
    """A trainer client's transport senders, one per transport it used, each built by its part on first use
    (:meth:`TransportPart.sender <wsync_grpc.transports.TransportPart.sender>`) and kept across updates.

    Args:
        site: the trainer's ranks and device.
        given: senders built by the caller, by transport (the deprecated ``TrainerClient(sender=...)``).
    """

    def __init__(self, site: SendSite, given: Mapping[Transport, TransportSender] | None = None) -> None:
        self._site = site
        self._senders: dict[Transport, TransportSender] = dict(given or {})

    def of(self, part: TransportPart) -> TransportSender:
        """``part``'s sender, built on first use.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, the transport has no trainer half.
        """
        sender = self._senders.get(part.kind)
        if sender is None:
            sender = self._senders[part.kind] = part.sender(self._site)
        return sender

    def release(self) -> None:
        """Drop what every sender keeps between updates (:meth:`TransportSender.release
        <wsync_grpc.transports.sending.TransportSender.release>`)."""
        for sender in self._senders.values():
            sender.release()


class UpdateRunner:
    """Runs one update at a time, of any kind, over the transport its request names (the caller holds the
    client's op lock).

    Args:
        calls: the update's calls over the engines and its failure protocol.
        settings: the client's settings (the planner and the digests read them at every update).
        senders: the client's transport senders (a trainer that sends the bytes hands its buckets to the
            request's transport's).
        cancel_event: the client's cancel signal (a cancel, or the sync's deadline); set, it stops the send
            at its next wait.
    """

    def __init__(
        self, calls: UpdateProtocol, settings: ClientSettings, senders: Senders, cancel_event: CancelSignal
    ) -> None:
        self._calls = calls
        self._settings = settings
        self._senders = senders
        self._cancel_event = cancel_event
        self._planner = Planner(settings)

    def run(
        self,
        request: UpdateRequest,
        source: WeightSource | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> SyncResult:
        """Run ``request`` over its transport (:func:`~wsync_grpc.transports.transport_for`), as one trace:

        the trainer plans ``source``'s buckets unless the transport's engines build them
        (``engine_builds_buckets``); the group is (re-)formed only if the transport needs one
        (``needs_group``; without one the engines' leases are held for the update); then Prepare, the
        transport's send (none where the engines read the bytes), the commit (``before_commit`` runs between a
        staged update's two phases: :meth:`UpdateProtocol.transfer_and_commit
        <wsync_grpc.trainer.protocol.UpdateProtocol.transfer_and_commit>`).

        Raises:
            ValueError: nothing to send, or a planning error; a ``source`` where the engines read the bytes
                or none where the trainer sends them.
            Unimplemented: TRANSPORT_UNIMPLEMENTED, no transport part serves the request's transport here.
            SyncError: the update failed; it was abandoned on every engine.
            ClientError: the client was closed.
        """
        part = transport_for(request.transport)
        if part.engine_builds_buckets != (source is None):
            name = request.transport.name.lower()
            if part.engine_builds_buckets:
                raise ValueError(f"the engines read a {name} update's bytes themselves: it takes no weight source")
            raise ValueError(f"the trainer sends a {name} update's bytes: it needs a weight source")
        sender = self._senders.of(part)  # a transport without a trainer half here is refused before anything starts
        if isinstance(sender, ZeroCopySender):  # the setting as it is now (assigning it applies from the next update)
            sender.storages = self._settings.shared_memory_zero_copy
        return self._calls.run(request, lambda: self._run(part, sender, request, source, before_commit))

    # ------------------------------------------------------------------ the steps

    def _run(
        self,
        part: TransportPart,
        sender: TransportSender,
        request: UpdateRequest,
        source: WeightSource | None,
        before_commit: Callable[[], None] | None = None,
    ) -> SyncResult:
        calls = self._calls
        planned = self._plan(request, source) if source is not None else None
        if planned is not None and source is not None and isinstance(sender, ChecksSend):  # refused before any call
            sends0 = planned[0]
            tensors0 = sends0.delta.bucket_tensors if sends0.delta is not None else source.bucket_tensors
            sender.check_send(planned[1], tensors0, sends0.topology)
        init_s, group = calls.ensure_group(request) if part.needs_group else calls.hold_engines()
        if source is None or planned is None:
            # A header-only Prepare: every engine replies once it validated its own plan (stage "prepare").
            prepared = calls.prepare(request, request.header())
            commit = calls.transfer_and_commit(request, prepared, None, before_commit)  # the engines read the bytes
            reply: pb.PrepareResponse = next(iter(prepared.replies.values()))  # every engine planned the same
            shape = Shape(reply.bucket_count, reply.tensor_count, reply.total_bytes, wire_bytes=0)
            return calls.applied(request, sync_result(request, shape, prepared, commit))
        sends, buckets, messages, shape = planned
        shape = dataclasses.replace(shape, init_s=init_s)
        payload = sends.delta  # the tensors in the wire dtype (and a delta's entries), or None: the source's own
        tensors = payload.bucket_tensors if payload is not None else source.bucket_tensors
        job = SendJob(group, buckets, sends.layout, tensors, sends.topology, self._cancel_event, request.update_id)
        if payload is not None and payload.is_delta:  # a delta bucket's digest: of the tensors it results in
            job = dataclasses.replace(job, digest_of=payload.digest_of)
        if not self._settings.digests:
            up_front: Mapping[int, Digest] | None = {}
        elif job.digest_of is not None and not sends.topology.by_pieces:
            up_front = None  # this process holds every bucket's tensors: each hashed as it is sent (see the module)
        else:
            up_front = self._before_prepare(request, "digests", lambda: sender.digests_before_send(job))
        set_spec_digests(messages, up_front or {})
        courier = calls.digest_courier(request) if up_front is None else None
        header = sends.header(len(buckets), shape.wire_bytes, digests_follow=courier is not None)
        header = dataclasses.replace(
            header, **self._before_prepare(request, "transport", lambda: sender.header_fields(job))
        )
        prepared = calls.prepare(request, header, messages)
        commit = calls.transfer_and_commit(
            request, prepared, lambda: self._send(sender, sends, job, shape.wire_bytes, courier), before_commit
        )
        return calls.applied(request, sync_result(request, shape, prepared, commit))

    def _plan(
        self, request: UpdateRequest, source: WeightSource
    ) -> tuple[BroadcastRequest, list[Bucket], list[pb.PrepareRequest], Shape]:
        """Plan ``source``'s buckets for ``request`` (the trainer's bucket capacity, dtype, layout, topology).

        Raises:
            ValueError: ``request`` is not one the trainer sends (:class:`BroadcastRequest`), nothing to send,
                or a planning error.
        """
        if not isinstance(request, BroadcastRequest):
            raise ValueError(f"the trainer plans only the updates it sends, not a {type(request).__name__}")
        t_plan = time.monotonic()
        self._calls.phase("plan")
        deltas = request.delta.plan_deltas() if request.delta is not None else None
        buckets, messages = self._planner.plan(
            source.metadata(), request.bucket_bytes, request.dtype, request.layout, request.topology, deltas
        )
        if not buckets:
            raise ValueError("nothing to sync: no tensors given")
        shape = Shape(
            bucket_count=len(buckets),
            tensor_count=sum(len(b.tensors) for b in buckets),
            payload_bytes=sum(b.payload_bytes for b in buckets),
            wire_bytes=total_wire_bytes(buckets, request.layout),
            plan_s=time.monotonic() - t_plan,
        )
        request.report("planned")
        return request, buckets, messages, shape

    # ------------------------------------------------------------------ a broadcast's send

    def _before_prepare(self, request: UpdateRequest, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, the sender's work before Prepare (``what``: its name in the failure): its digests
        (:meth:`TransportSender.digests_before_send
        <wsync_grpc.transports.sending.TransportSender.digests_before_send>`) or its handle
        (:meth:`TransportSender.header_fields <wsync_grpc.transports.sending.TransportSender.header_fields>`).

        Raises:
            SyncError: it failed (a trainer rank failed while hashing, the handle could not be made): the update
                is abandoned at stage ``"prepare"``; no byte was sent.
        """
        try:
            return call()
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, what, exc)
            raise self._calls.abandon(request, "prepare", {TRAINER: trainer}) from exc

    def _send(
        self,
        sender: TransportSender,
        request: BroadcastRequest,
        job: SendJob,
        wire_bytes: int,
        courier: DigestCourier | None,
    ) -> float:
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

        on_digest: Callable[[Bucket, Digest], None] | None = courier.add if courier is not None else None
        if courier is not None and job.digest_of is not None:  # a delta bucket's: of the tensors it results in
            digest_of, declare = job.digest_of, courier.add
            on_digest = lambda b, _of_bytes: declare(b, digest_of(b))  # noqa: E731
        try:
            pack_s = sender.send(dataclasses.replace(job, on_sent=on_sent, on_digest=on_digest))
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
