"""A received delta bucket made whole: each delta entry applied to a copy of the tensor the engine serves.

The base of a delta is what the engine serves (checked at Prepare: ``wsync.v1.PrepareHeader.base_weight_identity``),
read through the receive site's :class:`~wsync_grpc.core.engine.WeightTarget` (``get_weight``) and converted to
the wire dtype: weights that a whole update of that dtype wrote convert back bit for bit. The result is a new
tensor per delta entry, so a staged update leaves the served weights untouched until Complete, and the rest of
the receive path (digests, staging, loading) sees whole tensors, as from a whole update. A target whose base is
a copy of its own that it gives up (``base_writable``: a vLLM worker's kept copy, which the update replaces) has
the entries applied into that copy instead, saving a copy of every changed tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from wsync_grpc.core.delta import apply_delta
from wsync_grpc.core.digests import BucketHasher
from wsync_grpc.core.engine import WeightTarget
from wsync_grpc.core.errors import FailedPrecondition
from wsync_grpc.core.lanes import lanes
from wsync_grpc.core.layout import Bucket, TensorSlot
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.pieces import PieceAssembler
from wsync_grpc.worker.swaps import SwapIn


def _served(target: WeightTarget, t: TensorSlot) -> torch.Tensor:
    """The served tensor ``t`` stands for.

    Raises:
        FailedPrecondition: DELTA_BASE_UNREADABLE, the engine does not expose it here.
    """
    try:
        w = target.get_weight(t.canonical)
    except KeyError as e:
        raise FailedPrecondition(
            "DELTA_BASE_UNREADABLE",
            f"this engine's workers cannot read the served tensor {t.canonical!r} to apply a delta to",
            tensor=t.name,
        ) from e
    return w.detach() if w.requires_grad else w  # the tensor itself where it can be: a kept copy knows it again


def expand(
    flat: torch.Tensor,
    bucket: Bucket,
    target: WeightTarget,
    buffer_for: Callable[[TensorSlot], torch.Tensor | None] | None = None,
    hasher: BucketHasher | None = None,
) -> list[tuple[TensorSlot, torch.Tensor]]:
    """Every tensor of ``bucket`` whole: a whole entry as a view of ``flat``, a delta entry applied to its base.

    Args:
        flat: the received bucket (1-D ``uint8``, ``bucket.size_bytes`` bytes).
        bucket: a bucket of a delta update (flattened layout).
        target: the served weights the deltas apply to.
        buffer_for: where to rebuild a delta entry's tensor: a 1-D ``uint8`` buffer of exactly the whole tensor's
            bytes (``numel * element_size``), or ``None`` for a new tensor; a receiver hands out the memory its
            pool got back from the last swap (:class:`~wsync_grpc.worker.swaps.SwapIn`), already touched, where a
            new tensor of hundreds of MB page-faults on every 4 KiB. ``None``: always a new tensor.
        hasher: the bucket's digest, when it is checked: every whole tensor is hashed in order as soon as it is
            made, while the lanes rebuild the ones after it (the bucket's digest: of its whole tensors' bytes, in
            order).

    Returns:
        ``(slot, tensor)`` for every slot, in order, tied aliases included; each tensor in the wire dtype and shape
        (a piece's: the piece, rebuilt from its place in the served tensor).

    Raises:
        InvalidArgument: DELTA_CORRUPT.
        FailedPrecondition: DELTA_BASE_UNREADABLE.
    """
    writable = bool(getattr(target, "base_writable", False))
    # Each delta entry rebuilt on a lane (wsync_grpc.core.lanes: a copy and a scatter that release the GIL), the
    # served tensors and the buffers taken here, in order; the results hashed here, in order, as each is ready.
    # A CUDA worker rebuilds on this thread, on its current stream.
    pool = lanes()[0] if flat.device.type == "cpu" else None
    made: list[tuple[TensorSlot, torch.Tensor | Future[torch.Tensor]]] = []
    try:
        for t in bucket.tensors:
            entry = flat[t.offset : t.end]
            if t.delta is None:
                made.append((t, entry.view(t.dtype).view(t.shape)))
                continue
            args = (entry, t, _served(target, t), None if writable or buffer_for is None else buffer_for(t), writable)
            made.append((t, pool.submit(_rebuilt, *args) if pool is not None else _rebuilt(*args)))
        out: list[tuple[TensorSlot, torch.Tensor]] = []
        for t, w in made:
            whole = w.result() if isinstance(w, Future) else w
            out.append((t, whole))
            if hasher is not None:
                hasher.update(whole)
        return out
    finally:
        wait([w for _, w in made if isinstance(w, Future)])  # a corrupt entry: the others end before it goes up


def _rebuilt(
    entry: torch.Tensor, t: TensorSlot, served: torch.Tensor, buf: torch.Tensor | None, writable: bool
) -> torch.Tensor:
    """The whole tensor delta entry ``t`` (its bytes ``entry``) stands for, from the tensor the engine serves for
    it (see :func:`expand`): rebuilt in ``buf`` when given."""
    assert t.delta is not None
    source = served if t.piece is None else served[t.piece.index(t.shape)]  # a piece: its place in the tensor
    if buf is not None:
        whole = buf.view(t.dtype).view(t.shape)
        whole.copy_(source)
        return apply_delta(entry, t.delta, whole, t.name, out=whole)
    base = source.to(dtype=t.dtype, memory_format=torch.contiguous_format)
    base = base if base.shape == t.shape else base.reshape(t.shape)
    # Written in place: a copy made just now, or a copy of its own the target gives up (a worker's kept base:
    # then the kept tensor itself is returned, which its keeper recognises as already kept).
    copied = base.untyped_storage().data_ptr() != served.untyped_storage().data_ptr()
    return apply_delta(entry, t.delta, base, t.name, out=base if copied or writable else None)


def staged(
    wholes: list[tuple[TensorSlot, torch.Tensor]], swap_in: SwapIn, pieces: PieceAssembler | None = None
) -> NamedTensors:
    """Staged apply: the ``(canonical name, tensor)`` pairs to keep for Complete of a delta bucket made whole, less
    the rebuilt tensors ``swap_in`` takes to serve as they are (fresh tensors of the served dtype and shape: no copy
    at Complete; :class:`~wsync_grpc.worker.swaps.SwapIn`); pieces go to ``pieces`` (see :func:`loaded`)."""
    out: NamedTensors = []
    for t, w in wholes:
        if not t.load or t.piece is not None:
            continue
        if t.delta is not None and swap_in.swappable(t):
            swap_in.add(t, w.reshape(-1).view(torch.uint8))
        else:
            out.append((t.canonical, w))
    return out + _assembled(wholes, pieces)


def loaded(wholes: list[tuple[TensorSlot, torch.Tensor]], pieces: PieceAssembler | None = None) -> NamedTensors:
    """The ``(canonical name, tensor)`` pairs to load of ``wholes`` (tied aliases already in the update left out);
    a piece is copied into its tensor in ``pieces`` (a sharded trainer's direct send), which is loaded once whole.

    Raises:
        ValueError: a piece, and no ``pieces`` to assemble it in.
    """
    return [(t.canonical, w) for t, w in wholes if t.load and t.piece is None] + _assembled(wholes, pieces)


def _assembled(wholes: list[tuple[TensorSlot, torch.Tensor]], pieces: PieceAssembler | None) -> NamedTensors:
    """The tensors that the pieces among ``wholes`` complete in ``pieces``."""
    out: NamedTensors = []
    for t, w in wholes:
        if t.piece is None or not t.load:
            continue
        if pieces is None:
            raise ValueError(f"a piece of {t.name!r} arrived where no tensor is assembled from pieces")
        whole = pieces.add(t, w)
        if whole is not None:
            out.append(whole)
    return out
