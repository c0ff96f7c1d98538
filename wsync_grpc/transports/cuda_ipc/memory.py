"""The CUDA backing of the colocated ring: GPU memory in place of the memfd, on both sides.

Trainer (:class:`CudaRing`, made by :data:`CUDA_RING`): one ``cudaMalloc`` allocation of ``slots * slot_bytes``
bytes on the device of the trainer's tensors (its own allocation, not PyTorch's caching allocator's, so its IPC
handle starts at its first byte: ``offset_bytes`` 0), viewed by PyTorch as a ``uint8`` tensor through
``__cuda_array_interface__`` (``torch.as_tensor``) to pack buckets into, exported once with
``cudaIpcGetMemHandle`` and freed with ``cudaFree`` when the sender drops it. It implements the ring's
:class:`~wsync_grpc.transports.shared_memory.backing.RingMemory`: the grant carries no descriptor, the handle's
``cuda_ipc`` names it, and :meth:`CudaRing.packed` synchronizes the stream that packed a slot before the
bucket's message goes (the IPC event's part).

Engine (:func:`locate` then :func:`open_view`): before a byte is read, the handle's device must be visible in the
worker's process (found by UUID: ``torch.cuda.get_device_properties(i).uuid``, whatever ``CUDA_VISIBLE_DEVICES``
numbers it) and be the worker's own device (else INVALID_ARGUMENT CUDA_IPC_DEVICE, naming the UUID); once the
trainer granted the ring on the socket, :class:`CudaIpcView` opens it (``cudaIpcOpenMemHandle``), copies each
bucket out of its slot into the worker's buffer and synchronizes that copy before the worker acknowledges it, and
closes it (``cudaIpcCloseMemHandle``) when the receive ends, however it ends.

Units: sizes in bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from wsync_grpc.core.errors import InvalidArgument, Unavailable
from wsync_grpc.core.header import CUDA_IPC_HANDLE_BYTES, CudaIpcMemory, SharedMemoryHandle
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.transports.cuda_ipc.cudart import CudaError, runtime
from wsync_grpc.transports.shared_memory.backing import slot_view


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``address``, as ``__cuda_array_interface__`` (version 2: no stream; the
    transport orders its work itself) describes them, for ``torch.as_tensor`` to view without a copy (PyTorch keeps
    this object alive as long as a view of it lives)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 2,
        }


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process, as :func:`normal_uuid` writes it."""
    return normal_uuid(str(torch.cuda.get_device_properties(index).uuid))


def normal_uuid(uuid: str) -> str:
    """``uuid`` in one spelling: lower case, without the ``GPU-`` that ``nvidia-smi`` writes before it."""
    u = uuid.strip().lower()
    return u.removeprefix("gpu-")


def cuda_index(device: torch.device) -> int:
    """The index of CUDA device ``device`` (its current device where ``device`` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


class CudaRing:
    """The trainer's ring in GPU memory (a :class:`~wsync_grpc.transports.shared_memory.backing.RingMemory`).

    Args:
        slot_bytes: one slot's size, in bytes.
        slots: how many slots.
        place: the CUDA device it lives on (``"cuda:<index>"``, :meth:`CudaRingKind.place_of`).

    Raises:
        CudaError: the CUDA runtime cannot be found, or the allocation or its export failed (out of memory).
    """

    def __init__(self, slot_bytes: int, slots: int, place: str) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.place = place
        self.device = torch.device(place)
        index = cuda_index(self.device)
        rt = runtime()
        nbytes = slot_bytes * slots
        with rt.on_device(index):
            address = rt.malloc(nbytes)
            try:
                handle = rt.ipc_get_handle(address)
                uuid = device_uuid(index)
                view = torch.as_tensor(_DeviceBytes(address, nbytes), device=self.device)
            except BaseException:
                rt.free(address)
                raise
        self._address: int | None = address
        self._index = index
        self.cuda_ipc: CudaIpcMemory | None = CudaIpcMemory(uuid, handle, 0, nbytes)
        """What the update's handle says of this memory (``SharedMemoryHandle.cuda_ipc``)."""
        self._bytes: torch.Tensor | None = view
        _OWN[handle] = self

    @property
    def nbytes(self) -> int:
        """The ring's size, in bytes."""
        return self.slot_bytes * self.slots

    def grant_fds(self) -> list[int]:
        """None: the engine opens the memory by the handle's ``cuda_ipc``, not by a descriptor."""
        return []

    def slot(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of slot ``slot``, as a writable ``uint8`` CUDA tensor over the ring.

        Raises:
            ValueError: the ring was closed, or ``nbytes`` exceeds a slot.
        """
        return slot_view(self._bytes, slot, nbytes, self.slots, self.slot_bytes)

    def packed(self, slot: int) -> None:
        """The slot's bytes were packed: wait for the stream that packed them (this device's current stream), so
        that they are in GPU memory before the engines are told (the ordering an IPC event would give)."""
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Free the allocation (``cudaFree``, once the device's work on it ended); idempotent. CUDA leaves undefined
        what an engine that still has it open then reads (``cudaFree`` before the importer's
        ``cudaIpcCloseMemHandle``): each engine worker closes its mapping when its receive ends, before it reports
        done (Complete waits for that), so the sender frees it only after a send whose engines all ended; a send cut
        short (cancel, timeout) can leave a worker mapped until its own receive ends."""
        address, self._address = self._address, None
        self._bytes = None
        if self.cuda_ipc is not None:
            _OWN.pop(self.cuda_ipc.memory_handle, None)
        self.cuda_ipc = None
        if address is None:
            return
        torch.cuda.synchronize(self.device)
        rt = runtime()
        with rt.on_device(self._index):
            rt.free(address)


_OWN: weakref.WeakValueDictionary[bytes, CudaRing] = weakref.WeakValueDictionary()
"""This process's own rings by their IPC handle: an engine in the trainer's process (CUDA refuses to open a handle
in the process that exported it) reads such a ring through the trainer's own view of it (:class:`CudaIpcView`)."""


class CudaRingKind:
    """How the CUDA IPC sender finds and makes its ring (a
    :class:`~wsync_grpc.transports.shared_memory.backing.RingMemoryKind`): on the CUDA device of the trainer's
    tensors; no zero-copy reads of storages."""

    storages = False
    """The zero-copy path (reads of the trainer's shared-memory storages) is the memfd's alone."""

    def place_of(
        self,
        buckets: Sequence[Bucket],
        tensors: Callable[[Bucket], Mapping[str, torch.Tensor]],
        topology: SendTopology,
        device: torch.device,
    ) -> str:
        """The CUDA device (``"cuda:<index>"``) of the tensors of the first bucket, which all live on it (one
        process); a sharded trainer's rank 0 gathering each bucket: the client's ``device``, which must be CUDA (its
        ranks gather each bucket once, in lockstep: the tensors are not asked for here).

        Raises:
            ValueError: a tensor is not on a CUDA device (CUDA IPC carries tensors that live on a GPU: CPU
                tensors go by ``transport="shared_memory"``), they are on several devices, a gathering client whose
                device is not CUDA, or a sharded trainer's direct sends (every rank its own ring: not offered over
                CUDA IPC; its gather mode is).
        """
        if topology.kind == "direct":
            raise ValueError(
                "CUDA IPC carries one ring, from one trainer process or a sharded trainer's rank 0 (mode='gather'); "
                "a sharded trainer's direct sends are not offered over it"
            )
        if topology.kind != "single":
            if device.type != "cuda":
                raise ValueError(
                    f"transport 'cuda_ipc' from a sharded trainer packs on its client's device, here {device}: give "
                    "the client device='cuda:<index>' (or send by transport='shared_memory')"
                )
            return f"cuda:{cuda_index(device)}"
        if not buckets:
            raise ValueError("nothing to send: the update has no bucket")
        found = {n: t.device for n, t in tensors(buckets[0]).items()}
        off = sorted(n for n, d in found.items() if d.type != "cuda")
        if off:
            raise ValueError(
                f"transport 'cuda_ipc' carries tensors that live on a GPU; {off[0]!r} is on {found[off[0]]}: send CPU "
                "tensors by transport='shared_memory'"
            )
        devices = sorted({f"cuda:{cuda_index(d)}" for d in found.values()})
        if len(devices) != 1:
            raise ValueError(f"transport 'cuda_ipc' packs one ring on one GPU; the tensors are on {', '.join(devices)}")
        return devices[0]

    def allocate(self, slot_bytes: int, slots: int, place: str) -> CudaRing:
        """A :class:`CudaRing` of ``slots`` slots of ``slot_bytes`` bytes on ``place``.

        Raises:
            CudaError: see :class:`CudaRing`.
        """
        return CudaRing(slot_bytes, slots, place)


CUDA_RING = CudaRingKind()
"""The one :class:`CudaRingKind`."""


# ---------------------------------------------------------------------- the engine's half


def check_memory(m: CudaIpcMemory | None, h: SharedMemoryHandle, field: str) -> None:
    """What a header's ring must say of its GPU memory (checked with the header, before anything is connected).

    Raises:
        InvalidArgument: CUDA_IPC_HANDLE (no ``cuda_ipc``, a handle not of 64 bytes, a size below the ring's slots,
            ``storages`` set); CUDA_IPC_DEVICE (no device UUID).
    """
    if m is None:
        raise InvalidArgument("CUDA_IPC_HANDLE", f"{field}.cuda_ipc is required for transport TRANSPORT_CUDA_IPC")
    if len(m.memory_handle) != CUDA_IPC_HANDLE_BYTES:
        raise InvalidArgument(
            "CUDA_IPC_HANDLE",
            f"{field}.cuda_ipc.memory_handle has {len(m.memory_handle)} bytes; a cudaIpcMemHandle_t has "
            f"{CUDA_IPC_HANDLE_BYTES}",
        )
    if m.size_bytes < h.segment_bytes:
        raise InvalidArgument(
            "CUDA_IPC_HANDLE",
            f"{field}.cuda_ipc.size_bytes is {m.size_bytes}; the ring's {h.slots} slots of {h.slot_bytes} bytes need "
            f"{h.segment_bytes}",
        )
    if h.storages:
        raise InvalidArgument(
            "CUDA_IPC_HANDLE", f"{field}.storages is for a memfd ring (TRANSPORT_SHARED_MEMORY), not a CUDA one"
        )
    if not normal_uuid(m.device_uuid):
        raise InvalidArgument("CUDA_IPC_DEVICE", f"{field}.cuda_ipc.device_uuid is required")


def locate(m: CudaIpcMemory, device: torch.device) -> int:
    """The index, in this process, of the GPU holding ``m``, which must be this engine worker's ``device``.

    Raises:
        InvalidArgument: CUDA_IPC_DEVICE, naming the UUID: this worker is not on a CUDA device (a CPU engine), no
            device of this process has that UUID, or it is not the worker's own device.
    """
    uuid = normal_uuid(m.device_uuid)
    if device.type != "cuda":
        raise InvalidArgument(
            "CUDA_IPC_DEVICE",
            f"the trainer's ring is on GPU {uuid}, but this engine worker runs on {device}: CUDA IPC needs the "
            "engine on the trainer's GPU (a CPU engine takes transport TRANSPORT_SHARED_MEMORY)",
            device_uuid=uuid,
        )
    if not torch.cuda.is_available():
        raise InvalidArgument(
            "CUDA_IPC_DEVICE", f"GPU {uuid}: CUDA is not available in this engine worker's process", device_uuid=uuid
        )
    mine = cuda_index(device)
    seen = {i: device_uuid(i) for i in range(torch.cuda.device_count())}
    found = [i for i, u in seen.items() if u == uuid]
    if not found:
        raise InvalidArgument(
            "CUDA_IPC_DEVICE",
            f"no device of this engine worker's process has UUID {uuid} (it sees {len(seen)}: "
            f"{', '.join(seen.values()) or 'none'}): the trainer's GPU is not this engine's",
            device_uuid=uuid,
        )
    if found[0] != mine:
        raise InvalidArgument(
            "CUDA_IPC_DEVICE",
            f"the trainer's ring is on GPU {uuid} (cuda:{found[0]} here), not on this engine worker's device "
            f"cuda:{mine} ({seen.get(mine, '?')}): CUDA IPC needs the trainer on the engine worker's GPU",
            device_uuid=uuid,
        )
    return mine


class CudaIpcView:
    """A trainer's ring opened in this engine worker's process (a
    :class:`~wsync_grpc.transports.shared_memory.backing.RingView`): read only, though CUDA maps it writable.

    Args:
        m: the ring's memory (checked by :func:`check_memory`).
        index: the device holding it here (:func:`locate`).

    Raises:
        Unavailable: CUDA_IPC_OPEN, the runtime refused the handle (a freed allocation, a handle of this very
            process, no runtime), naming CUDA's error.
    """

    def __init__(self, m: CudaIpcMemory, index: int) -> None:
        self._index = index
        self.device = torch.device("cuda", index)
        self._address: int | None = None
        own = _OWN.get(m.memory_handle)
        if own is not None:  # the trainer's ring in this very process: its own view, nothing to open or close
            try:
                whole = own.slot(0, own.slot_bytes).untyped_storage()  # the whole allocation, as the trainer views it
            except ValueError as e:  # closed meanwhile
                raise Unavailable("CUDA_IPC_OPEN", f"the trainer's CUDA ring in this process is gone: {e}") from e
            self._bytes: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=self.device).set_(whole)
            self._bytes = self._bytes[m.offset_bytes : m.offset_bytes + m.size_bytes]
            return
        try:
            rt = runtime()
            with rt.on_device(index):
                address = rt.ipc_open(m.memory_handle)
        except (CudaError, ValueError) as e:
            raise Unavailable("CUDA_IPC_OPEN", f"opening the trainer's CUDA IPC handle failed: {e}") from e
        try:
            self._bytes = torch.as_tensor(_DeviceBytes(address + m.offset_bytes, m.size_bytes), device=self.device)
        except BaseException:
            with rt.on_device(index):
                rt.ipc_close(address)
            raise
        self._address = address

    def copy(self, start: int, flat: torch.Tensor) -> None:
        """Copy ``flat.numel()`` bytes from ``start`` into ``flat`` (on the worker's device), and wait for the copy
        (the acknowledgement that follows lets the trainer overwrite the slot)."""
        assert self._bytes is not None
        flat.copy_(self._bytes[start : start + flat.numel()])
        torch.cuda.synchronize(flat.device if flat.device.type == "cuda" else self.device)

    def close(self) -> bool:
        """Close the mapping (``cudaIpcCloseMemHandle``, after this device's work ended); idempotent. Returns
        ``False``: no view of it is handed out (each copy's is gone with it).

        Raises:
            CudaError: the runtime refused to close it.
        """
        address, self._address = self._address, None
        self._bytes = None
        if address is not None:
            torch.cuda.synchronize(self.device)
            rt = runtime()
            with rt.on_device(self._index):
                rt.ipc_close(address)
        return False
