"""What backs the colocated ring: the one thing that differs between its two transports.

The ring protocol (the socket, the token, peer credentials, the BUCKET/ACK messages, two slots or more: the trainer
packs bucket k+1 while the engines copy k) is :mod:`~wsync_grpc.transports.shared_memory`'s, shared by
``TRANSPORT_SHARED_MEMORY`` and ``TRANSPORT_CUDA_IPC``; only the ring's memory differs, by where the trainer's
buckets live:

- a memfd on the host (:class:`~wsync_grpc.transports.shared_memory.handover.Segment`, made by
  :data:`~wsync_grpc.transports.shared_memory.handover.MEMFD`),
  handed over as a read-only descriptor with the grant and mapped read-only by each engine worker
  (:class:`MappedSegment`);
- a CUDA allocation on the trainer's GPU (:mod:`wsync_grpc.transports.cuda_ipc.memory`), named by the handle's
  ``cuda_ipc`` and opened by each engine worker with ``cudaIpcOpenMemHandle``.

Trainer side: a :class:`RingMemoryKind` says where a send's ring must live and makes it (:class:`RingMemory`:
slots to pack into, what the grant and the handle carry, the ordering before a bucket's message, close). Engine
side: a :class:`RingView` copies a slot out and closes.

Units: sizes in bytes.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from wsync_grpc.core.header import CudaIpcMemory
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.topology import SendTopology

HOST = "cpu"
"""The place of a memfd ring (:attr:`RingMemory.place`)."""


class RingMemory(Protocol):
    """The trainer's ring memory: ``slots`` slots of ``slot_bytes`` bytes, kept between updates."""

    slot_bytes: int
    slots: int
    place: str
    """Where it lives: :data:`HOST`, or a CUDA device (``"cuda:0"``); a send whose tensors need another place gets
    a fresh ring."""

    @property
    def cuda_ipc(self) -> CudaIpcMemory | None:
        """What the handle says of GPU memory (``SharedMemoryHandle.cuda_ipc``); ``None`` for a memfd."""
        ...

    def grant_fds(self) -> list[int]:
        """The descriptors sent with each engine worker's grant (a memfd's read-only one; none for GPU memory)."""
        ...

    def slot(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of slot ``slot``, a writable 1-D ``uint8`` tensor to pack into.

        Raises:
            ValueError: closed, or ``nbytes`` exceeds a slot.
        """
        ...

    def packed(self, slot: int) -> None:
        """Slot ``slot`` was packed: return once its bytes are where the engines read them (nothing on the host; a
        synchronized stream on a GPU), before the bucket's message is sent."""
        ...

    def close(self) -> None:
        """Let the memory go (idempotent)."""
        ...


class RingMemoryKind(Protocol):
    """How a sender finds and makes its ring's memory."""

    storages: bool
    """Whether the zero-copy reads of the trainer's shared-memory storages may be offered (a memfd ring's only)."""

    def place_of(
        self,
        buckets: Sequence[Bucket],
        tensors: Callable[[Bucket], Mapping[str, torch.Tensor]],
        topology: SendTopology,
        device: torch.device,
    ) -> str:
        """Where the ring of a send of ``buckets`` (their ``tensors``, from ``topology``'s ranks; ``device``: the
        trainer client's) must live. Asks ``tensors`` for the first bucket's only for a send of one process (the ranks
        of a sharded trainer gather each bucket in lockstep, once).

        Raises:
            ValueError: this memory cannot carry that send (e.g. CPU tensors over CUDA IPC).
        """
        ...

    def allocate(self, slot_bytes: int, slots: int, place: str) -> RingMemory:
        """A fresh ring at ``place``.

        Raises:
            Exception: out of memory, or the device's runtime failed.
        """
        ...


class RingView(Protocol):
    """A trainer's ring as an engine worker reads it."""

    def copy(self, start: int, flat: torch.Tensor) -> None:
        """Copy ``flat.numel()`` bytes of the ring from byte ``start`` into ``flat``; once it returns, the bytes
        are in ``flat`` (the slot may be acknowledged)."""
        ...

    def close(self) -> bool:
        """Unmap (idempotent); whether a view of the mapping is still held (unmapped when that view goes)."""
        ...


class MappedSegment:
    """A memfd ring mapped read-only (a :class:`RingView`).

    Args:
        mapping: the read-only mapping (this view closes it).
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        self.map: mmap.mmap | None = mapping
        with warnings.catch_warnings():  # torch warns that it cannot mark a tensor read-only: it is only read
            warnings.simplefilter("ignore", UserWarning)
            self.bytes: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)

    def copy(self, start: int, flat: torch.Tensor) -> None:
        """Copy the bytes (torch's copy: several threads on CPU, about twice one thread's ``memcpy``; to another
        device straight from the mapping)."""
        assert self.bytes is not None
        flat.copy_(self.bytes[start : start + flat.numel()])

    def close(self) -> bool:
        """Unmap; whether the mapping is still viewed."""
        self.bytes = None  # its last view: the mapping can close
        mapping, self.map = self.map, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                return True
        return False


def slot_view(ring: torch.Tensor | None, slot: int, nbytes: int, slots: int, slot_bytes: int) -> torch.Tensor:
    """The first ``nbytes`` bytes of slot ``slot`` of ``ring`` (a ring's bytes as one 1-D ``uint8`` tensor, host or
    GPU: ``slots`` slots of ``slot_bytes`` bytes; ``None`` once closed), as a writable view.

    Raises:
        ValueError: the ring was closed, or ``nbytes`` exceeds a slot.
    """
    if ring is None:
        raise ValueError("the ring was closed")
    if not 0 <= slot < slots or nbytes > slot_bytes:
        raise ValueError(f"{nbytes} bytes do not fit slot {slot} of {slots} x {slot_bytes} bytes")
    start = slot * slot_bytes
    return ring[start : start + nbytes]
