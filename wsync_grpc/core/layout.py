"""The one model of an update's buckets, shared by the trainer (planning, packing) and the engines (receive).

A weight update travels as *buckets*. In the flattened layout
(:attr:`Layout.FLATTENED`, SGLang's ``flattened_bucket`` load format) a bucket
is one contiguous ``uint8`` buffer of ``size_bytes`` holding its tensors at
aligned byte offsets, sent with one broadcast. In the individual layout
(:attr:`Layout.INDIVIDUAL`, SGLang's default ``update_weights_from_distributed``)
every tensor is its own broadcast, in its wire dtype and shape; buckets then
only group the metadata (and bound the engine's memory in streaming apply).

The enums here are the domain side of ``wsync.v1.BucketLayout``,
``wsync.v1.ApplyMode`` and ``wsync.v1.Transport``; their values are the names
a trainer passes to :meth:`~wsync_grpc.trainer.client.TrainerClient.sync`
(``"flattened"``, ``"staged"``...). :mod:`wsync_grpc.wire.convert` maps them to
and from the proto numbers, one map per enum. Sizes are in bytes throughout.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from wsync_grpc.core.delta import DeltaCoding
from wsync_grpc.core.digests import Digest


class Layout(enum.Enum):
    """How a bucket travels: one broadcast per bucket, or one per tensor (``wsync.v1.BucketLayout``)."""

    FLATTENED = "flattened"
    INDIVIDUAL = "individual"


class ApplyMode(enum.Enum):
    """When an engine applies an update (``wsync.v1.ApplyMode``)."""

    STAGED = "staged"
    """Received into buffers while the engine serves the old weights; applied at Complete."""
    STREAMING = "streaming"
    """Applied bucket by bucket as it arrives; the engine is frozen until Complete."""


class Transport(enum.Enum):
    """How the bytes of an update travel (``wsync.v1.Transport``)."""

    BROADCAST = "broadcast"
    CUDA_IPC = "cuda_ipc"
    DISK = "disk"
    SHARED_MEMORY = "shared_memory"


@dataclass(frozen=True)
class Piece:
    """Where one piece of a tensor sharded across trainer ranks sits in the whole tensor (``wsync.v1.TensorShard``).

    Attributes:
        global_shape: the whole tensor's shape.
        offsets: where the piece starts in it, in elements, one per dimension (the piece's own
            shape is its slot's ``shape``).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def index(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The slices of the whole tensor that a piece of ``shape`` covers (``whole[piece.index(shape)]``)."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, shape, strict=True))


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a bucket.

    Attributes:
        name: the name it is sent under (Hugging Face naming).
        dtype: the wire dtype.
        shape: its shape; ``()`` for a scalar.
        offset: where it starts inside the bucket's flat buffer, in bytes (a
            multiple of its element size; 0 in the individual layout).
        nbytes: its size on the wire, in bytes (``numel * element_size(dtype)``; a delta entry's
            :meth:`DeltaCoding.nbytes <wsync_grpc.core.delta.DeltaCoding.nbytes>`).
        canonical: the engine's canonical name for it (tied aliases resolved);
            the name itself on the trainer side.
        load: False for a tied alias whose canonical tensor is already in the
            same update: its bytes are received but loaded only once.
        piece: set when this slot is one piece of the tensor (a sharded trainer's direct send):
            ``shape`` and ``nbytes`` are then the piece's; the engine assembles the pieces of a
            name into the whole tensor before loading it. ``None``: the whole tensor.
        delta: set when this slot carries only the elements changed since the update's base
            (:mod:`wsync_grpc.core.delta`; ``wsync.v1.TensorSpec.delta``): ``shape`` stays the tensor's,
            ``nbytes`` is the entry's. ``None``: every element.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    canonical: str
    load: bool = True
    piece: Piece | None = None
    delta: DeltaCoding | None = None

    @property
    def end(self) -> int:
        """One past its last byte inside the flat buffer, in bytes."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Bucket:
    """One bucket of an update.

    Attributes:
        index: position in the update, from 0.
        size_bytes: length of the flat buffer, in bytes: the end of its last
            tensor (no trailing padding; padding sits only between tensors). In
            the individual layout, the sum of its tensors' sizes.
        tensors: its tensors, in the order they travel.
        src: the trainer rank that broadcasts it (``wsync.v1.BucketSpec.src_rank``); 0 for a
            single-sender trainer.
        digest: the hash of its bytes on the wire, when declared with it (``wsync.v1.BucketSpec.digest``;
            :mod:`wsync_grpc.core.digests`); ``None``: none, or one declared later.
    """

    index: int
    size_bytes: int
    tensors: tuple[TensorSlot, ...]
    src: int = 0
    digest: Digest | None = None

    @property
    def payload_bytes(self) -> int:
        """Sum of the tensors' sizes, in bytes (``size_bytes`` minus padding)."""
        return sum(t.nbytes for t in self.tensors)

    def wire_bytes(self, layout: Layout = Layout.FLATTENED) -> int:
        """Bytes this bucket puts on the wire in ``layout``, in bytes.

        Flattened: ``size_bytes`` (padding included). Individual: the sum of
        the tensors' sizes, which is what the contract requires the
        ``BucketSpec.size_bytes`` of that layout to be.
        """
        return self.payload_bytes if layout is Layout.INDIVIDUAL else self.size_bytes

    @property
    def lone(self) -> TensorSlot | None:
        """The bucket's only tensor when the bucket is exactly that tensor's bytes (no padding), else None.

        Such a bucket needs no packing on the sender and no unpacking on the
        receiver: its flat buffer is the tensor itself.
        """
        if len(self.tensors) != 1:
            return None
        t = self.tensors[0]
        return t if t.offset == 0 and t.nbytes == self.size_bytes and t.nbytes > 0 and t.delta is None else None

    @property
    def has_delta(self) -> bool:
        """Whether any of its tensors is a delta entry (its digest is then of the whole tensors it results in)."""
        return any(t.delta is not None for t in self.tensors)


def total_wire_bytes(buckets: Iterable[Bucket], layout: Layout = Layout.FLATTENED) -> int:
    """Sum of :meth:`Bucket.wire_bytes` over ``buckets``: the Prepare header's ``total_bytes``, in bytes."""
    return sum(b.wire_bytes(layout) for b in buckets)


def with_digests(buckets: Sequence[Bucket], digests: Sequence[Digest | None]) -> list[Bucket]:
    """``buckets`` with the digests declared with them (``digests[i]`` for ``buckets[i]``; ``None``: none).

    An empty ``digests`` leaves every bucket as it is.
    """
    if not digests:
        return list(buckets)
    return [b if d is None else dataclasses.replace(b, digest=d) for b, d in zip(buckets, digests, strict=True)]
