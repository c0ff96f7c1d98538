"""Validation of an update's metadata (Prepare header and buckets) against the engine's model.

Everything a trainer declares is checked here before a single receive is
posted (``docs/architecture.md``, "Invariants"): every tensor name, dtype,
shape and byte range, every bucket's size and order, and the header's counts.
A failed check raises :class:`~wsync_grpc.core.errors.InvalidArgument` (or
``Unimplemented`` for a transport not built yet) whose reason says what is
wrong and whose metadata names the offending tensor and bucket. Nothing here
allocates memory in proportion to what the caller claims.

The bucket messages are read through :class:`BucketSpecFields` and
:class:`TensorSpecFields`, which ``wsync.v1.BucketSpec`` and ``wsync.v1.TensorSpec``
satisfy as they are: a Prepare stream of 100k tensors is validated without
converting each message first. The header arrives already converted
(:func:`wsync_grpc.wire.convert.header_from_proto`).
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from wsync_grpc.core.dtypes import can_convert, element_size, parse_dtype
from wsync_grpc.core.engine import ParamSpec
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import UpdateHeader, check_adapter_header, transport_unimplemented
from wsync_grpc.core.layout import Bucket, TensorSlot, Transport
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.core.update import TransportRules

PADDING_PER_TENSOR = 4096
"""Largest padding accepted per tensor in a flattened bucket, in bytes (alignment slack)."""

_MAX_NAME_IN_MESSAGE = 120


def _show(name: str) -> str:
    """Quote a caller-supplied name for an error message, shortened."""
    if len(name) > _MAX_NAME_IN_MESSAGE:
        name = name[:_MAX_NAME_IN_MESSAGE] + "..."
    return repr(name)


class TensorSpecFields(Protocol):
    """What the validator reads of one declared tensor (``wsync.v1.TensorSpec`` has these fields)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def offset_bytes(self) -> int: ...


class BucketSpecFields(Protocol):
    """What the validator reads of one declared bucket (``wsync.v1.BucketSpec`` has these fields)."""

    @property
    def index(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def tensors(self) -> Sequence[TensorSpecFields]: ...


@dataclass
class _Declared:
    """The tensors an update declared: every name as sent, and the canonical names they resolve to."""

    names: set[str] = dataclasses.field(default_factory=set)
    canonical: set[str] = dataclasses.field(default_factory=set)


class UpdateValidator:
    """Validates one update's metadata, message by message, for the whole update (Prepare and every Update).

    Args:
        specs: the engine's canonical name -> :class:`ParamSpec`.
        aliases: alias -> canonical name (tied tensors).
        fused: groups of canonical names an update must carry all or none of
            (:class:`~wsync_grpc.core.engine.FusedGroups`, e.g. vLLM's
            ``qkv_proj`` = ``q_proj`` + ``k_proj`` + ``v_proj``).
        transports: the transport registry (:func:`wsync_grpc.transports.transport_for`): the rules of the
            header's transport (its header checks; whether the engine builds the buckets from the source the
            header names); ``None``: broadcast only, any other transport UNIMPLEMENTED.
        adapter_specs: for an engine that serves LoRA adapters, the tensors an adapter of a given spec
            carries (:func:`~wsync_grpc.core.lora.adapter_param_specs`); ``None``: adapter updates are
            UNIMPLEMENTED. An adapter update is validated against these instead of ``specs``.
    """

    def __init__(
        self,
        specs: Mapping[str, ParamSpec],
        aliases: Mapping[str, str],
        fused: Sequence[Sequence[str]] = (),
        transports: Callable[[Transport], TransportRules] | None = None,
        adapter_specs: Callable[[LoraSpec], Mapping[str, ParamSpec]] | None = None,
    ) -> None:
        self._transports = transports
        self._from_source = False
        self._adapter_specs = adapter_specs
        self._declared = _Declared()
        self.header: UpdateHeader | None = None
        self.buckets_declared = 0
        self.bytes_declared = 0
        self.tensors_declared = 0
        self.use_specs(specs, aliases, fused)

    def use_specs(
        self, specs: Mapping[str, ParamSpec], aliases: Mapping[str, str], fused: Sequence[Sequence[str]] = ()
    ) -> None:
        """Validate every bucket from now on against ``specs`` (an adapter's tensors, once its spec is known)."""
        self._specs = specs
        self._aliases = aliases
        self._fused = [tuple(g) for g in fused]
        # Bound on what one update may claim: every tensor at 8 bytes per element plus padding.
        self._max_bytes = sum(s.numel * 8 + PADDING_PER_TENSOR for s in specs.values())
        self._max_tensors = len(specs) + len(aliases)

    def adapter_specs(self, spec: LoraSpec) -> Mapping[str, ParamSpec]:
        """The tensors an adapter of ``spec`` carries on this engine (see the constructor).

        Only after :meth:`header_message` accepted an adapter header, which refuses
        adapters on an engine without them (ADAPTERS_UNIMPLEMENTED).

        Raises:
            InvalidArgument: see :func:`~wsync_grpc.core.lora.adapter_param_specs`.
        """
        assert self._adapter_specs is not None, "check_adapter_header refused this update"
        return self._adapter_specs(spec)

    def header_message(self, h: UpdateHeader) -> UpdateHeader:
        """Validate the header; return it with an update id (a fresh UUID when ``h.update_id`` is empty).

        Raises:
            InvalidArgument: a second header, a missing weight version, a
                non-incremental update without buckets, counts or bytes beyond
                what the model could hold.
            Unimplemented: a transport not built yet.
        """
        if self.header is not None:
            raise InvalidArgument("DUPLICATE_HEADER", "the Prepare stream carried a second header")
        if not h.weight_version:
            raise InvalidArgument("MISSING_WEIGHT_VERSION", "header.weight_version is required")
        if self._transports is not None:
            rules = self._transports(h.transport)
            h = rules.check_header(h)
            self._from_source = rules.engine_builds_buckets
        elif h.transport is not Transport.BROADCAST:
            raise transport_unimplemented(h.transport)
        if h.adapter is not None:
            check_adapter_header(h, self._adapter_specs is not None, self._from_source)
            if not self._from_source:  # an adapter read from a source gets its spec from there first
                self.use_specs(self.adapter_specs(h.adapter), {})
        if self._from_source:
            self.header = dataclasses.replace(h, update_id=h.update_id or uuid.uuid4().hex)
            return self.header
        if h.checkpoint_path:
            raise InvalidArgument(
                "UNEXPECTED_CHECKPOINT_PATH", "header.checkpoint_path is for transport TRANSPORT_DISK only"
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
        self.header = dataclasses.replace(h, update_id=h.update_id or uuid.uuid4().hex)
        return self.header

    def bucket_messages(self, specs: Sequence[BucketSpecFields]) -> list[Bucket]:
        """Validate the next buckets, all or none: a refused batch leaves the validator as it was.

        Raises:
            InvalidArgument: reasons BUCKET_OUT_OF_ORDER, EMPTY_BUCKET,
                UNKNOWN_TENSOR, DUPLICATE_TENSOR, UNSUPPORTED_DTYPE,
                DTYPE_MISMATCH, INVALID_SHAPE, SHAPE_MISMATCH,
                MISALIGNED_OFFSET, OFFSET_OUT_OF_BOUNDS, OVERLAPPING_TENSORS,
                BUCKET_SIZE_MISMATCH, TOO_MANY_BYTES; metadata names the bucket
                and tensor.
        """
        assert self.header is not None, "header first"
        pending = _Declared()  # this batch's tensors, kept apart until every bucket passed
        counts = (self.buckets_declared, self.bytes_declared, self.tensors_declared)
        try:
            out = [self._bucket(b, pending) for b in specs]
        except InvalidArgument:
            self.buckets_declared, self.bytes_declared, self.tensors_declared = counts
            raise
        self._declared.names |= pending.names
        self._declared.canonical |= pending.canonical
        return out

    def _bucket(self, b: BucketSpecFields, pending: _Declared) -> Bucket:
        assert self.header is not None
        idx = str(b.index)
        if b.index != self.buckets_declared:
            raise InvalidArgument(
                "BUCKET_OUT_OF_ORDER",
                f"bucket index {b.index} arrived where index {self.buckets_declared} was expected",
                bucket=idx,
            )
        if not b.tensors:
            raise InvalidArgument("EMPTY_BUCKET", f"bucket {b.index} has no tensors", bucket=idx)
        tensors = tuple(self._tensor(t, b, pending) for t in b.tensors)
        self._check_size(b, tensors)
        self.buckets_declared += 1
        self.bytes_declared += b.size_bytes
        self.tensors_declared += len(tensors)
        if self.bytes_declared > self._max_bytes:
            raise InvalidArgument(
                "TOO_MANY_BYTES",
                f"the buckets declare {self.bytes_declared} bytes, more than the model could take",
                bucket=idx,
            )
        return Bucket(b.index, b.size_bytes, tensors)

    def _check_size(self, b: BucketSpecFields, tensors: Sequence[TensorSlot]) -> None:
        """Flattened: no overlap, at most the allowed padding; individual: sizes add up exactly."""
        assert self.header is not None
        idx = str(b.index)
        total = sum(t.nbytes for t in tensors)
        if not self.header.flattened:
            if b.size_bytes != total:
                raise InvalidArgument(
                    "BUCKET_SIZE_MISMATCH",
                    f"bucket {b.index} declares {b.size_bytes} bytes but its tensors hold {total} bytes "
                    "(individual layout: the sizes must add up exactly)",
                    bucket=idx,
                )
            return
        ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
        for prev, cur in itertools.pairwise(ordered):
            if cur.offset < prev.end and cur.nbytes and prev.nbytes:
                raise InvalidArgument(
                    "OVERLAPPING_TENSORS",
                    f"in bucket {b.index}, tensor {_show(cur.name)} at byte {cur.offset} overlaps "
                    f"{_show(prev.name)} (bytes {prev.offset}..{prev.end})",
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

    def _tensor(self, t: TensorSpecFields, b: BucketSpecFields, pending: _Declared) -> TensorSlot:
        name = t.name
        idx = str(b.index)
        canonical = self._aliases.get(name, name)
        spec = self._specs.get(canonical)
        if spec is None:
            raise InvalidArgument(
                "UNKNOWN_TENSOR",
                f"tensor {_show(name)} in bucket {b.index} is not a parameter of the served model",
                bucket=idx,
                tensor=name[:_MAX_NAME_IN_MESSAGE],
            )
        if name in self._declared.names or name in pending.names:
            raise InvalidArgument(
                "DUPLICATE_TENSOR",
                f"tensor {_show(name)} appears twice in this update (again in bucket {b.index})",
                bucket=idx,
                tensor=name,
            )
        # A tied alias of a tensor already in the update is received but loaded once.
        load = canonical not in self._declared.canonical and canonical not in pending.canonical
        pending.names.add(name)
        if load:
            pending.canonical.add(canonical)
        dtype = _wire_dtype(t, spec, idx)
        shape = _shape(t, spec, idx)
        esize = element_size(dtype)
        nbytes = spec.numel * esize
        offset = self._offset(t, b, esize, nbytes) if self.header is not None and self.header.flattened else 0
        return TensorSlot(name, dtype, shape, offset, nbytes, canonical, load)

    def _offset(self, t: TensorSpecFields, b: BucketSpecFields, esize: int, nbytes: int) -> int:
        """The flattened layout's byte offset of ``t``: aligned to its element size and inside its bucket."""
        offset = int(t.offset_bytes)
        if offset % esize:
            raise InvalidArgument(
                "MISALIGNED_OFFSET",
                f"tensor {_show(t.name)} starts at byte {offset}, not a multiple of its {esize}-byte element size",
                bucket=str(b.index),
                tensor=t.name,
            )
        if offset + nbytes > b.size_bytes:
            raise InvalidArgument(
                "OFFSET_OUT_OF_BOUNDS",
                f"tensor {_show(t.name)} spans bytes {offset}..{offset + nbytes} but bucket {b.index} "
                f"holds {b.size_bytes} bytes",
                bucket=str(b.index),
                tensor=t.name,
            )
        return offset

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
        if not self.header.incremental and not self._from_source:
            self.check_fused()

    def source_buckets(self, specs: Sequence[BucketSpecFields]) -> list[Bucket]:
        """Validate the buckets the engine built from the update's source (a checkpoint's headers), all at once.

        The same checks as a broadcast's buckets (:meth:`bucket_messages`) and the fused groups.

        Raises:
            InvalidArgument: EMPTY_CHECKPOINT (no tensor), and the reasons of
                :meth:`bucket_messages` and :meth:`check_fused`.
        """
        assert self.header is not None and self._from_source
        if not specs:
            raise InvalidArgument("EMPTY_CHECKPOINT", "the checkpoint holds no tensor")
        buckets = self.bucket_messages(specs)
        self.check_fused()
        return buckets

    def check_fused(self) -> None:
        """Refuse an update that carries part of a fused group (all its tensors are declared by now).

        Raises:
            InvalidArgument: PARTIAL_FUSED_GROUP, naming the group and what is missing.
        """
        declared = self._declared.canonical
        for group in self._fused:
            missing = [n for n in group if n not in declared]
            if missing and len(missing) < len(group):
                raise InvalidArgument(
                    "PARTIAL_FUSED_GROUP",
                    f"the engine serves {', '.join(_show(n) for n in group)} as one fused tensor: an update must "
                    f"carry all of them or none; missing {', '.join(_show(n) for n in missing)}",
                    tensor=_show(missing[0]),
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


def _wire_dtype(t: TensorSpecFields, spec: ParamSpec, idx: str) -> torch.dtype:
    """The declared dtype of ``t``, which must be one weight sync carries and convertible to the served one."""
    try:
        dtype = parse_dtype(t.dtype)
    except ValueError as e:
        raise InvalidArgument("UNSUPPORTED_DTYPE", f"tensor {_show(t.name)}: {e}", bucket=idx, tensor=t.name) from None
    if not can_convert(dtype, spec.dtype):
        raise InvalidArgument(
            "DTYPE_MISMATCH",
            f"tensor {_show(t.name)} is sent as {t.dtype} but served as "
            f"{str(spec.dtype).removeprefix('torch.')}; only floating dtypes convert",
            bucket=idx,
            tensor=t.name,
        )
    return dtype


def _shape(t: TensorSpecFields, spec: ParamSpec, idx: str) -> tuple[int, ...]:
    """The declared shape of ``t``, which must be the served tensor's full shape."""
    if tuple(t.shape) == spec.shape:  # the common case: no negative dimension either
        return spec.shape
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(
            "INVALID_SHAPE",
            f"tensor {_show(t.name)} has a negative dimension in shape {list(shape)}",
            bucket=idx,
            tensor=t.name,
        )
    if shape != spec.shape:
        raise InvalidArgument(
            "SHAPE_MISMATCH",
            f"tensor {_show(t.name)} has shape {list(shape)} but the model expects {list(spec.shape)}",
            bucket=idx,
            tensor=t.name,
        )
    return shape
