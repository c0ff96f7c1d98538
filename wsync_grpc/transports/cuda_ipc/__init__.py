"""The CUDA IPC transport (``TRANSPORT_CUDA_IPC``): a trainer on the engine's host whose buckets live on a GPU.

The colocated ring of :mod:`wsync_grpc.transports.shared_memory` (the same abstract Unix socket, token, peer
credentials, BUCKET/ACK messages and ring of two slots or more: the trainer packs bucket k+1 while the engines copy
bucket k), backed by GPU memory instead of a memfd (:mod:`~wsync_grpc.transports.cuda_ipc.memory`; the backings'
interface is :mod:`~wsync_grpc.transports.shared_memory.backing`): one ``cudaMalloc`` allocation on the device of
the trainer's tensors, described in the header by the handle's ``cuda_ipc``
(:class:`~wsync_grpc.core.header.CudaIpcMemory`: the device's UUID, the 64-byte ``cudaIpcMemHandle_t``, offset
and size; structured fields, never pickled). Each engine worker checks it before a byte is read (this host's boot
id and the trainer's user, as for shared memory; the device is visible in the worker's process and is the worker's
own, else INVALID_ARGUMENT CUDA_IPC_DEVICE; the handle is 64 bytes and spans the ring, else CUDA_IPC_HANDLE), opens
it with ``cudaIpcOpenMemHandle`` once the trainer granted it on the socket, copies each bucket out into a buffer on
its own device and closes it when its receive ends (no mapping outlives the update).

Ordering (what an IPC event would give): the trainer synchronizes the stream that packed a slot before it tells the
workers; each worker synchronizes its copy before it acknowledges the bucket.

Halves: the trainer's is :class:`~wsync_grpc.transports.shared_memory.sender.SharedMemorySender` over
:data:`~wsync_grpc.transports.cuda_ipc.memory.CUDA_RING` (a trainer client picks it with ``transport="cuda_ipc"``);
the engine's is :class:`~wsync_grpc.transports.shared_memory.receiver.SharedMemoryReceiver`, which opens a ring by
its handle's ``cuda_ipc``. Not offered: the zero-copy reads of storages (a memfd ring's), incremental updates, the
individual layout, deltas, and a sharded trainer's direct sends (its gather mode is: rank 0's ring).

Status: checked on CPU (contract, header checks, refusals) in every run of the suite, and on one GPU (an H100) by
``python -m wsync_grpc.tools.cuda_ipc_check`` (``make gpu-check``) and the suite's ``cuda`` tests: a reference engine
in another process and a trainer on the same GPU, staged and streaming, bit-exact.

Units: sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.core.layout import Transport
from wsync_grpc.transports.cuda_ipc.memory import CUDA_RING, check_memory
from wsync_grpc.transports.sending import SendSite, TransportSender
from wsync_grpc.transports.shared_memory import SharedMemoryTransport
from wsync_grpc.transports.shared_memory.sender import SharedMemorySender

__all__ = ["PART", "CudaIpcTransport"]


@dataclass(frozen=True)
class CudaIpcTransport(SharedMemoryTransport):
    """``TRANSPORT_CUDA_IPC``, both halves (a :class:`~wsync_grpc.transports.TransportPart`; see the module): the
    shared-memory part's header checks, Prepare and receiver, with the ring in GPU memory."""

    kind: Transport = Transport.CUDA_IPC

    def check_memory(self, m: SharedMemoryHandle, field: str) -> None:
        """The ring ``m`` (at ``field``) names its GPU memory
        (:func:`~wsync_grpc.transports.cuda_ipc.memory.check_memory`).

        Raises:
            InvalidArgument: CUDA_IPC_HANDLE, CUDA_IPC_DEVICE.
        """
        check_memory(m.cuda_ipc, m, field)

    def sender(self, site: SendSite) -> TransportSender:
        """A :class:`~wsync_grpc.transports.shared_memory.sender.SharedMemorySender` whose ring is GPU memory (no
        zero-copy reads of storages)."""
        return SharedMemorySender(site, storages=False, memory=CUDA_RING)


PART = CudaIpcTransport()
"""What :func:`~wsync_grpc.transports.transport_for` reads for ``Transport.CUDA_IPC``."""
