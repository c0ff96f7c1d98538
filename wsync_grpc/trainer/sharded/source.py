"""The weight source of a sharded trainer: plain tensors and FSDP2 ``DTensor`` parameters, by global shape.

:class:`ShardedTensors` plans from each tensor's global shape and dtype (a ``DTensor``'s ``shape`` is
the unsharded one), so planning gathers nothing and every rank plans the same buckets. Its bytes come
one bucket at a time: ``full_tensor()`` of the bucket's ``DTensor`` s (an all-gather over the
parameter's device mesh, so every rank must ask for the same bucket at the same time) and the plain
tensors as they are. :class:`LockstepSource` is what trainer rank 0 sends from: before each bucket's
gather it tells the other ranks (one :class:`~wsync_grpc.trainer.sharded.ranks.TrainerRanks` round),
which then gather the same bucket with it and drop it. That is vLLM's ``WeightSource`` way (metadata
by global shape; ``full_tensor()`` lazily, one group at a time, in lockstep on every rank; rank 0
sends), with the lockstep driven by rank 0 so that a failure on any rank stops every rank at the next
bucket instead of leaving one blocked in an all-gather.

Units: sizes in bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.planning import TensorMeta
from wsync_grpc.trainer.sharded.ranks import Command, TrainerRanks
from wsync_grpc.trainer.source import NamedTensors

__all__ = ["LockstepSource", "ShardedTensors", "full"]


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a ``DTensor``'s ``full_tensor()`` (collective over its mesh), a plain tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedTensors(NamedTensors):
    """A :class:`~wsync_grpc.trainer.source.WeightSource` over ``(name, tensor)`` pairs, some of them ``DTensor`` s.

    As :class:`~wsync_grpc.trainer.source.NamedTensors` (pairs read once, references kept, tied
    plain tensors sent once under their first name; FSDP2's ``named_parameters()`` already lists a
    tied parameter once), with a ``DTensor``'s global shape in the metadata and its
    ``full_tensor()`` in a bucket.

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. an FSDP2 model's ``named_parameters()``; the same
            names, dtypes and global shapes, in the same order, on every rank.
    """

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """See :meth:`WeightSource.bucket_tensors`: the bucket's tensors whole, ``DTensor`` s gathered.

        Collective when the bucket holds a ``DTensor``: every rank of its mesh must ask for the same
        bucket (:class:`LockstepSource` sees to it).

        Raises:
            KeyError: a slot the source does not hold.
        """
        return {name: full(t) for name, t in super().bucket_tensors(bucket).items()}


class LockstepSource:
    """Trainer rank 0's source in the gather mode: every bucket gathered on every rank at once.

    Before gathering bucket k it leads a :data:`~wsync_grpc.trainer.sharded.ranks.Command.GATHER`
    round, in which the other ranks (in
    :meth:`ShardedTrainerClient._follow <wsync_grpc.trainer.sharded.client.ShardedTrainerClient>`)
    learn to gather bucket k too and report whether their last gather failed.

    Args:
        source: this rank's tensors.
        ranks: the trainer's ranks (this one is rank 0).
    """

    def __init__(self, source: ShardedTensors, ranks: TrainerRanks) -> None:
        self._source = source
        self._ranks = ranks

    def metadata(self) -> Sequence[TensorMeta]:
        """See :meth:`WeightSource.metadata`."""
        return self._source.metadata()

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """Tell the other ranks to gather ``bucket``, then gather it here too.

        Raises:
            TrainerRankFailed: a rank's last gather failed.
            TrainerRankLost: a rank is gone.
        """
        self._ranks.lead(Command.GATHER, bucket.index)
        try:
            return self._source.bucket_tensors(bucket)
        except RuntimeError as e:  # the all-gather broke: a rank gone mid-gather is named
            raise self._ranks.broken(f"gathering bucket {bucket.index}", e) from e
