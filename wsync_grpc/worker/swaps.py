"""Staged apply by swapping storage: a lone tensor received into an exact-size buffer the engine then serves.

A receiver whose target can serve a buffer it is handed
(:class:`~wsync_grpc.core.engine.StorageSwap`) receives a bucket holding one whole tensor of the served
dtype, shape and device straight into a buffer of that size, and at Complete hands it over instead of
copying it: :class:`SwapIn` keeps those tensors and their buffers for one update, for every transport's
receiver.
"""

from __future__ import annotations

import math

import torch

from wsync_grpc.core.engine import InPlaceReceive, StorageSwap, WeightTarget
from wsync_grpc.core.layout import TensorSlot
from wsync_grpc.worker.buffers import BufferPool


class SwapIn:
    """One worker's tensors to swap in at Complete, for one update.

    Args:
        target: the weights the update is for; swaps only where it is a
            :class:`~wsync_grpc.core.engine.StorageSwap`.
        device: the worker's device (the received buffers').
        streaming: the update applies as it arrives (then nothing is swapped).

    Attributes:
        swaps: ``(canonical name, tensor)`` to serve at Complete, each a view of its own exact-size buffer.
        held: the buffers behind :attr:`swaps` (``uint8``, one per tensor).
    """

    def __init__(self, target: WeightTarget, device: torch.device, streaming: bool) -> None:
        self._target = target
        self._device = device
        self._swap = target if not streaming and isinstance(target, StorageSwap) else None
        self.swaps: list[tuple[str, torch.Tensor]] = []
        self.held: list[torch.Tensor] = []

    def swappable(self, t: TensorSlot | None) -> bool:
        """Whether the lone tensor ``t`` (``None``: the bucket holds several) can be received into a buffer the
        engine then serves: a whole tensor to load, of the served tensor's dtype, shape and device."""
        if self._swap is None or t is None or not t.load or t.piece is not None:
            return False
        served = self._target.get_weight(t.canonical)
        return served.dtype == t.dtype and tuple(served.shape) == t.shape and served.device == self._device

    def buffer_for(self, t: TensorSlot, pool: BufferPool) -> torch.Tensor | None:
        """Memory to rebuild the whole tensor of delta entry ``t`` in (:func:`~wsync_grpc.worker.delta.expand`),
        when that tensor will be swapped in: an exact-size buffer of ``pool`` (``uint8``, ``numel * element_size``
        bytes; after the first swap, memory the engine gave back, already touched); ``None`` otherwise."""
        if not self.swappable(t):
            return None
        return pool.take_exact(math.prod(t.shape) * t.dtype.itemsize)

    def add(self, t: TensorSlot, flat: torch.Tensor) -> None:
        """Serve ``flat`` (``uint8``, exactly ``t``'s bytes) as ``t`` at Complete."""
        self.swaps.append((t.canonical, flat.view(t.dtype).view(t.shape)))
        self.held.append(flat)

    def apply(self, worker: int, pool: BufferPool) -> int:
        """Hand :attr:`swaps` to the engine to serve; the memory it gives back goes to ``pool`` for the next
        update. The caller holds the engine's weights lock. Returns the tensors swapped."""
        if not self.swaps or self._swap is None:
            return 0
        swaps, self.swaps, self.held = self.swaps, [], []
        for old in self._swap.swap_weights(worker, swaps):
            pool.give(old, used=True)
        return len(swaps)

    def clear(self) -> list[torch.Tensor]:
        """Forget every swap (the update was abandoned, or applied); the buffers that were held."""
        held, self.swaps, self.held = self.held, [], []
        return held


def served_target(
    in_place: InPlaceReceive | None, worker: int, device: torch.device, t: TensorSlot
) -> torch.Tensor | None:
    """The served tensor to receive ``t`` straight into (:class:`~wsync_grpc.core.engine.InPlaceReceive`), or
    ``None``: copy as usual.

    Only on an engine that offers it (``in_place``; receivers pass it for streaming apply only), for a tensor to load
    whose served tensor is plain, contiguous, on ``device`` (the worker's) and of exactly the wire dtype and shape.
    """
    if in_place is None or not t.load or t.nbytes == 0 or t.piece is not None:
        return None
    target = in_place.receive_target(worker, t.canonical)
    if (
        target is None
        or type(target) not in (torch.Tensor, torch.nn.Parameter)
        or target.layout != torch.strided
        or target.dtype != t.dtype
        or tuple(target.shape) != t.shape
        or target.device != device
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
    ):
        return None
    return target.detach()
