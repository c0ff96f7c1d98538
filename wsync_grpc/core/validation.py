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

import bisect
import dataclasses
import itertools
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from wsync_grpc.core.delta import POSITIONS_BY_NUMBER, DeltaCoding, holds_exactly
from wsync_grpc.core.dtypes import can_convert, element_size, parse_dtype
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.header import UpdateHeader, check_adapter_header, check_delta_header, transport_unimplemented
from wsync_grpc.core.layout import Bucket, Piece, TensorSlot, Transport
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.core.params import ParamSpec
from wsync_grpc.core.update import TransportRules

PADDING_PER_TENSOR = 4096
"""Largest padding accepted per tensor in a flattened bucket, in bytes (alignment slack)."""

_MAX_NAME_IN_MESSAGE = 120

MAX_ID_CHARS = 256
"""Longest ``weight_version`` and ``update_id`` accepted, in characters (they are kept, logged and
reported with every answer)."""

MAX_PIECES = 1024
"""Most pieces one tensor may be sent in (``wsync.v1.TensorShard``): a trainer of up to this many ranks."""


def _show(name: str) -> str:
    """Quote a caller-supplied name for an error message, shortened."""
    if len(name) > _MAX_NAME_IN_MESSAGE:
        name = name[:_MAX_NAME_IN_MESSAGE] + "..."
    return repr(name)


class ShardFields(Protocol):
    """What the validator reads of a piece's place (``wsync.v1.TensorShard`` has these fields)."""

    @property
    def global_shape(self) -> Sequence[int]: ...
    @property
    def offsets(self) -> Sequence[int]: ...


class DeltaFields(Protocol):
    """What the validator reads of a tensor's delta (``wsync.v1.TensorDelta`` has these fields); all 0: none."""

    @property
    def positions(self) -> int: ...
    @property
    def changed_elements(self) -> int: ...
    @property
    def positions_bytes(self) -> int: ...


class TensorSpecFields(Protocol):
    """What the validator reads of one declared tensor (``wsync.v1.TensorSpec`` has these fields).

    ``shard`` with an empty ``global_shape`` means the whole tensor.
    """

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def offset_bytes(self) -> int: ...
    @property
    def shard(self) -> ShardFields: ...
    @property
    def delta(self) -> DeltaFields: ...


class BucketSpecFields(Protocol):
    """What the validator reads of one declared bucket (``wsync.v1.BucketSpec`` has these fields)."""

    @property
    def index(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def tensors(self) -> Sequence[TensorSpecFields]: ...
    @property
    def src_rank(self) -> int: ...


@dataclass
class _Tiling:
    """The pieces of one tensor declared so far (a sharded trainer's direct send).

    Attributes:
        dtype: the pieces' wire dtype (every piece must have it).
        load: whether the assembled tensor is loaded (False for a tied alias of a tensor already sent).
        numel: elements of the whole tensor.
        covered: elements covered by the pieces so far (they never overlap).
        ranges: pieces that are one contiguous run of the whole tensor's elements, as sorted
            ``(start, end)`` element ranges (found by bisection).
        boxes: the other pieces, as ``(offsets, shape)`` (compared pairwise).
    """

    dtype: torch.dtype
    load: bool
    numel: int
    covered: int = 0
    ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=list)

    def copy(self) -> _Tiling:
        """An independent copy (a batch's changes are kept apart until the batch passed)."""
        return dataclasses.replace(self, ranges=list(self.ranges), boxes=list(self.boxes))

    @property
    def pieces(self) -> int:
        """Pieces declared so far."""
        return len(self.ranges) + len(self.boxes)

    def add(self, offsets: tuple[int, ...], shape: tuple[int, ...], whole: tuple[int, ...]) -> bool:
        """Record a piece at ``offsets`` of ``shape`` unless it overlaps one declared so far; whether it did not."""
        run = _run(offsets, shape, whole)
        if any(_boxes_meet(o, s, offsets, shape) for o, s in self.boxes):
            return False
        if run is None:
            if any(_boxes_meet(o, s, offsets, shape) for o, s in (_run_box(r, whole) for r in self.ranges)):
                return False
            self.boxes.append((offsets, shape))
        else:
            i = bisect.bisect_left(self.ranges, run)
            if (i > 0 and self.ranges[i - 1][1] > run[0]) or (i < len(self.ranges) and self.ranges[i][0] < run[1]):
                return False
            self.ranges.insert(i, run)
        self.covered += math.prod(shape)
        return True


def _run(offsets: tuple[int, ...], shape: tuple[int, ...], whole: tuple[int, ...]) -> tuple[int, int] | None:
    """The ``[start, end)`` element range of a piece that is one contiguous run of the whole tensor, else None.

    A piece is such a run when every dimension after its first is whole (e.g. FSDP2's ``Shard(0)``).
    """
    if len(shape) == 0 or any(o != 0 or n != w for o, n, w in zip(offsets[1:], shape[1:], whole[1:], strict=True)):
        return None
    row = math.prod(whole[1:])
    return offsets[0] * row, (offsets[0] + shape[0]) * row


def _run_box(r: tuple[int, int], whole: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(offsets, shape)`` of the contiguous run ``r`` (see :func:`_run`)."""
    row = math.prod(whole[1:])
    return (r[0] // row, *(0 for _ in whole[1:])), ((r[1] - r[0]) // row, *whole[1:])


def _boxes_meet(o1: tuple[int, ...], s1: tuple[int, ...], o2: tuple[int, ...], s2: tuple[int, ...]) -> bool:
    """Whether two boxes (offsets, shape) share an element."""
    return all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2, strict=True))


@dataclass
class _Declared:
    """The tensors an update declared: every name as sent, the canonical names they resolve to, the pieces."""

    names: set[str] = dataclasses.field(default_factory=set)
    canonical: set[str] = dataclasses.field(default_factory=set)
    pieces: dict[str, _Tiling] = dataclasses.field(default_factory=dict)


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
        trainer_ranks: the group's trainer ranks (``wsync.v1.InitRequest.trainer_ranks``): every
            bucket's ``src_rank`` must be below it (a header naming ``shared_memory_ranks`` replaces it with their
            number: no group).
    """

    def __init__(
        self,
        specs: Mapping[str, ParamSpec],
        aliases: Mapping[str, str],
        fused: Sequence[Sequence[str]] = (),
        transports: Callable[[Transport], TransportRules] | None = None,
        adapter_specs: Callable[[LoraSpec], Mapping[str, ParamSpec]] | None = None,
        trainer_ranks: int = 1,
    ) -> None:
        self._trainer_ranks = trainer_ranks
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
        # (Each trainer rank may send its own piece of every tensor, with its own padding.)
        ranks = self._trainer_ranks
        self._max_bytes = sum(s.numel * 8 + PADDING_PER_TENSOR * ranks for s in specs.values())
        self._max_tensors = (len(specs) + len(aliases)) * ranks

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
            InvalidArgument: a second header, a missing or too long weight version, a too long update id, a
                non-incremental update without buckets, counts or bytes beyond
                what the model could hold, digests promised for buckets the engine reads itself.
            Unimplemented: a transport not built yet.
        """
        if self.header is not None:
            raise InvalidArgument("DUPLICATE_HEADER", "the Prepare stream carried a second header")
        if not h.weight_version:
            raise InvalidArgument("MISSING_WEIGHT_VERSION", "header.weight_version is required")
        if len(h.weight_version) > MAX_ID_CHARS:
            raise InvalidArgument(
                "VERSION_TOO_LONG",
                f"header.weight_version has {len(h.weight_version)} characters; at most {MAX_ID_CHARS}",
            )
        if len(h.update_id) > MAX_ID_CHARS:
            raise InvalidArgument(
                "UPDATE_ID_TOO_LONG", f"header.update_id has {len(h.update_id)} characters; at most {MAX_ID_CHARS}"
            )
        check_delta_header(h)
        if self._transports is not None:
            rules = self._transports(h.transport)
            h = rules.check_header(h)
            self._from_source = rules.engine_builds_buckets
        elif h.transport is not Transport.BROADCAST:
            raise transport_unimplemented(h.transport)
        if h.shared_memory_rings and h.transport not in (Transport.SHARED_MEMORY, Transport.CUDA_IPC):
            raise InvalidArgument(
                "UNEXPECTED_SHARED_MEMORY",
                "header.shared_memory and header.shared_memory_ranks are for transports TRANSPORT_SHARED_MEMORY and "
                "TRANSPORT_CUDA_IPC only",
            )
        if h.shared_memory_ranks:  # no group: the trainer's sending ranks are the rings the header names
            self._trainer_ranks = len(h.shared_memory_ranks)
        if h.adapter is not None:
            check_adapter_header(h, self._adapter_specs is not None, self._from_source)
            if not self._from_source:  # an adapter read from a source gets its spec from there first
                self.use_specs(self.adapter_specs(h.adapter), {})
        if self._from_source:
            if h.digests_follow:
                raise InvalidArgument(
                    "UNEXPECTED_DIGESTS", "header.digests_follow is for buckets a trainer sends, not read by the engine"
                )
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
                f"header.bucket_count {h.bucket_count} exceeds the {self._max_tensors} tensors (or pieces of "
                "tensors, one per trainer rank) of the model",
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
        self._declared.pieces.update(pending.pieces)
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
        if b.src_rank >= self._trainer_ranks:
            raise InvalidArgument(
                "INVALID_SRC_RANK",
                f"bucket {b.index} names src_rank {b.src_rank}, but the update has "
                f"{self._trainer_ranks} sending trainer rank(s) (Init's trainer_ranks, or the rings of "
                "header.shared_memory_ranks)",
                bucket=idx,
            )
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
        return Bucket(b.index, b.size_bytes, tensors, b.src_rank)

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
        sharded = len(t.shard.global_shape) > 0
        tiling = pending.pieces.get(name) or self._declared.pieces.get(name)
        if name in self._declared.names or name in pending.names:
            if not sharded or tiling is None:
                raise InvalidArgument(
                    "DUPLICATE_TENSOR",
                    f"tensor {_show(name)} appears twice in this update (again in bucket {b.index})",
                    bucket=idx,
                    tensor=name,
                )
            load = tiling.load
        else:
            # A tied alias of a tensor already in the update is received but loaded once.
            load = canonical not in self._declared.canonical and canonical not in pending.canonical
        pending.names.add(name)
        if load:
            pending.canonical.add(canonical)
        dtype = _wire_dtype(t, spec, idx)
        piece: Piece | None = None
        if sharded:
            shape, piece = self._piece(t, spec, dtype, load, idx, pending)
            numel = math.prod(shape)
        else:
            shape, numel = _shape(t, spec, idx), spec.numel
        esize = element_size(dtype)
        delta = self._delta(t, numel, idx, spec.dtype, dtype)
        nbytes = numel * esize if delta is None else delta.nbytes(esize)
        offset = self._offset(t, b, esize, nbytes) if self.header is not None and self.header.flattened else 0
        return TensorSlot(name, dtype, shape, offset, nbytes, canonical, load, piece, delta)

    def _delta(
        self,
        t: TensorSpecFields,
        numel: int,
        idx: str,
        spec_dtype: torch.dtype,
        wire_dtype: torch.dtype,
    ) -> DeltaCoding | None:
        """The delta ``t`` carries (``None``: the whole tensor), its sizes checked against the tensor's (a piece's:
        ``numel`` is then the piece's).

        Raises:
            InvalidArgument: UNEXPECTED_DELTA (not a delta update), DELTA_ENCODING
                (positions unspecified or unknown), DELTA_DTYPE (the served dtype does not hold the wire dtype
                exactly: its base read back would not be the trainer's), DELTA_SIZE_MISMATCH.
        """
        d = t.delta
        if not (d.positions or d.changed_elements or d.positions_bytes):
            return None
        assert self.header is not None
        where = {"bucket": idx, "tensor": t.name[:_MAX_NAME_IN_MESSAGE]}
        if not self.header.delta:
            raise InvalidArgument(
                "UNEXPECTED_DELTA",
                f"tensor {_show(t.name)} carries a delta, but the header names no base_weight_version",
                **where,
            )
        positions = POSITIONS_BY_NUMBER.get(d.positions)
        if positions is None:
            raise InvalidArgument(
                "DELTA_ENCODING",
                f"tensor {_show(t.name)} carries a delta with positions {d.positions}: not one of the contract's",
                **where,
            )
        if not holds_exactly(spec_dtype, wire_dtype):
            raise InvalidArgument(
                "DELTA_DTYPE",
                f"tensor {_show(t.name)} is served as {str(spec_dtype).removeprefix('torch.')}, which does not hold "
                f"its wire dtype {str(wire_dtype).removeprefix('torch.')} exactly: a delta cannot be applied to it; "
                "send it whole, or in the served dtype",
                **where,
            )
        coding = DeltaCoding(positions, int(d.changed_elements), int(d.positions_bytes))
        expected = coding.expected_positions_bytes(numel)
        if (
            coding.changed > numel
            or coding.positions_bytes != expected
            or (positions.name == "INDICES" and numel >= 2**32)
        ):
            raise InvalidArgument(
                "DELTA_SIZE_MISMATCH",
                f"tensor {_show(t.name)} of {numel} elements carries a delta of {coding.changed} values with "
                f"{coding.positions_bytes} bytes of {positions.name} positions ({expected} expected)",
                **where,
            )
        return coding

    def _piece(
        self, t: TensorSpecFields, spec: ParamSpec, dtype: torch.dtype, load: bool, idx: str, pending: _Declared
    ) -> tuple[tuple[int, ...], Piece]:
        """The shape and place of the piece ``t``, which must lie inside the whole tensor and overlap no other.

        Raises:
            InvalidArgument: SHAPE_MISMATCH (global shape), INVALID_SHARD (dimensions, an empty
                piece, too many pieces), PIECE_OUT_OF_BOUNDS, DTYPE_MISMATCH (between pieces),
                OVERLAPPING_PIECES.
        """
        name = t.name
        whole = tuple(int(d) for d in t.shard.global_shape)
        if whole != spec.shape:
            raise InvalidArgument(
                "SHAPE_MISMATCH",
                f"tensor {_show(name)} is sharded from global shape {list(whole)} but the model expects "
                f"{list(spec.shape)}",
                bucket=idx,
                tensor=name,
            )
        shape = tuple(int(d) for d in t.shape)
        offsets = tuple(int(o) for o in t.shard.offsets)
        if len(shape) != len(whole) or len(offsets) != len(whole):
            raise InvalidArgument(
                "INVALID_SHARD",
                f"a piece of tensor {_show(name)} has shape {list(shape)} and offsets {list(offsets)}; "
                f"both need {len(whole)} dimensions",
                bucket=idx,
                tensor=name,
            )
        if any(n <= 0 for n in shape) or any(o < 0 for o in offsets):
            raise InvalidArgument(
                "INVALID_SHARD",
                f"a piece of tensor {_show(name)} is empty or starts before the tensor "
                f"(shape {list(shape)}, offsets {list(offsets)}); send no empty piece",
                bucket=idx,
                tensor=name,
            )
        if any(o + n > w for o, n, w in zip(offsets, shape, whole, strict=True)):
            raise InvalidArgument(
                "PIECE_OUT_OF_BOUNDS",
                f"a piece of tensor {_show(name)} at offsets {list(offsets)} of shape {list(shape)} "
                f"reaches past its global shape {list(whole)}",
                bucket=idx,
                tensor=name,
            )
        tiling = pending.pieces.get(name)
        if tiling is None:
            declared = self._declared.pieces.get(name)
            tiling = declared.copy() if declared is not None else _Tiling(dtype, load, spec.numel)
            pending.pieces[name] = tiling
        if dtype != tiling.dtype:
            raise InvalidArgument(
                "DTYPE_MISMATCH",
                f"the pieces of tensor {_show(name)} are sent as different dtypes "
                f"({str(tiling.dtype).removeprefix('torch.')} and {t.dtype})",
                bucket=idx,
                tensor=name,
            )
        if tiling.pieces >= MAX_PIECES:
            raise InvalidArgument(
                "INVALID_SHARD", f"tensor {_show(name)} is sent in more than {MAX_PIECES} pieces", tensor=name
            )
        if not tiling.add(offsets, shape, whole):
            raise InvalidArgument(
                "OVERLAPPING_PIECES",
                f"a piece of tensor {_show(name)} at offsets {list(offsets)} of shape {list(shape)} overlaps "
                "a piece already declared",
                bucket=idx,
                tensor=name,
            )
        return shape, Piece(whole, offsets)

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
            self.check_whole()

    def check_whole(self) -> None:
        """Every tensor is whole once the update's buckets are all declared: fused groups and pieces.

        Raises:
            InvalidArgument: PARTIAL_FUSED_GROUP (:meth:`check_fused`), INCOMPLETE_TENSOR (the
                pieces of a sharded tensor leave a gap).
        """
        self.check_fused()
        for name, tiling in self._declared.pieces.items():
            if tiling.covered != tiling.numel:
                raise InvalidArgument(
                    "INCOMPLETE_TENSOR",
                    f"the pieces of tensor {_show(name)} cover {tiling.covered} of its {tiling.numel} elements: "
                    "the trainer ranks' shards must tile the whole tensor",
                    tensor=name,
                )

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
