"""The CUDA IPC transport (``TRANSPORT_CUDA_IPC``): reserved by the contract, not built yet.

A trainer colocated with the engine on the same GPUs would hand over CUDA
memory handles (structured, never pickled) instead of broadcasting. Until it
is built, every Prepare and Update that names it is answered UNIMPLEMENTED
(reason TRANSPORT_UNIMPLEMENTED) before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsync_grpc.core.header import UpdateHeader, transport_unimplemented
from wsync_grpc.core.layout import Bucket, Transport
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.sending import SendSite, TransportSender
from wsync_grpc.worker.receiver import Receiver, ReceiveSite


@dataclass(frozen=True)
class CudaIpcTransport:
    """``TRANSPORT_CUDA_IPC`` (a :class:`~wsync_grpc.transports.TransportPart`), answered UNIMPLEMENTED."""

    kind: Transport = Transport.CUDA_IPC
    needs_group: bool = False
    engine_builds_buckets: bool = False

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """Refuse the update.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, always.
        """
        raise transport_unimplemented(self.kind)

    def check_update(self) -> None:
        """Refuse the Update.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, always.
        """
        raise transport_unimplemented(self.kind)

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """Never reached: :meth:`check_header` refused the update."""
        raise transport_unimplemented(self.kind)

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """Never reached: :meth:`check_header` refused the update."""
        raise transport_unimplemented(self.kind)

    def sender(self, site: SendSite) -> TransportSender:
        """No trainer half yet.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, always.
        """
        raise transport_unimplemented(self.kind)


PART = CudaIpcTransport()
