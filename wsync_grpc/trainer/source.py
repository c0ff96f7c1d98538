"""Where the trainer's weights come from: a :class:`WeightSource` tells what to send, then gives it per bucket.

Planning needs only each tensor's name, dtype and global shape
(:meth:`WeightSource.metadata`), so nothing is gathered or copied to plan an
update; the bytes are asked for one bucket at a time while sending
(:meth:`WeightSource.bucket_tensors`), so a source may materialise them lazily
(an FSDP2 ``DTensor``'s ``full_tensor()``, a CPU-offloaded parameter's copy)
and hold no more than the buckets in flight. This is the shape of vLLM's
``weight_transfer`` ``WeightSource`` (metadata by global shape, lazy
iteration).

:class:`NamedTensors` is the source of the ``(name, tensor)`` pairs that
:meth:`~wsync_grpc.trainer.client.TrainerClient.sync` accepts
(``model.named_parameters()``, ``model.state_dict().items()``): one process
holding every tensor whole. A source that can give every tensor whole, one at a time
(:class:`WholeTensors`), is what a delta is diffed from (:mod:`wsync_grpc.trainer.delta`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.planning import PieceMeta, TensorMeta, unique_tensors

__all__ = ["NamedTensors", "TensorMeta", "WeightSource", "WholeTensors"]


@runtime_checkable
class WeightSource(Protocol):
    """The tensors of one update: their metadata to plan with, then their bytes bucket by bucket.

    Every trainer rank that takes part in an update holds a source over the same tensors and calls
    it in the same order: :meth:`metadata` once, then :meth:`bucket_tensors` once per bucket, in
    bucket order (a sharded source may gather collectively inside it).
    """

    def metadata(self) -> Sequence[TensorMeta] | Sequence[PieceMeta]:
        """The tensors to send, in order, each once (tied aliases kept under their first name).

        Shapes are global shapes (a sharded tensor's unsharded shape); dtypes are the tensors' own
        (the update's wire dtype is applied by planning). Reads no tensor's bytes. A source whose
        ranks each send their own shards gives every rank's pieces instead
        (:class:`~wsync_grpc.core.planning.PieceMeta`, planned by
        :func:`~wsync_grpc.core.planning.plan_pieces`).

        Raises:
            ValueError: a name appears twice.
        """
        ...

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """The whole tensors of ``bucket``'s slots (or, for a slot that is a piece, this rank's piece),
        by slot name, in their own dtype, on any device.

        Called while sending, once per bucket in index order; the mapping is dropped once the
        bucket is on the wire, so a source that materialises here holds at most the buckets in
        flight (the sender keeps up to two packed).

        Raises:
            KeyError: a slot the source does not hold.
        """
        ...


@runtime_checkable
class WholeTensors(WeightSource, Protocol):
    """A :class:`WeightSource` that can also give every tensor whole, in order, one at a time: what a delta is
    diffed from (:meth:`DeltaTracker.encode <wsync_grpc.trainer.delta.DeltaTracker.encode>`).

    :class:`NamedTensors` (one process holding its tensors); a sharded trainer's rank 0 in the gather mode
    (:class:`~wsync_grpc.trainer.sharded.source.LockstepSource`, every rank gathering with it).
    """

    holds_tensors: bool
    """Whether :meth:`whole_tensors` hands out tensors the source holds anyway (nothing materialised for the
    caller: it may read ahead without holding more memory); ``False``: each tensor is made for the caller."""

    def metadata(self) -> Sequence[TensorMeta]:
        """See :meth:`WeightSource.metadata` (whole tensors, never pieces)."""
        ...

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of :meth:`metadata`, whole, in its own dtype, on any device, as ``(name, tensor)``:
        each once, materialised lazily (a caller that drops each tensor before asking for the next holds at most
        what the source materialises at once: one tensor, or one gathered bucket).

        Raises:
            ValueError: a name appears twice.
        """
        ...


class NamedTensors:
    """The source of ``(name, tensor)`` pairs held whole by this process (:meth:`TrainerClient.sync`'s input).

    The pairs are read once, at the first :meth:`metadata` (so an iterator such as
    ``model.named_parameters()`` is consumed once, when the update plans); only references are
    kept, nothing is copied. Tied or duplicated tensors (same address, shape, stride and dtype:
    :func:`~wsync_grpc.core.planning.unique_tensors`) are sent once, under their first name.

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``.
    """

    holds_tensors = True
    """The tensors handed out are the pairs' own (:attr:`WholeTensors.holds_tensors`)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._pairs = named_tensors
        self._by_name: dict[str, torch.Tensor] | None = None
        self._metadata: list[TensorMeta] = []

    def metadata(self) -> Sequence[TensorMeta]:
        """See :meth:`WeightSource.metadata` (a tensor's own shape and dtype).

        Raises:
            ValueError: a name appears twice.
        """
        if self._by_name is None:
            unique = unique_tensors(self._pairs)
            self._by_name = {meta.name: t for meta, t in unique}
            self._metadata = [meta for meta, _t in unique]
        return self._metadata

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor named ``name``, as given (the pairs are read first if they were not yet).

        Raises:
            KeyError: no such name.
        """
        if self._by_name is None:
            self.metadata()
        assert self._by_name is not None
        return self._by_name[name]

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`WholeTensors.whole_tensors`: the tensors themselves, in :meth:`metadata` order.

        Raises:
            ValueError: a name appears twice.
        """
        for meta in self.metadata():
            yield meta.name, self.tensor(meta.name)

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """See :meth:`WeightSource.bucket_tensors`: the tensors themselves (nothing to materialise).

        Raises:
            KeyError: a slot the source does not hold.
        """
        return {s.name: self.tensor(s.name) for s in bucket.tensors}
