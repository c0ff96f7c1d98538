"""Transports: one module per way an update's bytes travel, holding what both sides need, and their registry.

Each transport is a :class:`TransportPart` registered under the contract's
``Transport`` value (:data:`TRANSPORTS`) and imported only when an update asks
for it:

- ``broadcast`` (:mod:`wsync_grpc.transports.broadcast`): the trainer's rank 0
  broadcasts every bucket over the weight-sync group (flattened or individual
  layout); each worker's :class:`~wsync_grpc.transports.broadcast.receiver.BroadcastReceiver`
  receives it; the trainer's
  :class:`~wsync_grpc.transports.broadcast.sender.BroadcastSender` sends it;
- ``disk`` (:mod:`wsync_grpc.transports.disk`): the engine reads a safetensors
  checkpoint beneath its roots; the header names it, the engine builds the
  buckets from its headers, each worker's
  :class:`~wsync_grpc.transports.disk.receiver.DiskReceiver` reads it; the trainer
  sends nothing (:data:`~wsync_grpc.transports.sending.ENGINE_READS`), it may write the checkpoint first
  (:func:`~wsync_grpc.transports.disk.writer.save_checkpoint`);
- ``shared_memory`` (:mod:`wsync_grpc.transports.shared_memory`): a trainer on the engine's host hands
  over a shared-memory segment (a memfd over an abstract Unix socket) and packs each bucket into its
  ring; the engine's workers copy it out; no group;
- ``cuda_ipc`` (:mod:`wsync_grpc.transports.cuda_ipc`): the same ring as ``shared_memory``, backed by GPU
  memory (a CUDA allocation of the trainer's, opened by each engine worker by its IPC handle); checked on one H100
  (``make gpu-check``).

Adding a transport: a module (or package) with its ``PART`` (both halves) and one line in
:data:`TRANSPORTS` (``docs/architecture.md``, "How to add a transport"); a trainer picks it by the
``transport`` of its update request (:mod:`wsync_grpc.trainer.request`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Protocol

from wsync_grpc.core.header import UpdateHeader, transport_unimplemented
from wsync_grpc.core.layout import Bucket, Transport
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan, TransportRules
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.sending import SendSite, TransportSender
from wsync_grpc.worker.receiver import Receiver, ReceiveSite

TRANSPORTS: Mapping[Transport, str] = {
    Transport.BROADCAST: "wsync_grpc.transports.broadcast",
    Transport.DISK: "wsync_grpc.transports.disk",
    Transport.CUDA_IPC: "wsync_grpc.transports.cuda_ipc",
    Transport.SHARED_MEMORY: "wsync_grpc.transports.shared_memory",
}
"""The contract's ``Transport`` -> the module whose ``PART`` serves it (imported on first use)."""


class TransportPart(TransportRules, Protocol):
    """One transport, both halves: its rules (:class:`~wsync_grpc.core.update.TransportRules`: whether it needs the
    weight-sync group, whether the engines build the buckets), its Prepare and receivers on the engine, its
    sender on the trainer.

    The trainer's update runner (:class:`~wsync_grpc.trainer.runner.UpdateRunner`) reads the same rules: it
    plans the buckets unless the engines build them, forms the group only if the transport needs one,
    and hands the buckets to :meth:`sender`'s sender.
    """

    def check_update(self) -> None:
        """Whether ``Update`` may declare further buckets over this transport (an incremental update).

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, it may not.
        """
        ...

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """What Prepare settles once the stream was read and validated: the header, buckets and their source.

        Args:
            header: the validated header.
            validator: the update's validator (it holds what the stream declared).
            buckets: the buckets the stream declared (none when the engine builds them).
            context: what the engine gives the planning (its checkpoint roots, the update's cancel signal).

        Raises:
            WsyncError: the source cannot be read or does not fit the model (PERMISSION_DENIED, NOT_FOUND,
                INVALID_ARGUMENT...).
        """
        ...

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """A receiver (not started) for one worker at ``site``."""
        ...

    def sender(self, site: SendSite) -> TransportSender:
        """The trainer half: a sender for a trainer client at ``site``, kept by the client across its updates.

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, the transport has no trainer half here.
        """
        ...


def transport_for(kind: Transport) -> TransportPart:
    """The part serving ``kind`` (its module imported on first use).

    Raises:
        Unimplemented: TRANSPORT_UNIMPLEMENTED, no module serves it.
    """
    module = TRANSPORTS.get(kind)
    if module is None:
        raise transport_unimplemented(kind)
    part: TransportPart = importlib.import_module(module).PART
    return part
