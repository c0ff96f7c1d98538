"""A sharded trainer's rank 0 diffs the gathered buckets in the gather mode
(:meth:`~wsync_grpc.trainer.sharded.source.LockstepSource.whole_tensors`): one ``GATHER`` round per planned
bucket, in the order the other ranks planned them, each gathered tensor dropped before the next bucket is gathered,
and the payload the same as a single process's. Real FSDP2 ranks: ``tests/integration/test_sharded_trainer.py``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.planning import plan_metadata
from wsync_grpc.trainer.delta import DeltaTracker
from wsync_grpc.trainer.sharded.ranks import Command
from wsync_grpc.trainer.sharded.source import LockstepSource, ShardedTensors
from wsync_grpc.trainer.source import NamedTensors, WholeTensors


class Ranks:
    """Rank 0 of a trainer whose other ranks do their part of every round (the commands are recorded)."""

    rank = 0

    def __init__(self) -> None:
        self.led: list[tuple[Command, int]] = []

    def lead(self, command: Command, arg: int = 0, arg2: int = 0) -> None:
        self.led.append((command, arg))


class Gathered(ShardedTensors):
    """Tensors each bucket materialises afresh (as ``full_tensor()`` does), every copy watched."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__(pairs)
        self.made: list[weakref.ref[torch.Tensor]] = []
        self.alive_at_gather: list[int] = []

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        self.alive_at_gather.append(sum(r() is not None for r in self.made))
        out = {s.name: self.tensor(s.name).clone() for s in bucket.tensors}
        self.made += [weakref.ref(t) for t in out.values()]
        return out


def test_rank_0_diffs_the_buckets_every_rank_gathers_one_bucket_at_a_time() -> None:
    g = torch.Generator().manual_seed(0)
    weights = [(f"layer{i}.weight", torch.randn(64, 64, generator=g)) for i in range(6)]
    source = Gathered(weights)
    buckets = plan_metadata(source.metadata(), 2 * 64 * 64 * 2, dtype=torch.bfloat16)  # two tensors a bucket
    ranks = Ranks()
    lockstep = LockstepSource(source, ranks, lambda: buckets)  # type: ignore[arg-type]
    assert isinstance(lockstep, WholeTensors)

    tracker, single = DeltaTracker(), DeltaTracker()
    first = tracker.encode(lockstep, torch.bfloat16)
    assert ranks.led == [(Command.GATHER, b.index) for b in buckets] and len(buckets) == 3
    assert source.alive_at_gather == [0, 0, 0]  # the last bucket's gathered tensors went before the next gather
    expected = single.encode(NamedTensors(weights), torch.bfloat16)
    assert {n: w.tolist() for n, w in first.wires.items()} == {n: w.tolist() for n, w in expected.wires.items()}
    assert first.summary is not None and first.summary.tensors == 6 and not first.is_delta

    tracker.applied("v1", first, {})
    with torch.no_grad():
        weights[2][1][0, :3] += 1.0  # three elements of one tensor change
    second = tracker.encode(lockstep, torch.bfloat16)
    assert second.is_delta
    assert {n: e.coding.changed for n, e in second.entries.items()} == {
        n: 3 if n == "layer2.weight" else 0 for n, _ in weights
    }
    assert second.summary is not None and second.summary.changed_elements == 3
