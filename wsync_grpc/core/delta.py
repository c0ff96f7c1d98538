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

No I/O; sizes in bytes. The passes over a tensor's elements run in NumPy on the tensor's memory (no copy): a
delta is diffed and applied on a lane (:mod:`wsync_grpc.core.lanes`), one thread per tensor, where NumPy's
single-threaded operations cost less per call than torch's. Decoding checks everything a caller could get wrong
(positions out of range or out of order, a bitmap with the wrong count), so a corrupt entry
raises :class:`~wsync_grpc.core.errors.InvalidArgument` instead of writing anywhere.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
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

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size, to view any tensor's elements as bit patterns."""

_NO_MASK = np.empty(0, dtype=np.bool_)

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)

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


def _bits(t: torch.Tensor) -> np.ndarray:
    """``t`` (contiguous, any dtype, on the CPU) as a flat NumPy array of same-size integers sharing its memory,
    to compare and move bit patterns (NumPy: these passes run on one thread, a lane's, where torch's per-call
    overhead is most of a small tensor's time)."""
    flat = t.detach().reshape(-1)
    return flat.view(_INTS[flat.element_size()]).numpy()


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat positions (``int64``, increasing) where ``new`` and ``base`` differ bit for bit.

    Bit patterns are compared, not values: ``-0.0`` differs from ``0.0`` and a NaN equals itself, so
    the base plus the delta is the new tensor exactly.

    Args:
        new, base: tensors of the same dtype and shape, on the CPU.

    Raises:
        ValueError: dtypes or shapes differ.
    """
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"cannot diff {new.dtype} {tuple(new.shape)} against {base.dtype} {tuple(base.shape)}")
    idx, mask = _changes(_bits(new.contiguous()), _bits(base.contiguous()))
    return torch.from_numpy(idx if idx is not None else np.flatnonzero(mask))


def _changes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Where the flat, same-dtype integer arrays ``a`` and ``b`` differ: ``(positions, empty)`` (``int64``,
    increasing) when found word by word, while few 8-byte words changed (:data:`SPARSE_WORDS`); ``(None, mask)``
    (a boolean per element) otherwise."""
    lanes = 8 // a.itemsize
    body = a.size - a.size % lanes
    if lanes > 1 and body:
        wa, wb = a[:body].view(np.int64), b[:body].view(np.int64)
        words = wa != wb
        # Counted first (a fraction of listing them): a dense tensor's list of words would be as large as it is.
        if np.count_nonzero(words) <= SPARSE_WORDS * wa.size:
            changed = np.flatnonzero(words)
            # The lanes (elements) of each changed word whose bits differ, in memory order.
            lane = (wa.take(changed) ^ wb.take(changed)).view(a.dtype) != 0
            at = np.flatnonzero(lane)  # lane i of changed word j at j * lanes + i (lanes: 2, 4 or 8)
            shift = lanes.bit_length() - 1
            idx = (changed.take(at >> shift) << shift) | (at & (lanes - 1))
            if body < a.size:
                idx = np.concatenate([idx, np.flatnonzero(a[body:] != b[body:]) + body])
            return idx, _NO_MASK
    return None, a != b


def _mask_of(idx: np.ndarray, numel: int) -> np.ndarray:
    mask = np.zeros(numel, dtype=np.bool_)
    mask[idx] = True
    return mask


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """A flat boolean ``mask`` as a ``BITMAP`` (element i in bit i % 8 of byte i / 8)."""
    return np.packbits(mask, bitorder="little")


def delta_of(
    new: torch.Tensor, base: torch.Tensor, positions: Positions | None = None
) -> tuple[EncodedTensor | None, int]:
    """The delta of ``new`` against ``base`` (``None`` when ``new`` should travel whole) and the number of elements
    whose bits differ, counted once for both.

    The changed elements are found word by word while few changed (:data:`SPARSE_WORDS`), and element by element
    otherwise: a tensor that changed too densely for any encoding to save :data:`DENSE_SHARE` is answered
    without listing their positions, and one dense enough for the bitmap to be the smallest is encoded from the
    comparison's mask directly.

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
    flat = _bits(new.contiguous())
    idx, mask = _changes(flat, _bits(base.contiguous()))
    k = idx.size if idx is not None else int(np.count_nonzero(mask))
    numel, esize = flat.size, flat.itemsize
    whole = numel * esize
    bitmap = bitmap_bytes(numel)
    if positions is None and _align(k * esize) + min(k, bitmap) >= DENSE_SHARE * whole:
        return None, k  # no encoding can be small enough: every one carries the k values and a byte per k or the bitmap
    if positions is Positions.BITMAP or (positions is None and k >= bitmap):
        # Every gaps or indices encoding takes at least k >= the bitmap's bytes: the bitmap is the smallest.
        coding = DeltaCoding(Positions.BITMAP, k, bitmap)
        payload = np.empty(coding.nbytes(esize), dtype=np.uint8)
        vbytes = coding.values_bytes(esize)
        mask = _mask_of(idx, numel) if idx is not None else mask
        payload[:vbytes] = flat[mask].view(np.uint8)
        payload[vbytes : _align(vbytes)] = 0
        payload[_align(vbytes) :] = _pack_bits(mask)
        return EncodedTensor(coding, torch.from_numpy(payload), k), k
    idx = idx if idx is not None else np.flatnonzero(mask)
    gaps = np.diff(idx, prepend=-1)  # between changed positions, the first from -1
    # The bridging entries of each gaps encoding, over the few gaps past GAP_LIMIT only (gaps are >= 1).
    long_at = np.flatnonzero(gaps > GAP_LIMIT)
    long_gaps = gaps.take(long_at)
    long_bridges = {p: (long_gaps - 1) // limit for p, limit in _GAP_LIMITS.items()}
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
    payload = np.empty(total, dtype=np.uint8)
    vbytes = coding.values_bytes(esize)
    payload[vbytes : _align(vbytes)] = 0
    pos = payload[_align(vbytes) :]
    entries = idx
    if chosen in _GAP_LIMITS and k:
        limit = _GAP_LIMITS[chosen]
        steps = gaps
        if n > k:  # bridges: entries at unchanged positions too, each a step of the limit before its gap's rest
            bridges = np.zeros_like(gaps)
            bridges[long_at] = long_bridges[chosen]
            steps = np.full(n, limit, dtype=np.int64)
            steps[np.cumsum(bridges + 1) - 1] = gaps - limit * bridges
            entries = np.cumsum(steps) - 1
        pos[:] = steps.astype(np.uint16 if chosen is Positions.GAPS16 else np.uint8).view(np.uint8)
    elif chosen is Positions.BITMAP:
        pos[:] = _pack_bits(_mask_of(idx, numel))
    elif k:
        pos[:] = idx.astype(np.uint32).view(np.uint8)
    if vbytes:
        payload[:vbytes] = flat.take(entries).view(np.uint8)
    return EncodedTensor(coding, torch.from_numpy(payload), k), k


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

    Args:
        raw: the position bytes (1-D ``uint8``, on the CPU).

    Raises:
        InvalidArgument: DELTA_CORRUPT: positions out of order or out of range, a zero gap, a bitmap whose set
            bits are not ``coding.changed`` or that sets bits past ``numel``.
    """
    return torch.from_numpy(_positions(coding, raw.numpy(), numel, name))


def _positions(coding: DeltaCoding, raw: np.ndarray, numel: int, name: str) -> np.ndarray:
    """:func:`decode_positions` on a NumPy array of the position bytes."""
    k = coding.changed
    if raw.size != coding.positions_bytes or coding.positions_bytes != coding.expected_positions_bytes(numel):
        raise _corrupt(
            name,
            f"{raw.size} bytes of positions, {coding.positions_bytes} declared, "
            f"{coding.expected_positions_bytes(numel)} for {k} {coding.positions.name} entries",
        )
    if coding.positions is Positions.BITMAP:
        # torch here: its parallel passes decode a dense bitmap faster than NumPy's one thread.
        bits = ((torch.from_numpy(raw).reshape(-1, 1) >> _BIT_SHIFTS) & 1).reshape(-1)
        if bool(bits[numel:].any()):
            raise _corrupt(name, "the bitmap sets bits past the tensor's end")
        found = torch.nonzero(bits[:numel]).squeeze(1)
        if found.numel() != k:
            raise _corrupt(name, f"the bitmap sets {found.numel()} bits, {k} values declared")
        return found.numpy()
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if coding.positions is Positions.INDICES:
        pos = raw.view(np.uint32).astype(np.int64)
        if bool((np.diff(pos) <= 0).any()):
            raise _corrupt(name, "the indices are not strictly increasing")
    else:
        gaps = raw.view(np.uint16) if coding.positions is Positions.GAPS16 else raw
        if not gaps.all():
            raise _corrupt(name, "a gap is 0")
        pos = np.cumsum(gaps, dtype=np.int64) - 1
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
    raw = entry[_align(vbytes) :].to("cpu")  # no copy on a CPU engine
    pos = _positions(coding, raw.numpy(), base.numel(), name)
    whole = base.detach().clone(memory_format=torch.contiguous_format) if out is None else out
    if out is not None and out is not base:
        out.copy_(base)
    if not pos.size:
        return whole
    if whole.device.type == "cpu" and entry.device.type == "cpu":
        flat = _bits(whole)
        flat[pos] = entry[:vbytes].numpy().view(flat.dtype)
    else:
        values = entry[:vbytes]
        if values.storage_offset() % esize:
            values = values.clone()
        bits = whole.detach().reshape(-1).view(_INTS[esize])
        bits[torch.from_numpy(pos).to(whole.device)] = values.view(bits.dtype).to(whole.device)
    return whole
