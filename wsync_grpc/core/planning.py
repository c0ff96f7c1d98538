"""Bucket planning: which tensors travel in which bucket, at which byte offset (pure torch metadata, no I/O).

:func:`plan_metadata` turns the tensors' metadata (:class:`TensorMeta`: name,
dtype, global shape) into the update's :class:`~wsync_grpc.core.layout.Bucket`
list without touching any tensor's bytes; :func:`plan_buckets` does the same
for ``named_parameters()`` / ``state_dict()`` pairs, after
:func:`unique_tensors` dropped tied duplicates by address (only metadata is
read, so ``meta`` tensors can be planned too). The defaults
here are what :class:`~wsync_grpc.trainer.client.TrainerClient` plans with;
``BENCHMARKS.md`` shows how they were chosen. Sizes are in bytes throughout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from wsync_grpc.core.delta import DeltaCoding
from wsync_grpc.core.dtypes import dtype_name, element_size, wire_dtype
from wsync_grpc.core.layout import Bucket, Piece, TensorSlot

DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
"""Default bucket capacity, in bytes (1 GiB), chosen with ``make bench`` (``BENCHMARKS.md``, bucket-size sweep).

Each bucket is one Prepare message and one collective, and the engine pays a
fixed cost per Prepare message: larger buckets mean fewer messages, so a
model of hundreds of large tensors or a MoE of tens of thousands of small
ones is ready sooner. End-to-end throughput hardly depends on the bucket size
once the first and last buckets are small (:data:`DEFAULT_RAMP_BYTES`). The
price is memory: the trainer packs into two buffers of a bucket, and an
engine with streaming apply receives into two buffers of the largest bucket
(staged apply holds the whole update anyway). Lower it where that memory is
short.
"""

DEFAULT_RAMP_BYTES = 32 * 1024 * 1024
"""Size of the first and last buckets a :class:`~wsync_grpc.trainer.client.TrainerClient` plans, in bytes (32 MiB).

Buckets double from it up to the bucket capacity, and halve back down to it
at the end of the update (``plan_buckets(ramp_bytes=...)``). Before the first
broadcast the trainer must pack a whole bucket, and after the last one the
engine must apply a whole bucket, with nothing else in flight. With the ramp
they cost one small bucket each (or one lone tensor: a bucket holding a
single tensor is sent without packing, see
:func:`~wsync_grpc.core.packing.bucket_bytes_view`). The price is a handful of
extra buckets, about ``2 * log2(bucket_bytes / ramp_bytes)``.
"""

DEFAULT_SOLO_BYTES = 16 * 1024 * 1024
"""Default threshold for a tensor to travel alone, in bytes (16 MiB): see ``plan_buckets(solo_bytes=...)``.

A lone tensor costs a bucket entry in Prepare and a collective of its own,
but no copy on either side: the trainer broadcasts the tensor itself and an
engine with streaming apply receives straight into the served tensor
(:class:`~wsync_grpc.core.engine.InPlaceReceive`). Packing costs a copy of
every byte on the trainer and unpacking another on the engine, which on a
CPU host run at about the speed of the transfer; each collective has a fixed
cost too, so small tensors are still packed. ``BENCHMARKS.md`` shows the
effect per model.
"""

DEFAULT_ALIGNMENT = 256
"""Default byte alignment of every tensor's offset inside a flat bucket.

256 bytes is what CUDA allocations guarantee, so a tensor viewed out of a
bucket is as aligned as a freshly allocated one. The engines accept at most
4096 bytes of padding per tensor (``wsync_grpc.core.validation.PADDING_PER_TENSOR``),
so alignments above 4096 are refused by them.
"""

DEFAULT_MAX_SPEC_BYTES = 2 * 1024 * 1024
"""Default bound on one bucket's metadata (its serialized ``BucketSpec``), in bytes (2 MiB).

Every bucket travels as one Prepare message; gRPC servers refuse messages
above 4 MiB by default, which a bucket of tens of thousands of small tensors
(a large MoE) would exceed. The bound is checked with an upper estimate of
each ``TensorSpec``'s size, so real messages stay below it.
"""


DELTA_SPEC_BYTES = 36
"""An upper bound of one ``TensorSpec.delta``'s serialized size, in bytes: its tag and length, three fields of a tag
and a varint of at most 10 bytes each."""


def _spec_bytes_bound(name: str, ndim: int) -> int:
    """An upper bound of one ``TensorSpec``'s serialized size inside a ``BucketSpec``, in bytes.

    Field tags and lengths (at most 3 bytes each for these sizes), the name,
    the dtype name (at most 13 characters), each dimension as a varint (at
    most 10 bytes), the offset (at most 10 bytes) and the repeated-field
    wrapper.
    """
    return len(name.encode()) + 10 * ndim + 48


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class TensorMeta(NamedTuple):
    """What planning needs of one tensor: its name, dtype and global shape; none of its bytes.

    For a plain tensor the shape is its own; for a tensor sharded over ranks (an FSDP2 ``DTensor``) it
    is the global (unsharded) shape, so that every rank plans the same buckets without gathering.

    Attributes:
        name: the name it is sent under (Hugging Face naming).
        dtype: its dtype before any wire conversion.
        shape: its global shape; ``()`` for a scalar.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


new_meta = tuple.__new__
"""Builds a :class:`TensorMeta` from its three fields without ``NamedTuple``'s Python-level ``__new__``
(``unique_tensors`` builds one per tensor at every sync)."""


def unique_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[TensorMeta, torch.Tensor]]:
    """Each tensor of ``named_tensors`` with its metadata, in order, tied or duplicated tensors kept once.

    Two tensors are the same when they start at the same address on the same device with the same
    shape, stride and dtype (``state_dict()`` lists a tied ``lm_head.weight`` and
    ``model.embed_tokens.weight`` as the same tensor): the first name is kept. ``meta``, empty and
    storage-less tensors are never merged. Only metadata is read, once per tensor (a large MoE has
    100k of them and a trainer does this at every sync).

    Raises:
        ValueError: a name appears twice.
    """
    out: list[tuple[TensorMeta, torch.Tensor]] = []
    seen_names: set[str] = set()
    at: dict[int, list[tuple[object, ...]]] = {}  # address -> the tensors kept that start there
    for name, tensor in named_tensors:
        if name in seen_names:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen_names.add(name)
        dtype, shape = tensor.dtype, tensor.shape  # a torch.Size is a tuple of ints
        try:
            ptr = tensor.data_ptr()  # 0 for meta tensors
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            ptr = 0
        if ptr and 0 not in shape:
            key = (tensor.get_device(), shape, tensor.stride(), dtype)
            kept = at.get(ptr)
            if kept is None:
                at[ptr] = [key]
            elif key in kept:
                continue  # tied: kept under its first name
            else:
                kept.append(key)
        out.append((new_meta(TensorMeta, (name, dtype, shape)), tensor))
    return out


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    alignment: int = DEFAULT_ALIGNMENT,
    dtype: torch.dtype | None = None,
    *,
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    ramp_bytes: int = 0,
    solo_bytes: int = 0,
) -> list[Bucket]:
    """Plan the buckets of one update.

    Tensors keep their order and are packed greedily: each starts at the
    first offset after the previous one that is a multiple of both
    ``alignment`` and its element size; when it would end past
    ``bucket_bytes`` a new bucket starts. A tensor larger than
    ``bucket_bytes`` gets a bucket of its own. Only metadata is read (dtype,
    shape, address), so ``meta`` tensors can be planned too.

    Tied or duplicated tensors, i.e. the same address, shape, stride and
    dtype on the same device (:func:`unique_tensors`; ``state_dict()`` lists a tied ``lm_head.weight`` and
    ``model.embed_tokens.weight`` as the same tensor), are planned once,
    under the first name; engines resolve tied aliases themselves.

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``
            or ``model.state_dict().items()``.
        bucket_bytes: capacity of a bucket, in bytes (> 0).
        alignment: byte alignment of every tensor offset (>= 1). Engines accept
            at most 4096.
        dtype: if given (a floating dtype), floating tensors are sent in it
            (e.g. fp32 master weights sent as ``torch.bfloat16``); other
            tensors keep theirs. The plan records the wire dtype.
        max_spec_bytes: bound on each bucket's serialized metadata, in bytes
            (see :data:`DEFAULT_MAX_SPEC_BYTES`); a bucket also closes when
            the next tensor's metadata would pass it.
        ramp_bytes: if positive, the buckets ramp up and down: bucket *k*
            holds at most ``ramp_bytes * 2**k`` bytes and at most half of
            the payload still to plan (never less than ``ramp_bytes``), and
            never more than ``bucket_bytes``. The first pack on the sender and
            the last apply on the receiver overlap nothing else, so they then
            cost a small bucket instead of a full one (see
            :data:`DEFAULT_RAMP_BYTES`). 0 (default): every bucket is filled
            up to ``bucket_bytes``.
        solo_bytes: if positive, every tensor of at least this many bytes
            (in its wire dtype) gets a bucket of its own, emitted where it
            comes, while smaller tensors keep filling the bucket being packed
            (which then holds tensors that are not neighbours in the model).
            A lone tensor is sent and received as it lies in memory, without
            packing or unpacking (see :func:`~wsync_grpc.core.packing.bucket_bytes_view` and
            :data:`DEFAULT_SOLO_BYTES`). A last packed bucket that follows a
            lone tensor trades places with it, so that the update ends on a
            bucket with nothing to unpack. 0 (default): tensors are packed in
            order, a tensor is alone only when it is larger than the bucket.

    Returns:
        The buckets, indexed from 0; ``[]`` when there is nothing to send.

    Raises:
        ValueError: a name appears twice for different tensors, a
            non-positive ``bucket_bytes`` or ``alignment``, a non-floating
            ``dtype``, or a dtype weight sync does not support.
    """
    metas = [meta for meta, _tensor in unique_tensors(named_tensors)]
    return plan_metadata(
        metas,
        bucket_bytes,
        alignment,
        dtype,
        max_spec_bytes=max_spec_bytes,
        ramp_bytes=ramp_bytes,
        solo_bytes=solo_bytes,
    )


def plan_metadata(
    metas: Iterable[TensorMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    alignment: int = DEFAULT_ALIGNMENT,
    dtype: torch.dtype | None = None,
    *,
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    ramp_bytes: int = 0,
    solo_bytes: int = 0,
    deltas: Mapping[str, DeltaCoding] | None = None,
) -> list[Bucket]:
    """Plan the buckets of one update from its tensors' metadata alone (see :func:`plan_buckets`).

    Args:
        metas: the tensors to send, in order, ties already resolved (each tensor once); shapes are
            global shapes.
        bucket_bytes, alignment, dtype, max_spec_bytes, ramp_bytes, solo_bytes: as for
            :func:`plan_buckets`.
        deltas: name -> the delta entry a tensor travels as (a delta update: :mod:`wsync_grpc.core.delta`),
            planned at the entry's size and marked on its slot; the others travel whole. ``None``: every
            tensor whole.

    Returns:
        The buckets, indexed from 0; ``[]`` when there is nothing to send.

    Raises:
        ValueError: as for :func:`plan_buckets`.
    """
    _check_plan_args(bucket_bytes, alignment, dtype, max_spec_bytes, ramp_bytes, solo_bytes)
    entries = _wire_entries(metas, alignment, dtype)
    if deltas:  # sized as their entries; a TensorSpec.delta adds at most 3 varints and their tags
        entries = [
            e
            if e.name not in deltas
            else e._replace(nbytes=deltas[e.name].nbytes(e.dtype.itemsize), spec_bytes=e.spec_bytes + DELTA_SPEC_BYTES)
            for e in entries
        ]
    packer = _Packer(bucket_bytes, max_spec_bytes, ramp_bytes, sum(e.nbytes for e in entries))
    for e in entries:
        if 0 < solo_bytes <= e.nbytes:
            packer.lone(e)
        else:
            packer.add(e)
    packer.close()
    buckets = packer.buckets
    if (
        solo_bytes > 0
        and len(buckets) > 1
        and buckets[-1].tensors[0].nbytes < solo_bytes
        and buckets[-2].tensors[0].nbytes >= solo_bytes
    ):
        # Packed, after a lone tensor: swap the two, so that the update ends on the lone tensor. An
        # engine receives that one in place, so nothing is left to apply after the last byte, and
        # the packed bucket is applied while it arrives.
        a, b = buckets[-2], buckets[-1]
        buckets[-2:] = [Bucket(a.index, b.size_bytes, b.tensors), Bucket(b.index, a.size_bytes, a.tensors)]
    if deltas:
        buckets = [
            dataclasses.replace(b, tensors=tuple(dataclasses.replace(t, delta=deltas.get(t.name)) for t in b.tensors))
            for b in buckets
        ]
    return buckets


class PieceMeta(NamedTuple):
    """One trainer rank's piece of a tensor, as planning needs it (a sharded trainer's direct send).

    Attributes:
        name: the whole tensor's name.
        dtype: its dtype before any wire conversion.
        shape: the piece's shape.
        src: the trainer rank that holds and sends it.
        piece: where it sits in the whole tensor; ``None`` when it is the whole tensor (one rank
            sends it whole).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    src: int
    piece: Piece | None


def plan_pieces(
    pieces: Sequence[PieceMeta],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    alignment: int = DEFAULT_ALIGNMENT,
    dtype: torch.dtype | None = None,
    *,
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    ramp_bytes: int = 0,
    solo_bytes: int = 0,
    deltas: Mapping[int, Mapping[str, DeltaCoding]] | None = None,
) -> list[Bucket]:
    """Plan the buckets of a direct send: each trainer rank's pieces in buckets of their own, ranks taking turns.

    Every rank's pieces are planned as :func:`plan_metadata` plans tensors (in order, with the same
    limits), each bucket sent by that rank (:attr:`Bucket.src`); the update's bucket sequence then
    takes one bucket of each rank in turn (rank 0's first, then rank 1's first, ...), so that every
    rank's sends overlap and the pieces of one tensor, which the ranks hold at the same place of
    their sequences, arrive close together (an engine assembles a tensor until its last piece).

    Args:
        pieces: every rank's pieces, each rank's in its order (a name at most once per rank).
        bucket_bytes, alignment, dtype, max_spec_bytes, ramp_bytes, solo_bytes: as for
            :func:`plan_buckets`.
        deltas: trainer rank -> name -> the delta entry that rank's piece travels as (a delta update: see
            :func:`plan_metadata`); ``None``: every piece whole.

    Returns:
        The buckets, indexed from 0; ``[]`` when there is nothing to send.

    Raises:
        ValueError: as for :func:`plan_buckets` (a name twice for one rank).
    """
    ranks = sorted({p.src for p in pieces})
    per_rank: list[list[Bucket]] = []
    limits: dict[str, int] = {"max_spec_bytes": max_spec_bytes, "ramp_bytes": ramp_bytes, "solo_bytes": solo_bytes}
    for r in ranks:
        mine = [p for p in pieces if p.src == r]
        where = {p.name: p.piece for p in mine}
        metas = [new_meta(TensorMeta, (p.name, p.dtype, p.shape)) for p in mine]
        mine_deltas = (deltas or {}).get(r)
        buckets = plan_metadata(metas, bucket_bytes, alignment, dtype, **limits, deltas=mine_deltas)  # type: ignore[arg-type]
        per_rank.append(
            [
                Bucket(b.index, b.size_bytes, tuple(dataclasses.replace(t, piece=where[t.name]) for t in b.tensors), r)
                for b in buckets
            ]
        )
    out: list[Bucket] = []
    for turn in range(max((len(b) for b in per_rank), default=0)):
        for buckets in per_rank:
            if turn < len(buckets):
                b = buckets[turn]
                out.append(Bucket(len(out), b.size_bytes, b.tensors, b.src))
    return out


def _check_plan_args(
    bucket_bytes: int, alignment: int, dtype: torch.dtype | None, max_spec_bytes: int, ramp_bytes: int, solo_bytes: int
) -> None:
    """Refuse :func:`plan_buckets` arguments it cannot plan with (ValueError, as documented there)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if alignment < 1:
        raise ValueError(f"alignment must be at least 1, got {alignment}")
    if max_spec_bytes <= 0:
        raise ValueError(f"max_spec_bytes must be positive, got {max_spec_bytes}")
    if ramp_bytes < 0:
        raise ValueError(f"ramp_bytes must not be negative, got {ramp_bytes}")
    if solo_bytes < 0:
        raise ValueError(f"solo_bytes must not be negative, got {solo_bytes}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype to convert into, got {dtype}")
    if dtype is not None:
        dtype_name(dtype)  # refuse an unsupported wire dtype up front


class _Entry(NamedTuple):
    """One tensor to plan: its wire dtype, shape, size (bytes), offset step (bytes), metadata bound (bytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    step: int
    spec_bytes: int


def _wire_entries(metas: Iterable[TensorMeta], alignment: int, dtype: torch.dtype | None) -> list[_Entry]:
    """Pass 1: what goes on the wire, in order.

    The loop runs once per tensor (100k of them in a large MoE), so per-dtype work is cached.

    Raises:
        ValueError: a name appears twice, or a dtype weight sync does not carry.
    """
    entries: list[_Entry] = []
    seen_names: set[str] = set()
    wire_info: dict[torch.dtype, tuple[torch.dtype, int, int]] = {}  # dtype -> (wire dtype, size, offset step)
    for name, tdtype, shape in metas:
        if name in seen_names:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen_names.add(name)
        info = wire_info.get(tdtype)
        if info is None:
            wire = wire_dtype(tdtype, dtype)
            dtype_name(wire)  # ValueError for dtypes weight sync does not carry
            esize = element_size(wire)
            info = wire_info[tdtype] = (wire, esize, math.lcm(alignment, esize))
        wire, esize, step = info
        entries.append(_Entry(name, wire, shape, math.prod(shape) * esize, step, _spec_bytes_bound(name, len(shape))))
    return entries


@dataclass
class _Packer:
    """Pass 2: greedy packing, in order, into buckets of at most :meth:`capacity` bytes."""

    bucket_bytes: int
    max_spec_bytes: int
    ramp_bytes: int
    remaining: int
    """Payload not yet closed into a bucket, in bytes."""
    buckets: list[Bucket] = field(default_factory=list)
    current: list[TensorSlot] = field(default_factory=list)
    end: int = 0
    """End of the current bucket's last tensor, in bytes."""
    meta: int = 0
    """Upper bound of the current bucket's serialized metadata, in bytes."""
    cap: int = 0

    def __post_init__(self) -> None:
        self.cap = self.capacity()

    def capacity(self) -> int:
        """The next bucket's capacity, in bytes: ``bucket_bytes``, or the ramp's (see :func:`plan_buckets`)."""
        if self.ramp_bytes <= 0:
            return self.bucket_bytes
        up = self.ramp_bytes << min(len(self.buckets), 62)
        down = max(self.ramp_bytes, self.remaining // 2)
        return min(self.bucket_bytes, up, down)

    def close(self) -> None:
        """Close the current bucket (if it holds anything) and size the next one."""
        if self.current:
            self.buckets.append(Bucket(len(self.buckets), self.end, tuple(self.current)))
            self.remaining -= sum(t.nbytes for t in self.current)
        self.current = []
        self.end = 0
        self.meta = 0
        self.cap = self.capacity()

    def lone(self, e: _Entry) -> None:
        """Emit ``e`` as a bucket of its own, now, while the current bucket keeps filling."""
        self.buckets.append(
            Bucket(len(self.buckets), e.nbytes, (TensorSlot(e.name, e.dtype, e.shape, 0, e.nbytes, e.name),))
        )
        self.remaining -= e.nbytes
        if not self.current:
            self.cap = self.capacity()

    def add(self, e: _Entry) -> None:
        """Append ``e`` to the current bucket at its next aligned offset, closing the bucket when full."""
        offset = _align_up(self.end, e.step)
        if self.current and (offset + e.nbytes > self.cap or self.meta + e.spec_bytes > self.max_spec_bytes):
            self.close()
            offset = 0
        self.current.append(TensorSlot(e.name, e.dtype, e.shape, offset, e.nbytes, e.name))
        self.end = offset + e.nbytes
        self.meta += e.spec_bytes
        if e.nbytes > self.cap:
            self.close()  # oversized: alone in its bucket
