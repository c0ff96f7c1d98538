"""Sharded trainers (FSDP2, ZeRO-3): every rank calls :class:`ShardedTrainerClient` collectively.

:mod:`.ranks` keeps the trainer's ranks in lockstep over a control group of their own,
:mod:`.rounds` declares each round of their protocol once (rank 0's half beside the others' half),
:mod:`.follower` is what a rank other than 0 keeps, :mod:`.source` plans from global shapes and
gathers per bucket, :mod:`.sender` is rank 0's sender, :mod:`.outcome` carries rank 0's result to the
other ranks as JSON, :mod:`.client` is the facade.
"""

from wsync_grpc.trainer.sharded.client import SendMode, ShardedTrainerClient
from wsync_grpc.trainer.sharded.ranks import RanksDisagree, TrainerRankFailed, TrainerRankLost, TrainerRanks
from wsync_grpc.trainer.sharded.source import ShardedTensors

__all__ = [
    "RanksDisagree",
    "SendMode",
    "ShardedTensors",
    "ShardedTrainerClient",
    "TrainerRankFailed",
    "TrainerRankLost",
    "TrainerRanks",
]
