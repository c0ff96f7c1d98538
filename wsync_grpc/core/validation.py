"""Validation of update metadata (Prepare header and buckets) against the engine's model.

Everything a trainer declares is checked here before a single receive is
posted (``../shared/DESIGN.md`` invariant 4): every tensor name, dtype,
shape and byte range, every bucket's size and order, and the header's counts.
A failed check raises :class:`wsync_grpc.wire.status.InvalidArgument` (or
``Unimplemented`` for a transport not built yet) whose reason says what is
wrong and whose metadata names the offending tensor and bucket. Nothing here
allocates memory in proportion to what the caller claims.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.adapter import ParamSpec
from wsync_grpc.core.dtypes import can_convert, element_size, parse_dtype
from wsync_grpc.wire.status import InvalidArgument, Unimplemented

PADDING_PER_TENSOR = 4096
"""Largest padding accepted per tensor in a flattened bucket, in bytes (alignment slack)."""

_MAX_NAME_IN_MESSAGE = 120


def _show(name: str) -> str:
    """Quote a caller-supplied name for an error message, shortened."""
    if len(name) > _MAX_NAME_IN_MESSAGE:
        name = name[:_MAX_NAME_IN_MESSAGE] + "..."
    return repr(name)


@dataclass(frozen=True)
class UpdateHeader:
    """A validated ``PrepareHeader``; enum fields resolved to their defaults."""

    update_id: str
    weight_version: str
    layout: int  # pb.BucketLayout, never UNSPECIFIED
    apply_mode: int  # pb.ApplyMode, never UNSPECIFIED
    bucket_count: int
    total_bytes: int
    incremental: bool

    @property
    def flattened(self) -> bool:
        """Whether buckets travel as one flat byte buffer each."""
        return self.layout == pb.BUCKET_LAYOUT_FLATTENED

    @property
    def streaming(self) -> bool:
        """Whether buckets are applied as they arrive."""
        return self.apply_mode == pb.APPLY_MODE_STREAMING


@dataclass(frozen=True)
class Tensor:
    """One validated tensor of a bucket.

    Attributes:
        name: the name as sent.
        canonical: the engine's canonical name (aliases resolved).
        dtype: wire dtype.
        shape: shape.
        offset: byte offset inside the flat bucket (flattened layout).
        nbytes: size on the wire, in bytes.
        load: False for a tied alias whose canonical tensor is already in this
            update: its bytes are received but loaded only once.
    """

    name: str
    canonical: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    load: bool


@dataclass(frozen=True)
class Bucket:
    """One validated bucket: ``size_bytes`` bytes on the wire, ``tensors`` in order."""

    index: int
    size_bytes: int
    tensors: tuple[Tensor, ...]


def _enum(value: int, unspecified: int, default: int, known: Iterable[int], what: str) -> int:
    if value == unspecified:
        return default
    if value not in set(known):
        raise InvalidArgument("UNKNOWN_ENUM_VALUE", f"{what} value {value} is not defined in wsync.v1")
    return value


def validate_transport(transport: int) -> None:
    """Accept broadcast (or unspecified); refuse the transports not built yet.

    Raises:
        Unimplemented: CUDA IPC or disk (reason TRANSPORT_UNIMPLEMENTED).
        InvalidArgument: a value the contract does not define.
    """
    if transport in (pb.TRANSPORT_UNSPECIFIED, pb.TRANSPORT_BROADCAST):
        return
    if transport in (pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_DISK):
        name = pb.Transport.Name(pb.Transport.ValueType(transport))
        raise Unimplemented(
            "TRANSPORT_UNIMPLEMENTED",
            f"transport {name} is not implemented by this engine yet; use TRANSPORT_BROADCAST",
            transport=name,
        )
    raise InvalidArgument("UNKNOWN_ENUM_VALUE", f"transport value {transport} is not defined in wsync.v1")


class UpdateValidator:
    """Validates one update's metadata, message by message.

    Args:
        specs: the engine's canonical name -> :class:`ParamSpec`.
        aliases: alias -> canonical name (tied tensors).
    """

    def __init__(self, specs: Mapping[str, ParamSpec], aliases: Mapping[str, str]) -> None:
        self._specs = specs
        self._aliases = aliases
        self._seen: dict[str, str] = {}  # canonical -> name it arrived as
        self.header: UpdateHeader | None = None
        self.buckets_declared = 0
        self.bytes_declared = 0
        self.tensors_declared = 0
        # Bound on what one update may claim: every tensor at 8 bytes per element plus padding.
        self._max_bytes = sum(s.numel * 8 + PADDING_PER_TENSOR for s in specs.values())
        self._max_tensors = len(specs) + len(aliases)

    def header_message(self, h: pb.PrepareHeader) -> UpdateHeader:
        """Validate the header.

        Raises:
            InvalidArgument: missing weight version, unknown enum values, a
                non-incremental update without buckets, counts or bytes beyond
                what the model could hold.
            Unimplemented: a transport not built yet.
        """
        if self.header is not None:
            raise InvalidArgument("DUPLICATE_HEADER", "the Prepare stream carried a second header")
        if not h.weight_version:
            raise InvalidArgument("MISSING_WEIGHT_VERSION", "header.weight_version is required")
        validate_transport(h.transport)
        layout = _enum(
            h.layout,
            pb.BUCKET_LAYOUT_UNSPECIFIED,
            pb.BUCKET_LAYOUT_FLATTENED,
            pb.BucketLayout.values(),
            "layout",
        )
        apply_mode = _enum(
            h.apply_mode,
            pb.APPLY_MODE_UNSPECIFIED,
            pb.APPLY_MODE_STAGED,
            pb.ApplyMode.values(),
            "apply_mode",
        )
        if h.bucket_count == 0 and not h.incremental:
            raise InvalidArgument(
                "EMPTY_UPDATE", "header.bucket_count is 0; only an incremental update may start empty"
            )
        if h.bucket_count > self._max_tensors:
            raise InvalidArgument(
                "TOO_MANY_BUCKETS",
                f"header.bucket_count {h.bucket_count} exceeds the {self._max_tensors} tensors of the model",
            )
        if h.total_bytes > self._max_bytes:
            raise InvalidArgument(
                "TOO_MANY_BYTES",
                f"header.total_bytes {h.total_bytes} exceeds what the model could take ({self._max_bytes} bytes)",
            )
        self.header = UpdateHeader(
            update_id=h.update_id or uuid.uuid4().hex,
            weight_version=h.weight_version,
            layout=layout,
            apply_mode=apply_mode,
            bucket_count=h.bucket_count,
            total_bytes=h.total_bytes,
            incremental=h.incremental,
        )
        return self.header

    def bucket_message(self, b: pb.BucketSpec) -> Bucket:
        """Validate the next bucket.

        Raises:
            InvalidArgument: reasons BUCKET_OUT_OF_ORDER, EMPTY_BUCKET,
                UNKNOWN_TENSOR, DUPLICATE_TENSOR, UNSUPPORTED_DTYPE,
                DTYPE_MISMATCH, INVALID_SHAPE, SHAPE_MISMATCH,
                MISALIGNED_OFFSET, OFFSET_OUT_OF_BOUNDS, OVERLAPPING_TENSORS,
                BUCKET_SIZE_MISMATCH; metadata names the bucket and tensor.
        """
        assert self.header is not None, "header first"
        idx = str(b.index)
        if b.index != self.buckets_declared:
            raise InvalidArgument(
                "BUCKET_OUT_OF_ORDER",
                f"bucket index {b.index} arrived where index {self.buckets_declared} was expected",
                bucket=idx,
            )
        if not b.tensors:
            raise InvalidArgument("EMPTY_BUCKET", f"bucket {b.index} has no tensors", bucket=idx)
        tensors: list[Tensor] = []
        seen_here: dict[str, str] = {}
        for t in b.tensors:
            tensors.append(self._tensor(t, b, seen_here))
        total = sum(t.nbytes for t in tensors)
        if self.header.flattened:
            ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
            for prev, cur in itertools.pairwise(ordered):
                if cur.offset < prev.offset + prev.nbytes and cur.nbytes and prev.nbytes:
                    raise InvalidArgument(
                        "OVERLAPPING_TENSORS",
                        f"in bucket {b.index}, tensor {_show(cur.name)} at byte {cur.offset} overlaps "
                        f"{_show(prev.name)} (bytes {prev.offset}..{prev.offset + prev.nbytes})",
                        bucket=idx,
                        tensor=cur.name,
                    )
            if b.size_bytes > total + PADDING_PER_TENSOR * len(tensors):
                raise InvalidArgument(
                    "BUCKET_SIZE_MISMATCH",
                    f"bucket {b.index} declares {b.size_bytes} bytes for {total} bytes of tensors "
                    f"(at most {PADDING_PER_TENSOR} bytes of padding per tensor)",
                    bucket=idx,
                )
        elif b.size_bytes != total:
            raise InvalidArgument(
                "BUCKET_SIZE_MISMATCH",
                f"bucket {b.index} declares {b.size_bytes} bytes but its tensors hold {total} bytes "
                "(individual layout: the sizes must add up exactly)",
                bucket=idx,
            )
        self._seen.update(seen_here)
        self.buckets_declared += 1
        self.bytes_declared += b.size_bytes
        self.tensors_declared += len(tensors)
        if self.bytes_declared > self._max_bytes:
            raise InvalidArgument(
                "TOO_MANY_BYTES",
                f"the buckets declare {self.bytes_declared} bytes, more than the model could take",
                bucket=idx,
            )
        return Bucket(b.index, b.size_bytes, tuple(tensors))

    def _tensor(self, t: pb.TensorSpec, b: pb.BucketSpec, seen_here: dict[str, str]) -> Tensor:
        assert self.header is not None
        idx = str(b.index)
        name = t.name
        canonical = self._aliases.get(name, name)
        spec = self._specs.get(canonical)
        if spec is None:
            raise InvalidArgument(
                "UNKNOWN_TENSOR",
                f"tensor {_show(name)} in bucket {b.index} is not a parameter of the served model",
                bucket=idx,
                tensor=name[:_MAX_NAME_IN_MESSAGE],
            )
        earlier = self._seen.get(canonical) or seen_here.get(canonical)
        if earlier == name:
            raise InvalidArgument(
                "DUPLICATE_TENSOR",
                f"tensor {_show(name)} appears twice in this update (again in bucket {b.index})",
                bucket=idx,
                tensor=name,
            )
        load = earlier is None
        if load:
            seen_here[canonical] = name
        try:
            dtype = parse_dtype(t.dtype)
        except ValueError as e:
            raise InvalidArgument("UNSUPPORTED_DTYPE", f"tensor {_show(name)}: {e}", bucket=idx, tensor=name) from None
        if not can_convert(dtype, spec.dtype):
            raise InvalidArgument(
                "DTYPE_MISMATCH",
                f"tensor {_show(name)} is sent as {t.dtype} but served as "
                f"{str(spec.dtype).removeprefix('torch.')}; only floating dtypes convert",
                bucket=idx,
                tensor=name,
            )
        shape = tuple(int(d) for d in t.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(
                "INVALID_SHAPE",
                f"tensor {_show(name)} has a negative dimension in shape {list(shape)}",
                bucket=idx,
                tensor=name,
            )
        if shape != spec.shape:
            raise InvalidArgument(
                "SHAPE_MISMATCH",
                f"tensor {_show(name)} has shape {list(shape)} but the model expects {list(spec.shape)}",
                bucket=idx,
                tensor=name,
            )
        esize = element_size(dtype)
        nbytes = spec.numel * esize
        offset = int(t.offset_bytes)
        if self.header.flattened:
            if offset % esize:
                raise InvalidArgument(
                    "MISALIGNED_OFFSET",
                    f"tensor {_show(name)} starts at byte {offset}, not a multiple of its {esize}-byte element size",
                    bucket=idx,
                    tensor=name,
                )
            if offset + nbytes > b.size_bytes:
                raise InvalidArgument(
                    "OFFSET_OUT_OF_BOUNDS",
                    f"tensor {_show(name)} spans bytes {offset}..{offset + nbytes} but bucket {b.index} "
                    f"holds {b.size_bytes} bytes",
                    bucket=idx,
                    tensor=name,
                )
        else:
            offset = 0
        return Tensor(name, canonical, dtype, shape, offset, nbytes, load)

    def finish_stream(self) -> None:
        """Check the stream's buckets against the header's counts.

        Raises:
            InvalidArgument: MISSING_HEADER, BUCKET_COUNT_MISMATCH or TOTAL_BYTES_MISMATCH.
        """
        if self.header is None:
            raise InvalidArgument("MISSING_HEADER", "the Prepare stream ended without a header")
        if self.buckets_declared != self.header.bucket_count:
            raise InvalidArgument(
                "BUCKET_COUNT_MISMATCH",
                f"the header announced {self.header.bucket_count} buckets but the stream carried "
                f"{self.buckets_declared}",
            )
        if self.bytes_declared != self.header.total_bytes:
            raise InvalidArgument(
                "TOTAL_BYTES_MISMATCH",
                f"the header announced {self.header.total_bytes} bytes but the buckets add up to {self.bytes_declared}",
            )

    def check_more_buckets(self, count: int) -> None:
        """Refuse a bucket message beyond the header's count while the stream is read.

        Raises:
            InvalidArgument: BUCKET_COUNT_MISMATCH.
        """
        assert self.header is not None
        if count > self.header.bucket_count:
            raise InvalidArgument(
                "BUCKET_COUNT_MISMATCH",
                f"the stream carries more buckets than the {self.header.bucket_count} its header announced",
            )
