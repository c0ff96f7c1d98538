"""Delta payloads: only the elements of a tensor whose value in the wire dtype changed (``wsync.v1.TensorDelta``).

Between two RL steps most weights are bit-identical once converted to the dtype the engine
serves (a bfloat16 element absorbs any change smaller than about ``|w| / 256``). A delta entry
of a bucket carries, for one tensor, the new values of the elements that changed, then their
positions, against a *base*: the weights the engine serves, named by the engine's own identity
(``wsync.v1.PrepareHeader.base_weight_identity``). The values overwrite (never XOR): applying a
delta twice gives the same tensor, and the result is bit for bit the whole tensor it stands for.

Layout of one entry inside a bucket, from the tensor's ``offset_bytes``: ``changed`` values of
the wire dtype (C order of their positions), zero padding to the next multiple of 8 bytes, then
``positions_bytes`` bytes of positions in one of four encodings (:class:`Positions`), picked per
tensor by :func:`encode` as the smallest (densities for bfloat16):

- ``GAPS16``: 2 bytes per entry, the distance from the previous one (``uint16``); a gap above 65535 is
  bridged by entries at unchanged positions that carry their unchanged value, so the overwrite is exact;
  smallest below about 1% changed;
- ``GAPS``: the same in 1 byte per entry (gaps of 255 at most): more bridges, but each costs 3 bytes
  where an entry of ``GAPS16`` costs 4; smallest between about 1% and 12% (at 1% the gaps average 100
  and about 8% of them need a bridge);
- ``BITMAP``: one bit per element of the tensor; smallest above about 12%;
- ``INDICES``: 4 bytes per changed element (``uint32``); smallest only for the sparsest tensors (gaps
  above 65535 on average).

A tensor whose delta would take at least :data:`DENSE_SHARE` of its whole bytes travels whole.

Pure torch, no I/O; sizes in bytes. Decoding checks everything a caller could get wrong
(positions out of range or out of order, a bitmap with the wrong count), so a corrupt entry
raises :class:`~wsync_grpc.core.errors.InvalidArgument` instead of writing anywhere.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from wsync_grpc.core.errors import InvalidArgument

POSITIONS_ALIGNMENT = 8
"""The positions of an entry start at the next multiple of this many bytes after its values."""

DENSE_SHARE = 0.75
"""A tensor travels whole when its delta would take at least this share of its whole bytes (decoding costs a
pass over the base, so a delta that saves little is not worth it)."""

GAP_LIMIT = 255
"""The largest gap one ``GAPS`` entry holds (``uint8``)."""

_INDEX_LIMIT = 2**32
"""``INDICES`` hold ``uint32`` positions: tensors of fewer elements only."""

_BITS = torch.arange(8, dtype=torch.uint8)

_BEFORE_FIRST = torch.tensor([-1], dtype=torch.int64)
"""Where the gap to the first changed position starts from."""

SPARSE_WORDS = 0.15
"""The share of changed 8-byte words below which :func:`delta_of` finds the changed elements word by word (one
comparison per word, then the lanes of the changed words only) instead of comparing every element: the element
comparison writes a boolean per element and lists them all, which costs more while few words changed and less
once many did."""


class Positions(enum.Enum):
    """How a delta entry's positions are written (``wsync.v1.DeltaPositions``)."""

    INDICES = "indices"
    BITMAP = "bitmap"
    GAPS = "gaps"
    GAPS16 = "gaps16"


_GAP_LIMITS = {Positions.GAPS: 255, Positions.GAPS16: 65535}
"""The largest gap one entry of each gaps encoding holds."""
_GAP_BYTES = {Positions.GAPS: 1, Positions.GAPS16: 2}
"""The bytes of one entry of each gaps encoding."""


POSITIONS_BY_NUMBER = {1: Positions.INDICES, 2: Positions.BITMAP, 3: Positions.GAPS, 4: Positions.GAPS16}
"""The encodings by their ``wsync.v1.DeltaPositions`` numbers (the validator reads the messages as they are)."""


@dataclass(frozen=True)
class DeltaCoding:
    """What one delta entry of a bucket holds (``wsync.v1.TensorDelta``).

    Attributes:
        positions: how its positions are written.
        changed: values it carries (for ``GAPS``, bridging entries included); 0: the tensor is unchanged.
        positions_bytes: the length of its positions, in bytes.
    """

    positions: Positions
    changed: int
    positions_bytes: int

    def values_bytes(self, element_size: int) -> int:
        """The length of its values, in bytes, for a wire dtype of ``element_size`` bytes."""
        return self.changed * element_size

    def nbytes(self, element_size: int) -> int:
        """Its length in the bucket, in bytes: values, padding to :data:`POSITIONS_ALIGNMENT`, positions."""
        return _align(self.values_bytes(element_size)) + self.positions_bytes

    def expected_positions_bytes(self, numel: int) -> int:
        """The length its positions must have for a tensor of ``numel`` elements, in bytes."""
        if self.positions is Positions.INDICES:
            return 4 * self.changed
        if self.positions is Positions.GAPS:
            return self.changed
        if self.positions is Positions.GAPS16:
            return 2 * self.changed
        return bitmap_bytes(numel)


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's delta: its coding and its bytes as they lie in the bucket.

    Attributes:
        coding: what the entry holds.
        payload: a 1-D ``uint8`` CPU tensor of ``coding.nbytes(element_size)`` bytes.
        changed_elements: elements whose value changed (``coding.changed`` less the ``GAPS`` bridges).
    """

    coding: DeltaCoding
    payload: torch.Tensor
    changed_elements: int


def _align(n: int) -> int:
    return -(-n // POSITIONS_ALIGNMENT) * POSITIONS_ALIGNMENT


_WIDER = {
    torch.float32: (torch.bfloat16, torch.float16),
    torch.float64: (torch.bfloat16, torch.float16, torch.float32),
}


def holds_exactly(served: torch.dtype, wire: torch.dtype) -> bool:
    """Whether every value of dtype ``wire`` converts to ``served`` and back bit for bit (so an engine's served
    tensor, read back in the wire dtype, is what the trainer sent): the same dtype, or a wider float."""
    return served == wire or wire in _WIDER.get(served, ())


def bitmap_bytes(numel: int) -> int:
    """The bytes of a ``BITMAP`` over ``numel`` elements: ``ceil(numel / 8)``."""
    return -(-numel // 8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, any dtype) as a flat tensor of same-size integers, to compare bit patterns."""
    flat = t.reshape(-1)
    size = t.element_size()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat positions (``int64``, increasing) where ``new`` and ``base`` differ bit for bit.

    Bit patterns are compared, not values: ``-0.0`` differs from ``0.0`` and a NaN equals itself, so
    the base plus the delta is the new tensor exactly.

    Args:
        new, base: tensors of the same dtype and shape, contiguous, on the same device.

    Raises:
        ValueError: dtypes or shapes differ.
    """
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"cannot diff {new.dtype} {tuple(new.shape)} against {base.dtype} {tuple(base.shape)}")
    return _changes(new.contiguous().reshape(-1), base.contiguous().reshape(-1)).positions()


@dataclass(frozen=True)
class _Changes:
    """Where two flat tensors of ``numel`` elements differ: ``found`` is the positions (``int64``, increasing) when
    ``sparse``, else a boolean per element; ``k`` elements differ."""

    found: torch.Tensor
    sparse: bool
    k: int
    numel: int

    def positions(self) -> torch.Tensor:
        """The positions that differ (``int64``, increasing)."""
        return self.found if self.sparse else torch.nonzero(self.found).squeeze(1)

    def mask(self) -> torch.Tensor:
        """A boolean per element: whether it differs."""
        if not self.sparse:
            return self.found
        mask = torch.zeros(self.numel, dtype=torch.bool)
        mask[self.found] = True
        return mask


def _changes(flat: torch.Tensor, base: torch.Tensor) -> _Changes:
    """Where the flat, contiguous, same-dtype ``flat`` and ``base`` differ bit for bit: found word by word while
    few 8-byte words changed (:data:`SPARSE_WORDS`), else element by element."""
    a, b = _bits(flat), _bits(base)
    lanes = 8 // flat.element_size()
    body = flat.numel() - flat.numel() % lanes
    if lanes > 1 and body:
        try:
            wa, wb = a[:body].view(torch.int64), b[:body].view(torch.int64)
        except RuntimeError:  # a view whose start is not 8-byte aligned: compared element by element
            wa = wb = torch.empty(0, dtype=torch.int64)
        words = wa != wb
        if wa.numel() and int(torch.count_nonzero(words)) <= SPARSE_WORDS * words.numel():
            changed = torch.nonzero(words).squeeze(1)
            # The lanes (elements) of each changed word whose bits differ, in memory order (take: a faster gather
            # than indexing).
            lane = (wa.take(changed) ^ wb.take(changed)).view(a.dtype) != 0
            at = torch.nonzero(lane).squeeze(1)  # lane i of changed word j at j * lanes + i (lanes: 2, 4 or 8)
            shift = lanes.bit_length() - 1
            idx = (changed.take(at >> shift) << shift) | (at & (lanes - 1))
            if body < flat.numel():
                idx = torch.cat([idx, torch.nonzero(a[body:] != b[body:]).squeeze(1) + body])
            return _Changes(idx, True, idx.numel(), flat.numel())
    mask = a != b
    return _Changes(mask, False, int(torch.count_nonzero(mask)), flat.numel())  # count_nonzero: faster than a sum


def _gap_steps(gaps: torch.Tensor, bridges: torch.Tensor, count: int, limit: int) -> torch.Tensor:
    """The steps of a gaps encoding whose steps hold at most ``limit``: ``gaps`` (between the changed positions,
    the first from -1) with ``bridges[i]`` steps of ``limit`` before gap ``i``'s rest, ``count`` steps in all."""
    counts = bridges + 1
    steps = torch.full((count,), limit, dtype=torch.int64)
    steps[torch.cumsum(counts, 0) - 1] = gaps - limit * bridges
    return steps


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat boolean ``mask`` as a ``BITMAP`` (element i in bit i % 8 of byte i / 8)."""
    bits = torch.zeros(bitmap_bytes(mask.numel()) * 8, dtype=torch.uint8)
    bits[: mask.numel()] = mask
    return (bits.view(-1, 8) << _BITS).sum(1, dtype=torch.uint8)


def delta_of(
    new: torch.Tensor, base: torch.Tensor, positions: Positions | None = None
) -> tuple[EncodedTensor | None, int]:
    """The delta of ``new`` against ``base`` (``None`` when ``new`` should travel whole) and the number of elements
    whose bits differ, counted once for both.

    The changed elements are found word by word while few changed (:data:`SPARSE_WORDS`), and counted first
    otherwise: a tensor that changed too densely for any encoding to save
    :data:`DENSE_SHARE` is answered without finding their positions, and one dense enough for the bitmap to be the
    smallest is encoded from the comparison's mask directly.

    Args:
        new: the tensor to send, in its wire dtype, on CPU.
        base: what the engine serves for it, in the same dtype and shape, on CPU.
        positions: the encoding to use; ``None``: the smallest (and ``None`` returned when that takes at least
            :data:`DENSE_SHARE` of the whole tensor's bytes).

    Returns:
        The entry (``payload`` as it lies in the bucket), or ``None``: send the tensor whole; and the changed
        elements' count.

    Raises:
        ValueError: dtypes or shapes differ; ``INDICES`` asked for a tensor of ``2**32`` elements or more.
    """
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"cannot diff {new.dtype} {tuple(new.shape)} against {base.dtype} {tuple(base.shape)}")
    flat = new.detach().contiguous().reshape(-1)
    changes = _changes(flat, base.detach().contiguous().reshape(-1))
    k = changes.k
    numel, esize = flat.numel(), flat.element_size()
    whole = numel * esize
    bitmap = bitmap_bytes(numel)
    if positions is None and _align(k * esize) + min(k, bitmap) >= DENSE_SHARE * whole:
        return None, k  # no encoding can be small enough: every one carries the k values and a byte per k or the bitmap
    if positions is Positions.BITMAP or (positions is None and k >= bitmap):
        # Every gaps or indices encoding takes at least k >= the bitmap's bytes: the bitmap is the smallest.
        coding = DeltaCoding(Positions.BITMAP, k, bitmap)
        payload = torch.empty(coding.nbytes(esize), dtype=torch.uint8)
        vbytes = coding.values_bytes(esize)
        payload[:vbytes] = flat[changes.found].view(torch.uint8)  # by positions or by mask: the same order
        payload[vbytes : _align(vbytes)] = 0
        payload[_align(vbytes) :] = _pack_bits(changes.mask())
        return EncodedTensor(coding, payload, k), k
    idx = changes.positions()
    gaps = torch.diff(idx, prepend=_BEFORE_FIRST) if k else idx  # between changed positions, the first from -1
    # The bridging entries of each gaps encoding, over the few gaps past GAP_LIMIT only (gaps are >= 1).
    long_at = torch.nonzero(gaps > GAP_LIMIT).squeeze(1) if k else gaps
    long_gaps = gaps.take(long_at)
    long_bridges = {p: torch.div(long_gaps - 1, limit, rounding_mode="floor") for p, limit in _GAP_LIMITS.items()}
    counts = {p: k + int(b.sum()) for p, b in long_bridges.items()}
    entry_counts = {Positions.INDICES: k, **counts, Positions.BITMAP: k}
    sizes: dict[Positions, float] = {
        Positions.INDICES: 4 * k if numel < _INDEX_LIMIT else math.inf,
        **{p: n * _GAP_BYTES[p] for p, n in counts.items()},
        Positions.BITMAP: bitmap,
    }
    chosen: Positions = (
        positions if positions is not None else min(sizes, key=lambda p: _align(entry_counts[p] * esize) + sizes[p])
    )
    if sizes[chosen] == math.inf:
        raise ValueError(f"INDICES hold fewer than 2**32 elements; the tensor has {numel}")
    n = entry_counts[chosen]
    coding = DeltaCoding(chosen, n, int(sizes[chosen]))
    total = coding.nbytes(esize)
    if positions is None and total >= DENSE_SHARE * whole:
        return None, k
    payload = torch.empty(total, dtype=torch.uint8)
    vbytes = coding.values_bytes(esize)
    payload[vbytes : _align(vbytes)] = 0
    pos = payload[_align(vbytes) :]
    if chosen in _GAP_LIMITS and k:
        if n == k:  # no gap past the limit: the steps are the gaps
            steps, entries = gaps, idx
        else:  # bridges: entries at unchanged positions too
            bridges = torch.zeros_like(gaps)
            bridges[long_at] = long_bridges[chosen]
            steps = _gap_steps(gaps, bridges, n, _GAP_LIMITS[chosen])
            entries = torch.cumsum(steps, 0) - 1
        pos.copy_(steps.to(torch.int16 if chosen is Positions.GAPS16 else torch.uint8).view(torch.uint8))
    elif chosen is Positions.BITMAP:
        entries = idx
        pos.copy_(_pack_bits(changes.mask()))
    else:
        entries = idx
        if k:
            pos.copy_(entries.to(torch.int32).view(torch.uint8))
    if vbytes:
        payload[:vbytes] = flat.take(entries).view(torch.uint8)
    return EncodedTensor(coding, payload, k), k


def encode(new: torch.Tensor, base: torch.Tensor, positions: Positions | None = None) -> EncodedTensor | None:
    """The delta of ``new`` against ``base``, or ``None`` when ``new`` should travel whole (see :func:`delta_of`).

    Raises:
        ValueError: as :func:`delta_of`.
    """
    return delta_of(new, base, positions)[0]


def _corrupt(name: str, why: str) -> InvalidArgument:
    return InvalidArgument("DELTA_CORRUPT", f"the delta of tensor {name!r} is corrupt: {why}", tensor=name)


def decode_positions(coding: DeltaCoding, raw: torch.Tensor, numel: int, name: str = "") -> torch.Tensor:
    """The flat positions (``int64``, increasing, below ``numel``) an entry's position bytes ``raw`` say.

    Raises:
        InvalidArgument: DELTA_CORRUPT: positions out of order or out of range, a zero gap, a bitmap whose set
            bits are not ``coding.changed`` or that sets bits past ``numel``.
    """
    k = coding.changed
    if raw.numel() != coding.positions_bytes or coding.positions_bytes != coding.expected_positions_bytes(numel):
        raise _corrupt(
            name,
            f"{raw.numel()} bytes of positions, {coding.positions_bytes} declared, "
            f"{coding.expected_positions_bytes(numel)} for {k} {coding.positions.name} entries",
        )
    if coding.positions is Positions.BITMAP:
        bits = ((raw.reshape(-1, 1) >> _BITS) & 1).reshape(-1)
        if bool(bits[numel:].any()):
            raise _corrupt(name, "the bitmap sets bits past the tensor's end")
        pos = torch.nonzero(bits[:numel]).squeeze(1)
        if pos.numel() != k:
            raise _corrupt(name, f"the bitmap sets {pos.numel()} bits, {k} values declared")
        return pos
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if coding.positions is Positions.INDICES:
        pos = raw.clone().view(torch.int32).to(torch.int64) % _INDEX_LIMIT
        if bool((torch.diff(pos) <= 0).any()):
            raise _corrupt(name, "the indices are not strictly increasing")
    else:
        if coding.positions is Positions.GAPS16:
            gaps = raw.clone().view(torch.int16).to(torch.int64) % 65536
        else:
            gaps = raw.to(torch.int64)
        if bool((gaps == 0).any()):
            raise _corrupt(name, "a gap is 0")
        pos = torch.cumsum(gaps, 0) - 1
    if int(pos[-1]) >= numel:
        raise _corrupt(name, f"position {int(pos[-1])} is past the tensor's {numel} elements")
    return pos


def apply_delta(
    entry: torch.Tensor, coding: DeltaCoding, base: torch.Tensor, name: str = "", out: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole tensor a delta entry stands for: ``base`` with the entry's values written at its positions.

    ``base`` is never written (a staged update keeps serving it) unless it is ``out``.

    Args:
        entry: the entry's bytes as they lie in the bucket (1-D ``uint8``, ``coding.nbytes`` of them).
        coding: what the entry holds.
        base: the served tensor in the wire dtype and shape (any device).
        name: the tensor's name, for errors.
        out: where to write the result (same dtype and shape as ``base``, contiguous); ``None``: a new tensor.

    Returns:
        The whole tensor, contiguous, in ``base``'s dtype, shape and device.

    Raises:
        InvalidArgument: DELTA_CORRUPT (see :func:`decode_positions`); the entry's length is not the coding's.
        ValueError: ``out`` is not contiguous.
    """
    if out is not None and not out.is_contiguous():
        raise ValueError("apply_delta writes into a contiguous out only")
    esize = base.element_size()
    if entry.numel() != coding.nbytes(esize):
        raise _corrupt(name, f"{entry.numel()} bytes, {coding.nbytes(esize)} declared")
    vbytes = coding.values_bytes(esize)
    raw_pos = entry[_align(vbytes) :].to("cpu")
    pos = decode_positions(coding, raw_pos, base.numel(), name)
    whole = base.detach().clone(memory_format=torch.contiguous_format) if out is None else out
    if out is not None and out is not base:
        out.copy_(base)
    if pos.numel():
        values = entry[:vbytes]
        if values.storage_offset() % esize:
            values = values.clone()
        flat = _bits(whole)
        flat[pos.to(whole.device)] = values.view(flat.dtype).to(whole.device)
    return whole
