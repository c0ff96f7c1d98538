"""One update as the engine's parts see it: what it carries, how its bytes travel, what every worker receives.

Three things vary between updates, and each has one name here:

- the **payload**, :class:`Payload`: base weights, or a LoRA adapter (``PrepareHeader.adapter``);
- the **transport**'s rules, :class:`TransportRules`: what a transport module in
  :mod:`wsync_grpc.transports` tells the parts that never touch its bytes (the
  Prepare stream's checks, whether the group is needed, who declares the buckets);
- the **receive plan**, :class:`ReceivePlan`: the typed request every worker gets to
  start receiving one update (transport, payload, layout, apply mode, buckets or
  files, deadline), encoded once for a worker process boundary
  (:func:`~wsync_grpc.core.messages.plan_to_msg`).

Pure: no gRPC, no torch.distributed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from wsync_grpc.core.header import SharedMemoryHandle, UpdateHeader, rings_of
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, Transport


class Payload(enum.Enum):
    """What an update carries."""

    WEIGHTS = "weights"
    """The base model's weights: applied into the served tensors, published as the engine's weight version."""
    ADAPTER = "adapter"
    """A LoRA adapter (``PrepareHeader.adapter``): loaded beside the base model, which keeps its version."""

    @classmethod
    def of(cls, header: UpdateHeader) -> Payload:
        """The payload ``header`` announces."""
        return cls.ADAPTER if header.adapter is not None else cls.WEIGHTS


class TransportRules(Protocol):
    """What a transport tells the parts that never touch its bytes (implemented in :mod:`wsync_grpc.transports`)."""

    @property
    def kind(self) -> Transport:
        """The contract's ``Transport`` value it serves."""
        ...

    @property
    def needs_group(self) -> bool:
        """Whether its bytes travel over the weight-sync group (the engine must have joined: Init first)."""
        ...

    @property
    def engine_builds_buckets(self) -> bool:
        """Whether the engine builds the buckets from the source the header names (a checkpoint on disk).

        ``False``: the trainer declares them in the Prepare stream (and Update, when incremental).
        """
        ...

    def check_header(self, h: UpdateHeader) -> UpdateHeader:
        """The header checks of this transport; returns the header as this transport carries it.

        Raises:
            InvalidArgument: a header field this transport cannot carry, or misses.
            Unimplemented: TRANSPORT_UNIMPLEMENTED, the transport is not built (yet).
        """
        ...


@dataclass(frozen=True)
class SourceFile:
    """A file a disk update reads: where it lies beneath one of the engine's roots, and which file it was.

    The engine opened it once at Prepare, beneath the root and through no
    symlink, and read its header through that open file
    (:mod:`~wsync_grpc.transports.disk.confined`). Readers in that process read
    its tensors through the same open file (``handle``); a reader in another
    process (an engine's worker) opens ``path`` beneath ``root`` again the same
    way and refuses anything but the very file opened at Prepare (same
    ``device`` and ``inode``).

    Attributes:
        root: the checkpoint root it lies beneath (a real path, as the operator allowed it).
        path: its path beneath ``root``, ``/``-separated (no ``..``, no symlink on the way).
        device: ``st_dev`` of the file opened at Prepare.
        inode: ``st_ino`` of the file opened at Prepare.
        handle: the open file, for readers in the process that opened it (the disk transport's own type);
            ``None`` in any other process (it never crosses a process boundary).
    """

    root: str
    path: str
    device: int
    inode: int
    handle: object | None = field(default=None, compare=False, repr=False, hash=False)

    @property
    def name(self) -> str:
        """Its path beneath the root (what messages show)."""
        return self.path


@dataclass(frozen=True)
class PlannedUpdate:
    """What an engine's Prepare settled for one update: its header, its validated buckets, and their source.

    Attributes:
        header: the validated header (an adapter read from a source has its spec completed from there).
        buckets: the validated buckets declared so far (or built from the source), in index order.
        files: where the engine reads each tensor (a disk update's tensor name -> safetensors file); empty
            when the bytes arrive over the group.
        release: lets go of what planning opened (the files' shared open descriptors); called once the
            update's receivers exist (they hold their own references), or when the update is refused.
    """

    header: UpdateHeader
    buckets: list[Bucket]
    files: Mapping[str, SourceFile] = field(default_factory=dict)
    release: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)


@dataclass(frozen=True)
class ReceivePlan:
    """What every worker of an engine receives for one update: the typed request that arms its receivers.

    Built once by the engine's update session from the validated header and
    buckets; the same value reaches a receiver thread in this process or, through
    :func:`~wsync_grpc.core.messages.plan_to_msg`, one in an engine's worker process.

    Attributes:
        transport: how the bytes travel (the contract's ``Transport``).
        payload: base weights or a LoRA adapter (an adapter is staged and kept apart from the model).
        layout: how buckets travel (flattened: one flat ``uint8`` buffer each; individual: one tensor each).
        apply_mode: staged (kept until Complete) or streaming (applied as each bucket arrives).
        buckets: the buckets declared so far, in index order.
        closed: no bucket will be declared after these (``False`` only for an incremental update).
        files: a disk update's tensor name -> the safetensors file holding it (as opened at Prepare); empty
            for a broadcast.
        timeout_s: bound for arming every receiver, in seconds.
        digests_follow: every bucket has a digest, in its :attr:`Bucket.digest` or declared later
            (:meth:`~wsync_grpc.worker.feed.BucketFeed.add_digests`); a receiver holds a bucket until it has it.
        update_id: the update's id (``PrepareHeader.update_id``), for a transport whose bytes are found by it;
            ``""`` where none was given.
        shared_memory: where a shared-memory update's segment is handed over (``PrepareHeader.shared_memory``);
            ``None`` for other transports, or where ``shared_memory_ranks`` names one ring per trainer rank.
        shared_memory_ranks: a sharded trainer's direct sends: entry ``r`` is trainer rank ``r``'s ring
            (``PrepareHeader.shared_memory_ranks``); empty: one ring, ``shared_memory``.
        keep_base: every worker keeps a copy of the update's tensors (in the wire dtype, by canonical name) once
            applied, the base a later delta is applied to (``PrepareHeader.delta_base``, on an engine whose workers
            cannot read back what they serve).
    """

    transport: Transport
    payload: Payload
    layout: Layout
    apply_mode: ApplyMode
    buckets: tuple[Bucket, ...]
    closed: bool
    files: Mapping[str, SourceFile] = field(default_factory=dict)
    timeout_s: float = 60.0
    digests_follow: bool = False
    update_id: str = ""
    shared_memory: SharedMemoryHandle | None = None
    keep_base: bool = False
    shared_memory_ranks: tuple[SharedMemoryHandle, ...] = ()

    @property
    def shared_memory_rings(self) -> tuple[SharedMemoryHandle, ...]:
        """The rings the buckets come through, entry ``r`` for the buckets whose ``src`` is ``r``
        (:func:`~wsync_grpc.core.header.rings_of`); empty for other transports."""
        return rings_of(self.shared_memory, self.shared_memory_ranks)

    @property
    def streaming(self) -> bool:
        """Whether buckets are applied as they arrive."""
        return self.apply_mode is ApplyMode.STREAMING
