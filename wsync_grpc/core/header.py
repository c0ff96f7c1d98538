"""An update's header (``wsync.v1.PrepareHeader``) in domain terms, and the checks that need only the header.

The rest of an update's metadata (its buckets, checked against the model) is
:mod:`wsync_grpc.core.validation`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsync_grpc.core.errors import InvalidArgument, Unimplemented
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.lora import LoraSpec, check_name, check_spec

CUDA_IPC_HANDLE_BYTES = 64
"""Length of a ``cudaIpcMemHandle_t``, in bytes (``CUDA_IPC_HANDLE_SIZE`` in CUDA's ``driver_types.h``)."""


@dataclass(frozen=True)
class CudaIpcMemory:
    """A ring held in GPU memory (``wsync.v1.CudaIpcMemory``, ``TRANSPORT_CUDA_IPC``): one ``cudaMalloc`` allocation
    of the trainer's, exported with ``cudaIpcGetMemHandle``; structured fields, never a pickled handle.

    Attributes:
        device_uuid: the UUID of the GPU holding it, as ``str(torch.cuda.get_device_properties(i).uuid)`` gives it
            (the engine finds the device by identity, whatever ``CUDA_VISIBLE_DEVICES`` numbers it).
        memory_handle: the ``cudaIpcMemHandle_t``'s :data:`CUDA_IPC_HANDLE_BYTES` bytes.
        offset_bytes: where the ring starts in the allocation, in bytes (0 for a wsync trainer's own allocation).
        size_bytes: the allocation's size from ``offset_bytes`` on, in bytes (at least the ring's slots).
    """

    device_uuid: str
    memory_handle: bytes
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class SharedMemoryHandle:
    """Where a colocated trainer hands over the ring of a ``TRANSPORT_SHARED_MEMORY`` update (a memfd) or a
    ``TRANSPORT_CUDA_IPC`` one (a CUDA allocation, :attr:`cuda_ipc`) (``wsync.v1.SharedMemoryHandle``): structured
    fields, never a pickled handle.

    Attributes:
        socket_name: the trainer's Unix socket in the abstract namespace (Linux), without the leading NUL.
        token: the 32 random bytes an engine worker sends first on the socket (the Prepare's secret).
        boot_id: the trainer host's ``/proc/sys/kernel/random/boot_id`` (an engine elsewhere refuses).
        slot_bytes: one ring slot's size, in bytes (every bucket fits in one).
        slots: the ring's slots (at least 2: the trainer packs one while the engine copies another).
        storages: the trainer may send a bucket whose tensors already live in its shared memory as reads of
            those storages instead of through a slot (:mod:`wsync_grpc.transports.shared_memory.storages`);
            ``False``: every bucket comes through a slot.
        cuda_ipc: the ring's memory when it is a CUDA allocation (``TRANSPORT_CUDA_IPC``,
            :mod:`wsync_grpc.transports.cuda_ipc`); ``None``: a memfd handed over on the socket.
    """

    socket_name: str
    token: bytes
    boot_id: str
    slot_bytes: int
    slots: int
    storages: bool = False
    cuda_ipc: CudaIpcMemory | None = None

    @property
    def segment_bytes(self) -> int:
        """The segment's size: every slot, in bytes."""
        return self.slot_bytes * self.slots


@dataclass(frozen=True)
class UpdateHeader:
    """An update's header (``wsync.v1.PrepareHeader``), enum fields resolved to their defaults.

    Attributes:
        update_id: the update's id; empty until :meth:`UpdateValidator.header` gives it one.
        weight_version: the version the engine serves once the update succeeded.
        layout: how buckets travel.
        apply_mode: when the engine applies.
        bucket_count: buckets the Prepare stream carries.
        total_bytes: bytes the buckets declare, in bytes.
        incremental: whether Update may declare further buckets.
        transport: how the bytes travel.
        checkpoint_path: the safetensors checkpoint a disk update reads (as sent; resolved by the engine).
        adapter: the LoRA adapter the update loads instead of base weights; ``None`` for base weights.
            From a disk update's header only its name is known until the engine read ``adapter_config.json``.
        digests_follow: every bucket has a digest, in its spec or declared by a later Update
            (``wsync.v1.PrepareHeader.digests_follow``); a worker holds a bucket until its digest came.
        shared_memory: where a shared-memory update's segment is handed over; ``None`` for other transports, and
            where :attr:`shared_memory_ranks` names one ring per trainer rank.
        shared_memory_ranks: a sharded trainer's direct sends through shared memory: entry ``r`` is trainer rank
            ``r``'s ring (``wsync.v1.PrepareHeader.shared_memory_ranks``), each bucket read from its ``src``'s;
            empty: one ring, :attr:`shared_memory`.
        base_weight_version: a delta's base version (``wsync.v1.PrepareHeader.base_weight_version``); empty: a
            whole update.
        base_weight_identity: the engine-issued identity of that base (``GetStatusResponse.weight_identity``).
        delta_base: be ready to take a delta against what this update leaves served
            (``wsync.v1.PrepareHeader.delta_base``: workers that cannot read it back keep a copy).
    """

    update_id: str
    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    bucket_count: int
    total_bytes: int
    incremental: bool
    transport: Transport = Transport.BROADCAST
    checkpoint_path: str = ""
    adapter: LoraSpec | None = None
    digests_follow: bool = False
    shared_memory: SharedMemoryHandle | None = None
    base_weight_version: str = ""
    base_weight_identity: str = ""
    delta_base: bool = False
    shared_memory_ranks: tuple[SharedMemoryHandle, ...] = ()

    @property
    def shared_memory_rings(self) -> tuple[SharedMemoryHandle, ...]:
        """The rings a shared-memory update's buckets come through, entry ``r`` for the buckets whose ``src`` is ``r``:
        :attr:`shared_memory_ranks`, or :attr:`shared_memory` alone; empty for other transports."""
        return rings_of(self.shared_memory, self.shared_memory_ranks)

    @property
    def delta(self) -> bool:
        """Whether this update is a delta against a base it names (:mod:`wsync_grpc.core.delta`)."""
        return bool(self.base_weight_version)

    @property
    def flattened(self) -> bool:
        """Whether buckets travel as one flat byte buffer each."""
        return self.layout is Layout.FLATTENED

    @property
    def streaming(self) -> bool:
        """Whether buckets are applied as they arrive."""
        return self.apply_mode is ApplyMode.STREAMING


def rings_of(
    single: SharedMemoryHandle | None, ranks: tuple[SharedMemoryHandle, ...]
) -> tuple[SharedMemoryHandle, ...]:
    """The rings of a shared-memory update, one per sending trainer rank (in rank order): ``ranks`` when some are
    named, else ``single`` alone, else none."""
    if ranks:
        return ranks
    return (single,) if single is not None else ()


def transport_unimplemented(transport: Transport) -> Unimplemented:
    """The error for a transport this engine does not offer (reason TRANSPORT_UNIMPLEMENTED)."""
    name = f"TRANSPORT_{transport.name}"
    return Unimplemented(
        "TRANSPORT_UNIMPLEMENTED",
        f"transport {name} is not implemented by this engine yet; use TRANSPORT_BROADCAST",
        transport=name,
    )


def check_adapter_header(h: UpdateHeader, allow: bool, from_source: bool) -> None:
    """An adapter update names a valid adapter, applies staged and, sent as buckets, gives its whole spec.

    ``from_source``: the engine reads the adapter from the source the header names (its spec too).

    Raises:
        Unimplemented: ADAPTERS_UNIMPLEMENTED (``allow`` is false: the engine serves no adapters).
        InvalidArgument: BAD_ADAPTER_NAME, BAD_ADAPTER_CONFIG, ADAPTER_NOT_STAGED, NOT_INCREMENTAL_ADAPTER.
    """
    assert h.adapter is not None
    if not allow:
        raise Unimplemented(
            "ADAPTERS_UNIMPLEMENTED", "this engine serves no LoRA adapters (a vLLM engine needs --enable-lora)"
        )
    check_name(h.adapter.name)
    if h.streaming:
        raise InvalidArgument("ADAPTER_NOT_STAGED", "an adapter update applies staged: leave apply_mode unset")
    if h.incremental:
        raise InvalidArgument("NOT_INCREMENTAL_ADAPTER", "an adapter update cannot be incremental")
    if not from_source:
        check_spec(h.adapter)


DELTA_TRANSPORTS = (Transport.BROADCAST, Transport.SHARED_MEMORY)
"""The transports a delta travels by: those whose buckets the trainer packs."""


def check_delta_header(h: UpdateHeader) -> None:
    """A delta names its base's identity, travels flattened by a transport the trainer packs, and carries base
    weights; a whole update names no identity.

    Raises:
        InvalidArgument: DELTA_UNSUPPORTED, MISSING_BASE_IDENTITY, UNEXPECTED_BASE_IDENTITY.
    """
    if not h.delta:
        if h.base_weight_identity:
            raise InvalidArgument(
                "UNEXPECTED_BASE_IDENTITY", "header.base_weight_identity is for a delta (base_weight_version set)"
            )
        return
    if not h.base_weight_identity:
        raise InvalidArgument(
            "MISSING_BASE_IDENTITY",
            "a delta names the weight_identity of its base (GetStatus, or the base update's Complete reply)",
        )
    why = ""
    if h.transport not in DELTA_TRANSPORTS:
        why = f"transport TRANSPORT_{h.transport.name}"
    elif not h.flattened:
        why = "the individual layout"
    elif h.adapter is not None:
        why = "an adapter update"
    if why:
        raise InvalidArgument(
            "DELTA_UNSUPPORTED",
            f"a delta (header.base_weight_version) travels flattened, by broadcast or shared memory, and carries "
            f"base weights; not by {why}",
        )
