"""The broadcast transport: every bucket broadcast over the weight-sync group, flattened or tensor by tensor.

Sending side: :mod:`~wsync_grpc.transports.broadcast.sender` (the trainer's
rank 0, or every rank of a sharded trainer; double-buffered packing). Receiving side:
:mod:`~wsync_grpc.transports.broadcast.receiver` (one thread per worker, two
buckets posted ahead, in place or swapped where the engine allows). The
buckets are declared by the trainer in the Prepare stream (and by Update for
an incremental update); the engine must have joined the group (Init).
"""

from __future__ import annotations

from dataclasses import dataclass

from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Bucket, Transport
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.broadcast.receiver import BroadcastReceiver
from wsync_grpc.transports.broadcast.sender import BroadcastSender
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.sending import SendSite, TransportSender
from wsync_grpc.worker.receiver import Receiver, ReceiveSite


@dataclass(frozen=True)
class BroadcastTransport:
    """``TRANSPORT_BROADCAST`` (a :class:`~wsync_grpc.transports.TransportPart`)."""

    kind: Transport = Transport.BROADCAST
    needs_group: bool = True
    engine_builds_buckets: bool = False

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """Nothing beyond the validator's checks: the buckets follow in the stream."""
        return h

    def check_update(self) -> None:
        """An incremental broadcast may declare further buckets."""

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """The stream's header and buckets as they are: the bytes come over the group."""
        return PlannedUpdate(header, buckets)

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """A :class:`~wsync_grpc.transports.broadcast.receiver.BroadcastReceiver` on ``site.group``."""
        return BroadcastReceiver(site, plan)

    def sender(self, site: SendSite) -> TransportSender:
        """A :class:`~wsync_grpc.transports.broadcast.sender.BroadcastSender` from ``site``'s ranks."""
        return BroadcastSender(site)


PART = BroadcastTransport()
