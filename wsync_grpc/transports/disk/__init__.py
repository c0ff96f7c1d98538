"""The disk transport: the engine reads a safetensors checkpoint beneath its roots, no group needed.

The header names the checkpoint (``PrepareHeader.checkpoint_path``); the engine
opens it beneath its roots (:mod:`~wsync_grpc.transports.disk.roots`), never
through a symlink, each file once (:mod:`~wsync_grpc.transports.disk.confined`),
and builds the buckets from the files' headers read through those open files
(:mod:`~wsync_grpc.transports.disk.checkpoint`,
:mod:`~wsync_grpc.transports.disk.safetensors_file`), validated as a
broadcast's are; each worker's
:class:`~wsync_grpc.transports.disk.receiver.DiskReceiver` reads its tensors
through the same files. The trainer side writes checkpoints
(:mod:`~wsync_grpc.transports.disk.writer`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import UpdateHeader, transport_unimplemented
from wsync_grpc.core.layout import Bucket, Layout, Transport
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.disk.checkpoint import plan_disk_update
from wsync_grpc.transports.disk.receiver import DiskReceiver
from wsync_grpc.transports.sending import ENGINE_READS, SendSite, TransportSender
from wsync_grpc.worker.receiver import Receiver, ReceiveSite


@dataclass(frozen=True)
class DiskTransport:
    """``TRANSPORT_DISK`` (a :class:`~wsync_grpc.transports.TransportPart`)."""

    kind: Transport = Transport.DISK
    needs_group: bool = False
    engine_builds_buckets: bool = True

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """A disk update's header names a checkpoint and leaves the bucket fields to the engine.

        Returns the header in the individual layout (each tensor read on its own).

        Raises:
            InvalidArgument: MISSING_CHECKPOINT_PATH, DISK_HEADER_FIELDS.
        """
        if not h.checkpoint_path:
            raise InvalidArgument("MISSING_CHECKPOINT_PATH", "header.checkpoint_path is required for TRANSPORT_DISK")
        if h.bucket_count or h.total_bytes or h.incremental:
            raise InvalidArgument(
                "DISK_HEADER_FIELDS",
                "a disk update's buckets come from the checkpoint: header.bucket_count, total_bytes and "
                "incremental must be 0/false",
            )
        return dataclasses.replace(h, layout=Layout.INDIVIDUAL)

    def check_update(self) -> None:
        """A disk update declares every bucket at Prepare.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, always.
        """
        raise transport_unimplemented(self.kind)

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """The checkpoint opened beneath ``context.roots``, its buckets built from its headers and validated
        (stopping at ``context.cancel``).

        Raises:
            see :func:`~wsync_grpc.transports.disk.checkpoint.plan_disk_update`.
        """
        return plan_disk_update(context.roots, header, validator, context.cancel)

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """A :class:`~wsync_grpc.transports.disk.receiver.DiskReceiver` reading ``plan.files``."""
        return DiskReceiver(site, plan)

    def sender(self, site: SendSite) -> TransportSender:
        """:data:`~wsync_grpc.transports.sending.ENGINE_READS`: the engines read the checkpoint, the trainer sends
        nothing (it may have written the checkpoint: :func:`~wsync_grpc.transports.disk.writer.save_checkpoint`)."""
        return ENGINE_READS


PART = DiskTransport()
