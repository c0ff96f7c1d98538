"""Whole tensors from the pieces a sharded trainer's ranks send (``wsync.v1.TensorShard``), on an engine worker.

In a sharded trainer's direct send every trainer rank broadcasts its own shards; a tensor then
arrives as pieces, in buckets from several ranks (:attr:`~wsync_grpc.core.layout.TensorSlot.piece`).
The engine validated at Prepare that the pieces of each name tile the whole tensor exactly
(:mod:`wsync_grpc.core.validation`), so a worker copies each piece into its place as it arrives
and hands the whole tensor to the engine's loader once the last piece landed: the engine loads
whole tensors, as from any other trainer (a tensor-parallel engine then takes its own slice, its
loaders' usual work). A tensor in assembly costs its whole size until its last piece arrives;
the trainer sends the pieces of a tensor close together (one bucket per rank in turn), so in
streaming apply only a few tensors are ever open at once.
"""

from __future__ import annotations

import math

import torch

from wsync_grpc.core.layout import TensorSlot


class PieceAssembler:
    """One worker's tensors in assembly, by name.

    Args:
        device: where the whole tensors are assembled (the worker's device).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._open: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (whole tensor, elements still missing)

    @property
    def open_bytes(self) -> int:
        """Bytes held by the tensors still missing pieces."""
        return sum(t.numel() * t.element_size() for t, _left in self._open.values())

    def add(self, slot: TensorSlot, piece: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Copy ``piece`` (``slot.shape``, ``slot.dtype``) into its place; the whole tensor once complete.

        Args:
            slot: the piece's slot (its ``piece`` set).
            piece: the received bytes, viewed in the slot's dtype and shape (copied: the buffer may
                be reused at once).

        Returns:
            ``(canonical name, whole tensor)`` in the wire dtype once every piece of the name
            arrived, else ``None``.
        """
        assert slot.piece is not None, "a whole tensor needs no assembly"
        entry = self._open.get(slot.name)
        if entry is None:
            whole = torch.empty(slot.piece.global_shape, dtype=slot.dtype, device=self._device)
            entry = (whole, whole.numel())
        whole, left = entry
        whole[slot.piece.index(slot.shape)].copy_(piece)
        left -= math.prod(slot.shape)
        if left > 0:
            self._open[slot.name] = (whole, left)
            return None
        self._open.pop(slot.name, None)
        return slot.canonical, whole

    def clear(self) -> None:
        """Drop every tensor in assembly (the update ended or was abandoned)."""
        self._open.clear()
