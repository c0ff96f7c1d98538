"""Trainer-side bucket planning and packing (pure torch, no gRPC).

A weight update travels as *buckets*. In the flattened layout
(``wsync.v1.BUCKET_LAYOUT_FLATTENED``, SGLang's ``flattened_bucket`` load
format) a bucket is one contiguous ``uint8`` buffer of ``size_bytes`` holding
its tensors at aligned byte offsets, sent with one broadcast. In the
individual layout (``BUCKET_LAYOUT_INDIVIDUAL``, SGLang's default
``update_weights_from_distributed``) every tensor is its own broadcast, in its
wire dtype and shape; buckets then only group the metadata (and bound the
engine's memory in streaming apply).

:func:`plan_buckets` turns ``named_parameters()`` / ``state_dict()`` into a
list of :class:`Bucket`; :meth:`Bucket.spec` builds the ``wsync.v1.BucketSpec``
message for either layout; :func:`pack_bucket` fills a flat buffer;
:func:`wire_tensor` gives the tensor the individual layout broadcasts;
:func:`unpack_bucket` views a received flat buffer as tensors (what an engine
does on its side).

Sizes are in bytes throughout.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.dtypes import dtype_name, element_size

DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
"""Default bucket capacity, in bytes (1 GiB), chosen with ``make bench`` (``BENCHMARKS.md``).

Each bucket is one Prepare message and one collective, and the control plane
decides: the engine takes about 0.1-0.2 ms per Prepare message, so a 32B dense
model (579 tensors) needs ~260 buckets at 256 MiB (its 283 MB MLP matrices
take one each) but ~70 at 1 GiB, and a 100k-tensor MoE ~4,800 against
~1,200; Prepare-to-ready falls by about half (to ~20 ms and ~1.3 s on a
2-core host). End-to-end throughput hardly depends on the bucket size once
the first and last buckets are small (:data:`DEFAULT_RAMP_BYTES`); very small
buckets (16 MiB) pay a per-bucket cost. The price is memory: the trainer
packs into two buckets, and an engine with streaming apply receives into
two buffers of the largest bucket (about 2 GiB at this size; staged apply
holds the whole update anyway). Lower it where that memory is short.
"""

DEFAULT_RAMP_BYTES = 32 * 1024 * 1024
"""Size of the first and last buckets a :class:`~wsync_grpc.trainer.client.TrainerClient` plans, in bytes (32 MiB).

Buckets double from it up to the bucket capacity, and halve back down to it
at the end of the update (``plan_buckets(ramp_bytes=...)``). Before the first
broadcast the trainer must pack a whole bucket, and after the last one the
engine must apply a whole bucket, with nothing else in flight: at 1 GiB a
model of a few GB would spend a large part of its sync in those two steps.
With the ramp they cost one small bucket each (or one lone tensor: a bucket
holding a single tensor is sent without packing, see
:func:`bucket_bytes_view`). The price is a handful of extra buckets, about
``2 * log2(bucket_bytes / ramp_bytes)``.
"""

DEFAULT_SOLO_BYTES = 16 * 1024 * 1024
"""Default threshold for a tensor to travel alone, in bytes (16 MiB): see ``plan_buckets(solo_bytes=...)``.

A lone tensor costs a bucket entry in Prepare and a collective of its own,
but no copy on either side: the trainer broadcasts the tensor itself and an
engine with streaming apply receives straight into the served tensor
(:class:`~wsync_grpc.core.adapter.InPlaceReceive`). Packing costs a copy of every
byte on the trainer and unpacking another on the engine, which on a CPU
host run at about the speed of the transfer. Each collective has a fixed
cost too (gloo over loopback: a few hundred microseconds), so small tensors
are still packed. With ``make bench`` on a 2-core host, streaming syncs of
the 1 and 4 GB models (MLP and embedding matrices of 18-190 MB) reached
0.9-1.0x the raw broadcast with 1-16 MiB thresholds, against 0.7-0.8x with
every tensor packed; models made of tensors below the threshold (SmolLM2-135M)
are unaffected.
"""

PREPARE_BATCH_BYTES = 1024 * 1024
"""Bound on the serialized bucket specs batched into one Prepare message, in bytes (1 MiB).

An engine spends about 0.1-0.2 ms on every stream message whatever its
size, so a trainer that sends hundreds of buckets (a dense 32B model with
large tensors alone in their buckets, a large MoE) batches them. 1 MiB
stays far below gRPC's default 4 MiB receive limit.
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


def _spec_bytes_bound(name: str, ndim: int) -> int:
    """An upper bound of one ``TensorSpec``'s serialized size inside a ``BucketSpec``, in bytes.

    Field tags and lengths (at most 3 bytes each for these sizes), the name,
    the dtype name (at most 13 characters), each dimension as a varint (at
    most 10 bytes), the offset (at most 10 bytes) and the repeated-field
    wrapper.
    """
    return len(name.encode()) + 10 * ndim + 48


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor's place in a bucket.

    Attributes:
        name: the name it is sent under (Hugging Face naming).
        dtype: the wire dtype (after any conversion asked of :func:`plan_buckets`).
        shape: its shape; ``()`` for a scalar.
        offset_bytes: where it starts inside the bucket's flat buffer, in bytes
            (a multiple of the alignment and of the element size).
        nbytes: its size on the wire, in bytes (``numel * element_size(dtype)``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int

    @property
    def end_bytes(self) -> int:
        """One past its last byte inside the flat buffer."""
        return self.offset_bytes + self.nbytes

    def spec(self, layout: int = pb.BUCKET_LAYOUT_FLATTENED) -> pb.TensorSpec:
        """Build its ``wsync.v1.TensorSpec``.

        The name/dtype/shape fields are the same as SGLang's
        ``UpdateWeightsFromDistributedReqInput.names/dtypes/shapes``; the
        dtype is torch's own name (``"bfloat16"``). ``offset_bytes`` is 0 in
        the individual layout, where the contract ignores it.
        """
        offset = self.offset_bytes if layout != pb.BUCKET_LAYOUT_INDIVIDUAL else 0
        return pb.TensorSpec(name=self.name, dtype=dtype_name(self.dtype), shape=list(self.shape), offset_bytes=offset)


@dataclass(frozen=True)
class Bucket:
    """One bucket of a planned update.

    Attributes:
        index: position in the update, from 0.
        size_bytes: length of the flat buffer, in bytes: the end of its last
            tensor (no trailing padding). Padding sits only between tensors.
        tensors: its tensors, in the order they were given to :func:`plan_buckets`.
    """

    index: int
    size_bytes: int
    tensors: tuple[PlannedTensor, ...]

    @property
    def payload_bytes(self) -> int:
        """Sum of the tensors' sizes, in bytes (``size_bytes`` minus padding)."""
        return sum(t.nbytes for t in self.tensors)

    def wire_bytes(self, layout: int = pb.BUCKET_LAYOUT_FLATTENED) -> int:
        """Bytes this bucket puts on the wire in ``layout``, in bytes.

        Flattened: ``size_bytes`` (padding included). Individual: the sum of
        the tensors' sizes, which is what the contract requires the
        ``BucketSpec.size_bytes`` of that layout to be.
        """
        return self.payload_bytes if layout == pb.BUCKET_LAYOUT_INDIVIDUAL else self.size_bytes

    def spec(self, layout: int = pb.BUCKET_LAYOUT_FLATTENED) -> pb.BucketSpec:
        """Build the ``wsync.v1.BucketSpec`` message for ``layout`` (a ``pb.BucketLayout`` value).

        ``BUCKET_LAYOUT_UNSPECIFIED`` means flattened, as in the contract.
        """
        individual = layout == pb.BUCKET_LAYOUT_INDIVIDUAL
        msg = pb.BucketSpec(index=self.index, size_bytes=self.wire_bytes(layout))
        add = msg.tensors.add  # appending in place: ~30% faster than building a list of TensorSpec
        for t in self.tensors:
            add(name=t.name, dtype=dtype_name(t.dtype), shape=t.shape, offset_bytes=0 if individual else t.offset_bytes)
        return msg


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _identity(t: torch.Tensor, shape: tuple[int, ...]) -> tuple[object, ...] | None:
    """A key equal for two tensors that are the same bytes (tied weights), or None."""
    if t.is_meta or t.numel() == 0:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    return (t.device, ptr, t.storage_offset(), shape, t.stride(), t.dtype)


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
    shape, storage), so ``meta`` tensors can be planned too.

    Tied or duplicated tensors, i.e. the same storage, storage offset, shape,
    stride and dtype (``state_dict()`` lists a tied ``lm_head.weight`` and
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
            packing or unpacking (see :func:`bucket_bytes_view` and
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

    # Pass 1: what goes on the wire, tied duplicates dropped. The loop runs once per tensor
    # (100k of them in a large MoE), so per-dtype work is cached.
    entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int, int]] = []
    seen_names: set[str] = set()
    seen_tensors: set[tuple[object, ...]] = set()
    wire_info: dict[torch.dtype, tuple[torch.dtype, int, int]] = {}  # dtype -> (wire dtype, size, offset step)
    for name, tensor in named_tensors:
        if name in seen_names:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen_names.add(name)
        shape = tuple(tensor.shape)
        key = _identity(tensor, shape)
        if key is not None:
            if key in seen_tensors:
                continue  # tied: already planned under its first name
            seen_tensors.add(key)
        info = wire_info.get(tensor.dtype)
        if info is None:
            wire = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype
            dtype_name(wire)  # ValueError for dtypes weight sync does not carry
            esize = element_size(wire)
            info = wire_info[tensor.dtype] = (wire, esize, math.lcm(alignment, esize))
        wire, esize, step = info
        entries.append((name, wire, shape, math.prod(shape) * esize, step, _spec_bytes_bound(name, len(shape))))

    # Pass 2: greedy packing, in order.
    buckets: list[Bucket] = []
    current: list[PlannedTensor] = []
    end = 0  # end of the current bucket's last tensor
    meta = 0  # upper bound of the current bucket's serialized metadata
    remaining = sum(e[3] for e in entries)  # payload not yet closed into a bucket

    def capacity() -> int:
        if ramp_bytes <= 0:
            return bucket_bytes
        up = ramp_bytes << min(len(buckets), 62)
        down = max(ramp_bytes, remaining // 2)
        return min(bucket_bytes, up, down)

    cap = capacity()

    def close() -> None:
        nonlocal current, end, meta, remaining, cap
        if current:
            buckets.append(Bucket(len(buckets), end, tuple(current)))
            remaining -= sum(t.nbytes for t in current)
        current = []
        end = 0
        meta = 0
        cap = capacity()

    for name, wire, shape, nbytes, step, spec_bytes in entries:
        if 0 < solo_bytes <= nbytes:
            buckets.append(Bucket(len(buckets), nbytes, (PlannedTensor(name, wire, shape, 0, nbytes),)))
            remaining -= nbytes
            if not current:
                cap = capacity()
            continue
        offset = _align_up(end, step)
        if current and (offset + nbytes > cap or meta + spec_bytes > max_spec_bytes):
            close()
            offset = 0
        current.append(PlannedTensor(name, wire, shape, offset, nbytes))
        end = offset + nbytes
        meta += spec_bytes
        if nbytes > cap:
            close()  # oversized: alone in its bucket
    close()
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
    return buckets


def batch_bucket_specs(specs: Sequence[pb.BucketSpec], max_bytes: int = PREPARE_BATCH_BYTES) -> list[pb.PrepareRequest]:
    """The Prepare stream's bucket messages for ``specs``: consecutive buckets batched into messages.

    Each message holds as many consecutive buckets as fit in ``max_bytes``
    of serialized specs (at least one), as a ``bucket`` when it is one and a
    ``buckets`` batch otherwise (``wsync.v1.PrepareRequest``).

    Args:
        specs: the buckets' specs, in index order.
        max_bytes: bound on the specs' serialized size per message, in bytes
            (a spec larger than it travels alone).

    Returns:
        The messages to stream after the header, in order; ``[]`` for no specs.
    """
    out: list[pb.PrepareRequest] = []
    batch: list[pb.BucketSpec] = []
    size = 0

    def flush() -> None:
        if len(batch) == 1:
            out.append(pb.PrepareRequest(bucket=batch[0]))
        elif batch:
            out.append(pb.PrepareRequest(buckets=pb.BucketBatch(buckets=batch)))

    for spec in specs:
        n = spec.ByteSize() + 6  # field tag and length prefix
        if batch and size + n > max_bytes:
            flush()
            batch, size = [], 0
        batch.append(spec)
        size += n
    flush()
    return out


def total_wire_bytes(buckets: Iterable[Bucket], layout: int = pb.BUCKET_LAYOUT_FLATTENED) -> int:
    """Sum of :meth:`Bucket.wire_bytes` over ``buckets``: the header's ``total_bytes``, in bytes."""
    return sum(b.wire_bytes(layout) for b in buckets)


def _typed_slice(flat: torch.Tensor, t: PlannedTensor) -> torch.Tensor:
    """View bytes ``t.offset_bytes .. t.end_bytes`` of ``flat`` as ``t`` (no copy)."""
    return flat[t.offset_bytes : t.end_bytes].view(t.dtype).view(t.shape)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _memmove_source(src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes can be copied with one plain ``memmove`` (see :func:`pack_bucket`).

    True for plain, strided, contiguous CPU tensors (no subclass, no lazy
    conjugate or negative bit, not quantized): their ``numel * element_size``
    bytes at ``data_ptr()`` are the tensor.
    """
    return (
        src.is_cpu
        and src.layout == torch.strided
        and type(src) in _PLAIN_TENSORS
        and not src.is_quantized
        and not src.is_conj()
        and not src.is_neg()
        and src.is_contiguous()
    )


def pack_bucket(
    bucket: Bucket,
    tensors_by_name: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    *,
    zero_padding: bool = False,
) -> torch.Tensor:
    """Copy each of ``bucket``'s tensors into its byte range of ``out``; return ``out``.

    Each tensor is written through a view of its byte range in the wire
    dtype (``Tensor.copy_``), which converts the dtype, makes a
    non-contiguous source contiguous and crosses devices in one pass, with
    no temporary. With equal dtypes the bytes are copied bit for bit; into a
    CPU buffer, a contiguous CPU tensor already in the wire dtype is copied
    with one single-threaded ``memmove`` instead (see the comment in the body).

    Padding bytes between tensors are left as they are unless
    ``zero_padding`` is true: receivers never read them, and not touching
    them saves a pass over a reused buffer. Zero them when the buffer's
    bytes are compared or hashed as a whole.

    Args:
        bucket: the planned bucket.
        tensors_by_name: the tensors, by the names planned (extra names are
            ignored); each must have the planned shape.
        out: a 1-D ``torch.uint8`` tensor of exactly ``bucket.size_bytes``
            elements, contiguous, on the device the broadcast runs on.
        zero_padding: also zero the padding bytes.

    Returns:
        ``out``.

    Raises:
        ValueError: ``out`` has the wrong dtype, size or layout, or a tensor's
            shape differs from the plan.
        KeyError: a planned tensor is missing from ``tensors_by_name``.
    """
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor, got {out.dtype} {tuple(out.shape)}")
    if out.numel() != bucket.size_bytes:
        raise ValueError(f"out holds {out.numel()} bytes but bucket {bucket.index} needs {bucket.size_bytes}")
    # On CPU, bytes already in the wire dtype are copied with one single-threaded memmove
    # (and padding zeroed with memset) instead of Tensor.copy_, which runs through torch's
    # intra-op thread pool: its threads spin between the many small parallel regions of a
    # bucket and take the cores the collective's own threads need. On a 2-core host with a
    # gloo broadcast in flight, packing measured about 2x slower with copy_. ctypes releases
    # the GIL for the copy.
    base = out.data_ptr() if out.is_cpu else 0
    prev_end = 0
    with torch.no_grad():
        for t in bucket.tensors:
            src = tensors_by_name[t.name]
            if src.shape != t.shape:
                raise ValueError(f"tensor {t.name!r} has shape {tuple(src.shape)}, planned {t.shape}")
            if zero_padding and t.offset_bytes > prev_end:
                if base:
                    ctypes.memset(base + prev_end, 0, t.offset_bytes - prev_end)
                else:
                    out[prev_end : t.offset_bytes].zero_()
            if t.nbytes:
                src = src.detach()
                if base and src.dtype == t.dtype and _memmove_source(src):
                    ctypes.memmove(base + t.offset_bytes, src.data_ptr(), t.nbytes)
                else:
                    _typed_slice(out, t).copy_(src)
            prev_end = t.end_bytes
    return out


def bucket_bytes_view(
    bucket: Bucket, tensors_by_name: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The flat buffer of a single-tensor bucket as a view of the tensor itself, or None.

    A bucket holding one tensor at offset 0, with no padding, is that
    tensor's bytes: when the tensor is already contiguous, in its wire dtype
    and on ``device``, it can be broadcast as it is, with no packing. Large
    tensors often sit alone in their bucket (the embedding and the LM head of
    an LLM, anything larger than the bucket), and with the client's ramp the
    first bucket is usually the embedding: this saves their copy and starts
    the first broadcast at once.

    Returns:
        A 1-D ``uint8`` view of the tensor's ``bucket.size_bytes`` bytes, or
        None when the bucket must be packed.

    Raises:
        KeyError: the bucket's tensor is missing from ``tensors_by_name``.
    """
    if len(bucket.tensors) != 1:
        return None
    t = bucket.tensors[0]
    if t.offset_bytes != 0 or t.nbytes != bucket.size_bytes or t.nbytes == 0:
        return None
    src = tensors_by_name[t.name].detach()
    if (
        src.device != device
        or src.dtype != t.dtype
        or src.shape != t.shape
        or src.layout != torch.strided
        or type(src) not in _PLAIN_TENSORS
        or src.is_quantized
        or src.is_conj()
        or src.is_neg()
        or not src.is_contiguous()
    ):
        return None
    return src.reshape(-1).view(torch.uint8)


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """View a flat bucket buffer as its tensors (no copy): name -> tensor of the wire dtype and shape.

    The inverse of :func:`pack_bucket`, and what an engine does with a
    received buffer.

    Raises:
        ValueError: ``flat`` is not a 1-D uint8 tensor of ``bucket.size_bytes`` elements.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != bucket.size_bytes:
        raise ValueError(
            f"flat must be a 1-D uint8 tensor of {bucket.size_bytes} bytes, got {flat.dtype} {tuple(flat.shape)}"
        )
    return {t.name: _typed_slice(flat, t) for t in bucket.tensors}


def wire_tensor(planned: PlannedTensor, tensor: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The tensor the individual layout broadcasts for ``planned``: contiguous, in the wire dtype.

    Returns ``tensor`` itself (detached, no copy) when it already is
    contiguous, of the wire dtype and on ``device``; a converted copy
    otherwise.

    Args:
        planned: the planned tensor.
        tensor: the trainer's tensor.
        device: where the broadcast runs; ``None`` keeps ``tensor``'s device.

    Raises:
        ValueError: ``tensor``'s shape differs from the plan.
    """
    if tuple(tensor.shape) != planned.shape:
        raise ValueError(f"tensor {planned.name!r} has shape {tuple(tensor.shape)}, planned {planned.shape}")
    target = torch.device(device) if device is not None else tensor.device
    return tensor.detach().to(device=target, dtype=planned.dtype).contiguous()
