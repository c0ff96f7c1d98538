"""The shared-memory transport (``TRANSPORT_SHARED_MEMORY``): a trainer on the engine's host, no wire at all.

The trainer packs each bucket into one slot of a ring in a shared-memory segment; every engine worker
copies it out and acknowledges it, and the trainer packs a later bucket into the slot once every worker
has. No process group is formed (no Init): the handle travels in the Prepare header
(``PrepareHeader.shared_memory``, :class:`~wsync_grpc.core.header.SharedMemoryHandle`), as structured fields,
never pickled. Flattened layout only; the bytes in a slot are exactly what a broadcast puts on the wire
(:func:`~wsync_grpc.core.packing.pack_bucket`, zero padding), so bucket digests are the same. It carries what
a broadcast carries: base weights (``TrainerClient.sync``), a live LoRA adapter's tensors
(``TrainerClient.sync_adapter``: read once, by the engine's first worker in its own process, as an adapter
needing no group is) and a catch-up of the members behind (``TrainerClient.catch_up``); and a sharded trainer's
syncs in the gather mode (``ShardedTrainerClient.sync(mode="gather")``: its ranks gather each bucket in lockstep,
as for a broadcast, and rank 0 packs it into its ring) and in the direct mode (``mode="direct"``: every rank packs
the buckets of its own pieces into a ring of its own; the header names them all, ``PrepareHeader.shared_memory_ranks``
entry ``r`` for trainer rank ``r``, and each worker opens every ring and reads each bucket from its ``src``'s).

Halves: :class:`~wsync_grpc.transports.shared_memory.sender.SharedMemorySender` (the trainer's: the
ring; the segment and its handover are :mod:`~wsync_grpc.transports.shared_memory.handover`'s) and
:class:`~wsync_grpc.transports.shared_memory.receiver.SharedMemoryReceiver` (one per engine worker); the
socket protocol between them is :mod:`wsync_grpc.transports.shared_memory.protocol`.

Zero copy (:mod:`~wsync_grpc.transports.shared_memory.storages`): a bucket whose tensors already live in the
trainer's shared memory (``Module.share_memory()``; CPU, contiguous, in the wire dtype) is not packed: the
engine workers get read-only descriptors of those storages and read each tensor's bytes into their buffer at
the bucket's offsets (one copy in all). Those storages are not sealed (their owner may shrink them), so they are
read with ``pread``, never mapped: a storage that shrinks is an error, not a crash. Offered when the handle says
``storages`` (the grant's magic differs, so an engine without the path refuses before any byte is read).

Why a memfd passed over an abstract Unix socket (and not a named segment under ``/dev/shm``):

- **nothing to leak**: a memfd has no name in any file system, and an abstract socket (a name starting
  with a NUL byte) is no file either. Both vanish with the last process holding them: a trainer or
  engine SIGKILLed mid-update leaves nothing in ``/dev/shm`` or anywhere else to clean up, which a
  ``shm_open`` name, created and unlinked by a process that may die in between, cannot promise;
- **both ends checked by the kernel**: each side reads the other's credentials (``SO_PEERCRED``, recorded
  by the kernel, not claimed by the peer): the trainer hands the segment only to a process of its own
  user that also presents the update's 32-byte token (sent in the Prepare header, so only the engine the
  trainer prepared knows it); the engine takes the segment only from a process of its own user;
- **capabilities, not names**: the segment is handed over as a descriptor (``SCM_RIGHTS``), opened
  read-only: the engine can map it read-only and nothing else. It is sealed against resizing
  (``F_SEAL_SHRINK``, ``F_SEAL_GROW``), so no page can vanish under an engine's mapping (which would be
  a ``SIGBUS``, a crash, rather than an error); the engine refuses a segment without that seal. The
  engine closes the descriptor as soon as it mapped it (Python's ``mmap`` keeps a duplicate until it
  unmaps), and unmaps when its receive ends.

Limits: abstract Unix sockets belong to a network namespace, so the engine must share the trainer's
(as it shares its host: the header carries the trainer's boot id, and an engine on another host or boot
refuses the update with INVALID_ARGUMENT SHARED_MEMORY_HOST); engines in another container's network
namespace cannot use this transport (SHARED_MEMORY_CONNECT). Linux only. One ring (one trainer process, or a
sharded trainer's rank 0 sending what its ranks gathered) carries whole tensors only; pieces come through one ring
per rank (a sharded trainer's direct sends, every rank on the engines' host).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import SharedMemoryHandle, UpdateHeader, transport_unimplemented
from wsync_grpc.core.layout import Bucket, Layout, Transport
from wsync_grpc.core.update import PlannedUpdate, ReceivePlan
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.sending import SendSite, TransportSender
from wsync_grpc.transports.shared_memory.protocol import MAX_NAME_CHARS, TOKEN_BYTES, boot_id
from wsync_grpc.transports.shared_memory.receiver import SharedMemoryReceiver
from wsync_grpc.transports.shared_memory.sender import SharedMemorySender
from wsync_grpc.worker.receiver import Receiver, ReceiveSite

__all__ = ["PART", "SharedMemoryTransport"]

MIN_SLOTS = 2
"""The fewest ring slots a handle may name (the trainer packs one while the engines copy another)."""

MAX_RINGS = 1024
"""The most rings a header may name (``shared_memory_ranks``: one per sending trainer rank; each engine worker
connects to every one)."""


def _check_handle(m: SharedMemoryHandle, field: str, here: str) -> None:
    """Check one handle of a header (``field``: where it is, for the messages; ``here``: this host's boot id, ``""``
    when unreadable).

    Raises:
        InvalidArgument: SHARED_MEMORY_HANDLE, SHARED_MEMORY_HOST (see :meth:`SharedMemoryTransport.check_header`).
    """
    if m.slots < MIN_SLOTS or m.slot_bytes <= 0:
        raise InvalidArgument(
            "SHARED_MEMORY_HANDLE",
            f"{field} names {m.slots} slots of {m.slot_bytes} bytes; at least {MIN_SLOTS} slots of at least 1 byte "
            "are needed",
        )
    if len(m.token) != TOKEN_BYTES:
        raise InvalidArgument("SHARED_MEMORY_HANDLE", f"{field}.token has {len(m.token)} bytes, not {TOKEN_BYTES}")
    if not m.socket_name or len(m.socket_name) > MAX_NAME_CHARS or "\0" in m.socket_name:
        raise InvalidArgument(
            "SHARED_MEMORY_HANDLE", f"{field}.socket_name must have 1 to {MAX_NAME_CHARS} characters and no NUL"
        )
    if not here or m.boot_id != here:
        raise InvalidArgument(
            "SHARED_MEMORY_HOST",
            f"the trainer's boot id {m.boot_id!r} is not this host's ({here or 'unreadable'}): shared memory needs "
            "the trainer on the engine's host",
        )


@dataclass(frozen=True)
class SharedMemoryTransport:
    """``TRANSPORT_SHARED_MEMORY``, both halves (a :class:`~wsync_grpc.transports.TransportPart`; see the module)."""

    kind: Transport = Transport.SHARED_MEMORY
    needs_group: bool = False
    engine_builds_buckets: bool = False

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """A shared-memory update names well-formed handles from this host (one ring, or one per trainer rank), is
        flattened and declares every bucket at Prepare.

        Raises:
            InvalidArgument: SHARED_MEMORY_HANDLE (none, both ``shared_memory`` and ``shared_memory_ranks``, more
                than :data:`MAX_RINGS` rings, or a handle with slots below 2, a slot of 0 bytes, a token not of 32
                bytes, a socket name empty, too long or holding a NUL; the ring's memory: :meth:`check_memory`),
                SHARED_MEMORY_HOST (another host's or boot's, or this host's boot id cannot be read),
                SHARED_MEMORY_LAYOUT (individual), SHARED_MEMORY_INCREMENTAL.
        """
        if h.shared_memory is None and not h.shared_memory_ranks:
            raise InvalidArgument(
                "SHARED_MEMORY_HANDLE", f"header.shared_memory is required for transport TRANSPORT_{self.kind.name}"
            )
        if h.shared_memory is not None and h.shared_memory_ranks:
            raise InvalidArgument(
                "SHARED_MEMORY_HANDLE",
                "header.shared_memory and header.shared_memory_ranks are both set: one ring, or one per trainer rank",
            )
        if len(h.shared_memory_ranks) > MAX_RINGS:
            raise InvalidArgument(
                "SHARED_MEMORY_HANDLE",
                f"header.shared_memory_ranks names {len(h.shared_memory_ranks)} rings; at most {MAX_RINGS}",
            )
        here = boot_id()
        for r, m in enumerate(h.shared_memory_rings):
            field = f"header.shared_memory_ranks[{r}]" if h.shared_memory_ranks else "header.shared_memory"
            _check_handle(m, field, here)
            self.check_memory(m, field)
        if h.layout is not Layout.FLATTENED:
            raise InvalidArgument(
                "SHARED_MEMORY_LAYOUT", "a shared-memory update carries flattened buckets only, one per ring slot"
            )
        if h.incremental:
            raise InvalidArgument(
                "SHARED_MEMORY_INCREMENTAL",
                "a shared-memory update declares every bucket at Prepare: the segment's slots are sized for them "
                "and the trainer sends to the workers connected by then",
            )
        return h

    def check_memory(self, m: SharedMemoryHandle, field: str) -> None:
        """What backs the ring ``m`` (at ``field``): a memfd, handed over on the socket (``cuda_ipc`` unset).

        Raises:
            InvalidArgument: SHARED_MEMORY_HANDLE, ``cuda_ipc`` set (GPU memory is ``TRANSPORT_CUDA_IPC``'s).
        """
        if m.cuda_ipc is not None:
            raise InvalidArgument(
                "SHARED_MEMORY_HANDLE",
                f"{field}.cuda_ipc is for transport TRANSPORT_CUDA_IPC: a shared-memory ring is a memfd",
            )

    def check_update(self) -> None:
        """Refuse further buckets (:meth:`check_header` refused incremental updates; digests may still follow).

        Raises:
            Unimplemented: TRANSPORT_UNIMPLEMENTED, always.
        """
        raise transport_unimplemented(self.kind)

    def plan(
        self, header: UpdateHeader, validator: UpdateValidator, buckets: list[Bucket], context: PlanContext
    ) -> PlannedUpdate:
        """The stream's header and buckets as they are, once each has a ring (its ``src``'s) and fits its slots.

        Raises:
            InvalidArgument: SHARED_MEMORY_SOURCE, a bucket's ``src`` names no ring of the header (a single ring
                carries rank 0's buckets only); SHARED_MEMORY_SLOT, a bucket larger than its ring's slot;
                SHARED_MEMORY_PIECES, a bucket holds a piece of a tensor through a single ring (pieces come from a
                sharded trainer's direct sends, one ring per rank: ``shared_memory_ranks``).
        """
        rings = header.shared_memory_rings
        assert rings, "check_header refused the update"
        for b in buckets:
            if b.src >= len(rings):
                raise InvalidArgument(
                    "SHARED_MEMORY_SOURCE",
                    f"bucket {b.index} comes from trainer rank {b.src}, but the header names {len(rings)} ring(s) "
                    "(header.shared_memory_ranks: one per sending trainer rank)",
                    bucket=str(b.index),
                )
            m = rings[b.src]
            if b.size_bytes > m.slot_bytes:
                raise InvalidArgument(
                    "SHARED_MEMORY_SLOT",
                    f"bucket {b.index} has {b.size_bytes} bytes; a slot of trainer rank {b.src}'s segment holds "
                    f"{m.slot_bytes}",
                    bucket=str(b.index),
                )
            if not header.shared_memory_ranks and any(t.piece is not None for t in b.tensors):
                raise InvalidArgument(
                    "SHARED_MEMORY_PIECES",
                    f"bucket {b.index} holds a piece of a tensor through a single ring: a sharded trainer's direct "
                    "sends name one ring per rank (header.shared_memory_ranks)",
                    bucket=str(b.index),
                )
        return PlannedUpdate(header, buckets)

    def receiver(self, site: ReceiveSite, plan: ReceivePlan) -> Receiver:
        """A :class:`~wsync_grpc.transports.shared_memory.receiver.SharedMemoryReceiver` for the worker at ``site``."""
        return SharedMemoryReceiver(site, plan)

    def sender(self, site: SendSite) -> TransportSender:
        """A :class:`~wsync_grpc.transports.shared_memory.sender.SharedMemorySender`."""
        return SharedMemorySender(site)


PART = SharedMemoryTransport()
"""What :func:`~wsync_grpc.transports.transport_for` reads for ``Transport.SHARED_MEMORY``."""
