"""The weight source of a sharded trainer: plain tensors and FSDP2 ``DTensor`` parameters, by global shape.

:class:`ShardedTensors` plans from each tensor's global shape and dtype (a ``DTensor``'s ``shape`` is
the unsharded one), so planning gathers nothing and every rank plans the same buckets. Its bytes come
one bucket at a time: ``full_tensor()`` of the bucket's ``DTensor`` s (an all-gather over the
parameter's device mesh, so every rank must ask for the same bucket at the same time) and the plain
tensors as they are. :class:`LockstepSource` is what trainer rank 0 sends from: before each bucket's
gather it tells the other ranks (the :data:`~wsync_grpc.trainer.sharded.rounds.GATHER` round),
which then gather the same bucket with it and drop it. That is vLLM's ``WeightSource`` way (metadata
by global shape; ``full_tensor()`` lazily, one group at a time, in lockstep on every rank; rank 0
sends), with the lockstep driven by rank 0 so that a failure on any rank stops every rank at the next
bucket instead of leaving one blocked in an all-gather. With deltas on, rank 0 reads the same gathered
buckets before Prepare (:meth:`LockstepSource.whole_tensors`) to diff them against what it last sent.

:class:`DirectSource` is every rank's source in the direct mode: nothing is gathered; each rank's
pieces (a ``DTensor``'s local shard and where it sits, from
``torch.distributed.tensor``'s ``compute_local_shape_and_global_offset``) are exchanged once per
sync so that every rank plans the same buckets (:func:`~wsync_grpc.core.planning.plan_pieces`), and
each rank sends the buckets of its own pieces straight from its shards. That is vLLM's ``nccl_m2n``
way (trainer ranks send their local shards, no all-gather), on the weight-sync contract's
``TensorShard``.

Units: sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from wsync_grpc.core.delta import DeltaCoding, Positions
from wsync_grpc.core.layout import Bucket, Piece
from wsync_grpc.core.planning import PieceMeta, TensorMeta
from wsync_grpc.trainer.delta import DeltaPayload, DeltaTracker
from wsync_grpc.trainer.sharded.ranks import TrainerRanks
from wsync_grpc.trainer.sharded.rounds import GATHER
from wsync_grpc.trainer.source import NamedTensors

__all__ = ["DirectSource", "LockstepSource", "ShardedTensors", "full", "local"]


DIRECT_GATHER_BYTES = 4 << 20
"""A row-sharded ``DTensor`` of at least this many bytes is gathered rank by rank into the whole
tensor (see :func:`full`); smaller ones with ``full_tensor()`` (one collective)."""


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a ``DTensor`` gathered (collective over its mesh), a plain tensor itself.

    A large ``DTensor`` sharded by rows over a one-dimensional mesh (FSDP2's ``Shard(0)``) is
    gathered straight into the whole tensor, one broadcast of each rank's rows into their place:
    the whole tensor is the only memory it takes, where ``full_tensor()`` takes about twice the
    tensor on gloo (its all-gathers go through a buffer of their own). On a mesh of one rank the
    local tensor is the whole one.
    """
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    if mesh.ndim == 1 and mesh.size() == 1:
        return t.to_local()
    if (
        mesh.ndim != 1
        or tuple(t.placements) != (Shard(0),)
        or t.ndim == 0
        or t.numel() * t.dtype.itemsize < DIRECT_GATHER_BYTES
    ):
        return t.full_tensor()
    part = t.to_local()
    rows, size, me = t.shape[0], mesh.size(), mesh.get_local_rank()
    step = -(-rows // size)  # torch.chunk's split: ceil(rows / size) rows per rank, the last ranks fewer or none
    starts = [min(r * step, rows) for r in range(size + 1)]
    if part.shape[0] != starts[me + 1] - starts[me]:
        return t.full_tensor()
    whole = torch.empty(t.shape, dtype=part.dtype, device=part.device)
    whole[starts[me] : starts[me + 1]].copy_(part)
    group = mesh.get_group()
    for src in range(size):
        if starts[src + 1] > starts[src]:
            dist.broadcast(whole[starts[src] : starts[src + 1]], group=group, group_src=src)
    return whole


def local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of ``t`` and where it starts in the whole tensor (elements, per dimension).

    A ``DTensor``'s local shard (``to_local()``) at the offsets
    ``compute_local_shape_and_global_offset`` gives for this rank; a plain tensor whole, at 0.

    Raises:
        ValueError: a ``DTensor`` whose local shard is not one block of the whole tensor (e.g. a
            strided shard of FSDP2 over tensor parallelism), which the direct mode cannot place.
    """
    if not isinstance(t, DTensor):
        return t, tuple(0 for _ in t.shape)
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    part = t.to_local()
    if tuple(part.shape) != tuple(shape):
        raise ValueError(
            f"a DTensor with placements {t.placements} has a local shard of shape {list(part.shape)}, not the "
            f"block {list(shape)} at {list(offsets)}: the direct mode cannot place it (use mode='gather')"
        )
    return part, tuple(int(o) for o in offsets)


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

    holds_tensors = False
    """A ``DTensor`` is gathered whole for the caller (``full_tensor()``; :attr:`WholeTensors.holds_tensors`)."""

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """See :meth:`WeightSource.bucket_tensors`: the bucket's tensors whole, ``DTensor`` s gathered.

        Collective when the bucket holds a ``DTensor``: every rank of its mesh must ask for the same
        bucket (:class:`LockstepSource` sees to it).

        Raises:
            KeyError: a slot the source does not hold.
        """
        return {name: full(t) for name, t in super().bucket_tensors(bucket).items()}

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`WholeTensors.whole_tensors <wsync_grpc.trainer.source.WholeTensors.whole_tensors>`: every
        tensor whole, ``DTensor`` s gathered one by one (collective: every rank of their mesh reads them too, in
        the same order; a sharded trainer's rank 0 reads them through :class:`LockstepSource`).

        Raises:
            ValueError: a name appears twice.
        """
        for name, t in super().whole_tensors():
            yield name, full(t)


class DirectSource:
    """A rank's source in the direct mode: every rank's pieces to plan with, this rank's shards to send.

    Collective to build (every rank at once): each rank lists its pieces (:func:`local`) and the
    lists are exchanged over the trainer's control group. A piece held by several ranks (a
    replicated tensor, or a plain one) is sent by the lowest of them; a piece that is the whole
    tensor travels as a whole tensor.

    With deltas on (``deltas``: this rank's last update, :class:`~wsync_grpc.trainer.delta.DeltaTracker`), each
    rank also encodes its own pieces against its own copy of what it last sent and the ranks exchange the
    entries' codings with their pieces: :attr:`delta` is then this rank's payload, carrying every rank's codings
    when every rank holds a base of the same version (rank 0 plans every rank's buckets; whole otherwise).

    Args:
        source: this rank's tensors.
        ranks: the trainer's ranks.
        deltas: this rank's last update, to encode against; ``None``: deltas off.
        dtype: the wire dtype of floating tensors (with deltas); ``None`` keeps theirs.

    Attributes:
        delta: this rank's pieces in the wire dtype and its delta entries (see above); ``None`` with deltas off.

    Raises:
        ValueError: a shard the direct mode cannot place (:func:`local`), or pieces that do not
            cover a tensor exactly (raised on every rank alike).
        TrainerRankLost: the exchange failed.
    """

    def __init__(
        self,
        source: ShardedTensors,
        ranks: TrainerRanks,
        deltas: DeltaTracker | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        metas = source.metadata()
        self._parts: dict[str, torch.Tensor] = {}  # name -> this rank's part, to send from
        mine: list[list[object]] = []
        problem = ""
        try:
            for m in metas:
                part, offsets = local(source.tensor(m.name))
                self._parts[m.name] = part
                if part.numel():
                    mine.append([m.name, list(offsets), list(part.shape)])
        except ValueError as e:
            problem = str(e)
        self.delta: DeltaPayload | None = None
        share: dict[str, object] = {"pieces": mine, "problem": problem}
        if deltas is not None and not problem:
            self.delta = deltas.encode_tensors({n: p for n, p in self._parts.items() if p.numel()}, dtype, ranks.rank)
            share.update(_delta_share(self.delta))
        lists = [json.loads(p) for p in ranks.exchange(json.dumps(share).encode(), "exchanging the ranks' pieces")]
        problems = [f"trainer rank {r}: {p['problem']}" for r, p in enumerate(lists) if p["problem"]]
        if problems:
            raise ValueError("; ".join(problems))
        self._pieces = _pieces(metas, [p["pieces"] for p in lists])
        if self.delta is not None:
            self.delta = _with_ranks(self.delta, lists)

    def metadata(self) -> Sequence[PieceMeta]:
        """See :meth:`WeightSource.metadata`: every rank's pieces, each rank's in the tensors' order."""
        return self._pieces

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """See :meth:`WeightSource.bucket_tensors`: this rank's shards of ``bucket``'s slots (a bucket it sends).

        Raises:
            KeyError: a slot the source does not hold.
        """
        return {s.name: self._parts[s.name] for s in bucket.tensors}


def _delta_share(payload: DeltaPayload) -> dict[str, object]:
    """What a rank tells the others of its delta: its base version, its entries' codings, its counts."""
    s = payload.summary
    return {
        "base": payload.base_version,
        "codings": {
            n: [e.coding.positions.value, e.coding.changed, e.coding.positions_bytes]
            for n, e in payload.entries.items()
        },
        "counts": [s.changed_elements, s.total_elements, s.values_bytes, s.positions_bytes, s.delta_tensors]
        if s is not None
        else [0, 0, 0, 0, 0],
    }


def _with_ranks(payload: DeltaPayload, shares: Sequence[Mapping[str, Any]]) -> DeltaPayload:
    """This rank's payload with every rank's codings and counts, when every rank holds a base of the same version;
    whole otherwise (the same decision on every rank, from the same shares)."""
    bases = {str(s.get("base", "")) for s in shares}
    if len(bases) != 1 or "" in bases:
        return payload.whole
    codings = {
        r: {str(n): DeltaCoding(Positions(str(c[0])), int(c[1]), int(c[2])) for n, c in s["codings"].items()}
        for r, s in enumerate(shares)
    }
    counts = [sum(int(s["counts"][i]) for s in shares) for i in range(5)]
    summary = payload.summary
    if summary is not None:
        summary = dataclasses.replace(
            summary,
            changed_elements=counts[0],
            total_elements=counts[1],
            values_bytes=counts[2],
            positions_bytes=counts[3],
            delta_tensors=counts[4],
        )
    return dataclasses.replace(payload, rank_codings=codings, summary=summary)


def _pieces(metas: Sequence[TensorMeta], per_rank: Sequence[Sequence[Sequence[object]]]) -> list[PieceMeta]:
    """The pieces to send: every rank's, a piece held by several ranks sent by the lowest one.

    Raises:
        ValueError: the pieces of a tensor do not add up to its size.
    """
    by_name = {m.name: m for m in metas}
    seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    covered = dict.fromkeys(by_name, 0)
    out: list[PieceMeta] = []
    for rank, pieces in enumerate(per_rank):
        for name, offsets, shape in pieces:
            assert isinstance(name, str) and isinstance(offsets, list) and isinstance(shape, list)
            m = by_name[name]
            key = (name, tuple(int(o) for o in offsets), tuple(int(n) for n in shape))
            if key in seen:
                continue  # a replica: the lowest rank holding it sends it
            seen.add(key)
            covered[name] += math.prod(key[2])
            whole = key[2] == tuple(m.shape)
            out.append(PieceMeta(name, m.dtype, key[2], rank, None if whole else Piece(tuple(m.shape), key[1])))
    for name, n in covered.items():
        total = math.prod(by_name[name].shape)
        if n != total:
            raise ValueError(
                f"the trainer ranks' shards of {name!r} cover {n} of its {total} elements: the direct mode "
                "needs shards that tile each tensor (use mode='gather')"
            )
    return out


class LockstepSource:
    """Trainer rank 0's source in the gather mode: every bucket gathered on every rank at once.

    Before gathering bucket k it leads the :data:`~wsync_grpc.trainer.sharded.rounds.GATHER` round, in
    which the other ranks learn to gather bucket k too and report whether their last gather failed.

    With deltas on it is also what rank 0 diffs (a :class:`~wsync_grpc.trainer.source.WholeTensors`):
    :meth:`whole_tensors` gathers the update's buckets the same way before Prepare, so that rank 0 diffs the whole
    tensors against its copy of what it last sent as a single process does, and the update is then sent from
    that copy (nothing gathered while sending).

    Args:
        source: this rank's tensors.
        ranks: the trainer's ranks (this one is rank 0).
        plan: the update's buckets as every other rank plans them (whole, for the update's request:
            :meth:`Follower.call <wsync_grpc.trainer.sharded.follower.Follower.call>`), asked for by
            :meth:`whole_tensors` only; ``None``: no delta to diff.
    """

    holds_tensors = False
    """Each bucket is gathered for the caller (:attr:`~wsync_grpc.trainer.source.WholeTensors.holds_tensors`)."""

    def __init__(
        self, source: ShardedTensors, ranks: TrainerRanks, plan: Callable[[], Sequence[Bucket]] | None = None
    ) -> None:
        self._source = source
        self._ranks = ranks
        self._plan = plan

    def metadata(self) -> Sequence[TensorMeta]:
        """See :meth:`WeightSource.metadata`."""
        return self._source.metadata()

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """Tell the other ranks to gather ``bucket``, then gather it here too.

        Raises:
            TrainerRankFailed: a rank's last gather failed.
            TrainerRankLost: a rank is gone.
        """
        return GATHER.lead(self._ranks, self._source, bucket)

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`WholeTensors.whole_tensors <wsync_grpc.trainer.source.WholeTensors.whole_tensors>`: the
        planned buckets one after the other, each gathered with every rank as for a send (:meth:`bucket_tensors`),
        its tensors handed out one by one and dropped here as they go: at most one gathered bucket (the update's
        bucket size, or one tensor larger than that) is held at once.

        Raises:
            ValueError: no plan was given.
            TrainerRankFailed, TrainerRankLost: as :meth:`bucket_tensors`.
        """
        if self._plan is None:
            raise ValueError("a LockstepSource without the update's plan gives no whole tensors")
        for bucket in self._plan():
            gathered = dict(self.bucket_tensors(bucket))
            for slot in bucket.tensors:
                yield slot.name, gathered.pop(slot.name)
