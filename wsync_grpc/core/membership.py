"""The weight-sync group an engine's workers join: Init's validated parameters, as plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupParams:
    """The weight-sync group an engine joins, from a validated ``wsync.v1.InitRequest``.

    Two Init calls with equal parameters are the same join (Init is idempotent).

    Attributes:
        master_address: host of the trainer's rendezvous store.
        master_port: its TCP port, 1..65535.
        rank_offset: the group rank of the engine's worker 0 (at least ``trainer_ranks``: the
            trainer's ranks come first).
        world_size: ranks in the group, trainer included.
        group_name: the group's name (its store prefix).
        backend: ``"gloo"`` or ``"nccl"``, resolved for the workers' devices.
        timeout_s: join deadline and per-collective timeout, in seconds.
        trainer_ranks: how many group ranks the trainer holds, each sending its own buckets
            (``wsync.v1.InitRequest.trainer_ranks``); 1 for a single-sender trainer.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    trainer_ranks: int = 1
