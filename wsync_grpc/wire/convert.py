"""``wsync.v1`` messages <-> domain values: one map per enum, durations, headers and bucket specs.

The domain enums live in the core (:class:`~wsync_grpc.core.layout.Layout`,
:class:`~wsync_grpc.core.layout.ApplyMode`,
:class:`~wsync_grpc.core.layout.Transport`,
:class:`~wsync_grpc.core.digests.DigestAlgorithm`,
:class:`~wsync_grpc.core.engine.PauseMode`, the backend names ``"gloo"`` /
``"nccl"``); each has exactly one map to its proto enum here, and its inverse is
derived from it. An ``*_UNSPECIFIED`` value means the contract's default; a
number the contract does not define is refused with INVALID_ARGUMENT
(reason UNKNOWN_ENUM_VALUE).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import TypeVar

from google.protobuf import duration_pb2
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.delta import Positions
from wsync_grpc.core.digests import DIGEST_SIZES, Digest, DigestAlgorithm
from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import CudaIpcMemory, SharedMemoryHandle, UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Bucket, Layout, Transport
from wsync_grpc.core.lifecycle import State
from wsync_grpc.core.lora import LoraSpec

E = TypeVar("E")

LAYOUTS: dict[Layout, pb.BucketLayout.ValueType] = {
    Layout.FLATTENED: pb.BUCKET_LAYOUT_FLATTENED,
    Layout.INDIVIDUAL: pb.BUCKET_LAYOUT_INDIVIDUAL,
}
APPLY_MODES: dict[ApplyMode, pb.ApplyMode.ValueType] = {
    ApplyMode.STAGED: pb.APPLY_MODE_STAGED,
    ApplyMode.STREAMING: pb.APPLY_MODE_STREAMING,
}
TRANSPORTS: dict[Transport, pb.Transport.ValueType] = {
    Transport.BROADCAST: pb.TRANSPORT_BROADCAST,
    Transport.CUDA_IPC: pb.TRANSPORT_CUDA_IPC,
    Transport.DISK: pb.TRANSPORT_DISK,
    Transport.SHARED_MEMORY: pb.TRANSPORT_SHARED_MEMORY,
}
PAUSE_MODES: dict[PauseMode, pb.PauseMode.ValueType] = {
    PauseMode.ABORT: pb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: pb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: pb.PAUSE_MODE_KEEP,
}
DIGEST_ALGORITHMS: dict[DigestAlgorithm, pb.DigestAlgorithm.ValueType] = {
    DigestAlgorithm.XXH3_128: pb.DIGEST_ALGORITHM_XXH3_128,
}
BACKENDS: dict[str, pb.Backend.ValueType] = {"gloo": pb.BACKEND_GLOO, "nccl": pb.BACKEND_NCCL}
"""Backend name (``torch.distributed``'s) -> ``wsync.v1.Backend``; ``""`` (choose by device) is UNSPECIFIED."""

PREPARE_BATCH_BYTES = 1024 * 1024
"""Bound on the serialized bucket specs batched into one Prepare message, in bytes (1 MiB).

An engine pays a fixed cost on every stream message whatever its size, so a
trainer that sends hundreds of buckets (large tensors alone in their
buckets, a large MoE) batches them. 1 MiB stays far below gRPC's default
4 MiB receive limit.
"""


def from_proto(table: Mapping[E, int], value: int, default: E, what: str) -> E:
    """The domain value of proto enum number ``value`` by ``table`` (one of the maps above).

    Args:
        default: what ``0`` (``*_UNSPECIFIED``) means.
        what: the field's name, for the error message.

    Raises:
        InvalidArgument: UNKNOWN_ENUM_VALUE, a number the contract does not define.
    """
    if value == 0:
        return default
    for domain, number in table.items():
        if number == value:
            return domain
    raise InvalidArgument("UNKNOWN_ENUM_VALUE", f"{what} value {value} is not defined in wsync.v1")


def backend_from_proto(value: int) -> str:
    """``"gloo"``, ``"nccl"``, or ``""`` for BACKEND_UNSPECIFIED (each side chooses by device).

    Raises:
        InvalidArgument: UNKNOWN_ENUM_VALUE.
    """
    return from_proto(BACKENDS, value, "", "backend")


def backend_to_proto(backend: str) -> pb.Backend.ValueType:
    """The ``wsync.v1.Backend`` of ``backend`` (``""``: BACKEND_UNSPECIFIED)."""
    return BACKENDS.get(backend, pb.BACKEND_UNSPECIFIED)


def duration(seconds: float) -> duration_pb2.Duration:
    """``seconds`` as a ``google.protobuf.Duration``."""
    d = duration_pb2.Duration()
    d.FromTimedelta(datetime.timedelta(seconds=seconds))
    return d


def seconds(d: duration_pb2.Duration, default: float) -> float:
    """A ``google.protobuf.Duration`` in seconds; ``default`` when unset or zero.

    Raises:
        InvalidArgument: NEGATIVE_TIMEOUT, a negative duration.
    """
    s = d.seconds + d.nanos / 1e9
    if s < 0:
        raise InvalidArgument("NEGATIVE_TIMEOUT", f"timeout must not be negative, got {s} s")
    return s if s > 0 else default


def transport_from_proto(value: int) -> Transport:
    """The transport of a ``wsync.v1.Transport`` number (UNSPECIFIED: broadcast).

    Raises:
        InvalidArgument: UNKNOWN_ENUM_VALUE.
    """
    return from_proto(TRANSPORTS, value, Transport.BROADCAST, "transport")


def header_from_proto(h: pb.PrepareHeader) -> UpdateHeader:
    """The domain :class:`~wsync_grpc.core.validation.UpdateHeader` of a ``PrepareHeader`` (not validated yet).

    Unspecified enums take the contract's defaults: broadcast, flattened, staged.

    Raises:
        InvalidArgument: UNKNOWN_ENUM_VALUE for a transport, layout or apply mode the contract does not define.
    """
    return UpdateHeader(
        update_id=h.update_id,
        weight_version=h.weight_version,
        transport=transport_from_proto(h.transport),
        layout=from_proto(LAYOUTS, h.layout, Layout.FLATTENED, "layout"),
        apply_mode=from_proto(APPLY_MODES, h.apply_mode, ApplyMode.STAGED, "apply_mode"),
        bucket_count=h.bucket_count,
        total_bytes=h.total_bytes,
        incremental=h.incremental,
        checkpoint_path=h.checkpoint_path,
        adapter=adapter_from_proto(h.adapter) if h.HasField("adapter") else None,
        digests_follow=h.digests_follow,
        shared_memory=shared_memory_from_proto(h.shared_memory) if h.HasField("shared_memory") else None,
        base_weight_version=h.base_weight_version,
        base_weight_identity=h.base_weight_identity,
        delta_base=h.delta_base,
        shared_memory_ranks=tuple(shared_memory_from_proto(m) for m in h.shared_memory_ranks),
    )


def header_to_proto(h: UpdateHeader, owner: str = "") -> pb.PrepareHeader:
    """The ``PrepareHeader`` of ``h``, every enum written explicitly; the inverse of :func:`header_from_proto`.

    Args:
        h: the update's header in domain terms.
        owner: the sender's owner name (``PrepareHeader.owner``; the domain header does not carry it,
            the engine checks it against its lease). ``""`` is the anonymous owner.
    """
    return pb.PrepareHeader(
        update_id=h.update_id,
        weight_version=h.weight_version,
        transport=TRANSPORTS[h.transport],
        layout=LAYOUTS[h.layout],
        apply_mode=APPLY_MODES[h.apply_mode],
        bucket_count=h.bucket_count,
        total_bytes=h.total_bytes,
        incremental=h.incremental,
        owner=owner,
        checkpoint_path=h.checkpoint_path,
        adapter=adapter_to_proto(h.adapter) if h.adapter is not None else None,
        digests_follow=h.digests_follow,
        shared_memory=shared_memory_to_proto(h.shared_memory) if h.shared_memory is not None else None,
        base_weight_version=h.base_weight_version,
        base_weight_identity=h.base_weight_identity,
        delta_base=h.delta_base,
        shared_memory_ranks=[shared_memory_to_proto(m) for m in h.shared_memory_ranks],
    )


def shared_memory_from_proto(m: pb.SharedMemoryHandle) -> SharedMemoryHandle:
    """The domain :class:`~wsync_grpc.core.header.SharedMemoryHandle` of its message (not validated yet)."""
    cuda_ipc = None
    if m.HasField("cuda_ipc"):
        c = m.cuda_ipc
        cuda_ipc = CudaIpcMemory(c.device_uuid, bytes(c.memory_handle), c.offset_bytes, c.size_bytes)
    return SharedMemoryHandle(m.socket_name, bytes(m.token), m.boot_id, m.slot_bytes, m.slots, m.storages, cuda_ipc)


def shared_memory_to_proto(h: SharedMemoryHandle) -> pb.SharedMemoryHandle:
    """The ``wsync.v1.SharedMemoryHandle`` of ``h``; the inverse of :func:`shared_memory_from_proto`."""
    return pb.SharedMemoryHandle(
        socket_name=h.socket_name,
        token=h.token,
        boot_id=h.boot_id,
        slot_bytes=h.slot_bytes,
        slots=h.slots,
        storages=h.storages,
        cuda_ipc=(
            pb.CudaIpcMemory(
                device_uuid=h.cuda_ipc.device_uuid,
                memory_handle=h.cuda_ipc.memory_handle,
                offset_bytes=h.cuda_ipc.offset_bytes,
                size_bytes=h.cuda_ipc.size_bytes,
            )
            if h.cuda_ipc is not None
            else None
        ),
    )


def adapter_from_proto(a: pb.AdapterSpec) -> LoraSpec:
    """The :class:`~wsync_grpc.core.lora.LoraSpec` of a ``wsync.v1.AdapterSpec`` (not validated yet)."""
    return LoraSpec(a.name, a.rank, a.alpha, tuple(a.target_modules))


def adapter_to_proto(spec: LoraSpec) -> pb.AdapterSpec:
    """The ``wsync.v1.AdapterSpec`` of ``spec`` (a regex target travels as the one target module)."""
    targets = [spec.target_regex] if spec.target_regex else list(spec.target_modules)
    return pb.AdapterSpec(name=spec.name, rank=spec.rank, alpha=spec.alpha, target_modules=targets)


def digest_from_proto(d: pb.BucketDigest, bucket: int) -> Digest | None:
    """The digest ``d`` of bucket ``bucket`` carries; ``None`` for none (UNSPECIFIED with no value).

    Raises:
        InvalidArgument: UNKNOWN_ENUM_VALUE (an algorithm the contract does not define), INVALID_DIGEST
            (a value without an algorithm, or of the wrong length for it); metadata names the bucket.
    """
    if d.algorithm == pb.DIGEST_ALGORITHM_UNSPECIFIED:
        if d.value:
            raise InvalidArgument(
                "INVALID_DIGEST", f"bucket {bucket}'s digest has a value but no algorithm", bucket=str(bucket)
            )
        return None
    algorithm = from_proto(DIGEST_ALGORITHMS, d.algorithm, DigestAlgorithm.XXH3_128, "digest algorithm")
    if len(d.value) != DIGEST_SIZES[algorithm]:
        raise InvalidArgument(
            "INVALID_DIGEST",
            f"bucket {bucket}'s {algorithm.value} digest has {len(d.value)} bytes, not {DIGEST_SIZES[algorithm]}",
            bucket=str(bucket),
        )
    return Digest(algorithm, bytes(d.value))


def digest_to_proto(d: Digest) -> pb.BucketDigest:
    """The ``wsync.v1.BucketDigest`` of ``d``."""
    return pb.BucketDigest(algorithm=DIGEST_ALGORITHMS[d.algorithm], value=d.value)


def declared_digests(ds: Sequence[pb.DeclaredDigest]) -> dict[int, Digest]:
    """``UpdateRequest.digests`` as bucket index -> digest.

    Raises:
        InvalidArgument: INVALID_DIGEST (one unset or empty, or two for the same bucket), and see
            :func:`digest_from_proto`.
    """
    out: dict[int, Digest] = {}
    for d in ds:
        digest = digest_from_proto(d.digest, d.bucket_index)
        if digest is None:
            raise InvalidArgument(
                "INVALID_DIGEST",
                f"the digest declared for bucket {d.bucket_index} is empty",
                bucket=str(d.bucket_index),
            )
        if out.get(d.bucket_index, digest) != digest:
            raise InvalidArgument(
                "INVALID_DIGEST",
                f"two different digests declared for bucket {d.bucket_index} in one call",
                bucket=str(d.bucket_index),
            )
        out[d.bucket_index] = digest
    return out


def bucket_spec(bucket: Bucket, layout: Layout = Layout.FLATTENED) -> pb.BucketSpec:
    """Build the ``wsync.v1.BucketSpec`` message of ``bucket`` for ``layout``.

    The name/dtype/shape fields are the same as SGLang's
    ``UpdateWeightsFromDistributedReqInput.names/dtypes/shapes``; the dtype is
    torch's own name (``"bfloat16"``). ``offset_bytes`` is 0 in the individual
    layout, where the contract ignores it, and ``size_bytes`` is
    :meth:`~wsync_grpc.core.layout.Bucket.wire_bytes`; ``digest`` is the bucket's, when it has one.
    """
    individual = layout is Layout.INDIVIDUAL
    msg = pb.BucketSpec(index=bucket.index, size_bytes=bucket.wire_bytes(layout), src_rank=bucket.src)
    if bucket.digest is not None:
        msg.digest.CopyFrom(digest_to_proto(bucket.digest))
    add = msg.tensors.add  # appending in place: faster than building a list of TensorSpec
    for t in bucket.tensors:
        spec = add(name=t.name, dtype=dtype_name(t.dtype), shape=t.shape, offset_bytes=0 if individual else t.offset)
        if t.piece is not None:
            spec.shard.global_shape.extend(t.piece.global_shape)
            spec.shard.offsets.extend(t.piece.offsets)
        if t.delta is not None:
            d = spec.delta
            d.positions = DELTA_POSITIONS[t.delta.positions]
            d.changed_elements = t.delta.changed
            d.positions_bytes = t.delta.positions_bytes
    return msg


DELTA_POSITIONS: dict[Positions, pb.DeltaPositions.ValueType] = {
    Positions.INDICES: pb.DELTA_POSITIONS_INDICES,
    Positions.BITMAP: pb.DELTA_POSITIONS_BITMAP,
    Positions.GAPS: pb.DELTA_POSITIONS_GAPS,
    Positions.GAPS16: pb.DELTA_POSITIONS_GAPS16,
}
"""``wsync.v1.DeltaPositions`` numbers of the delta encodings."""


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


def state_to_proto(state: State) -> pb.LifecycleState.ValueType:
    """The ``wsync.v1.LifecycleState`` of ``state``.

    The :class:`~wsync_grpc.core.lifecycle.State` values are the ``LifecycleState`` numbers.
    """
    return pb.LifecycleState.ValueType(state.value)
