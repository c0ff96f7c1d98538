"""Which trainer ranks send an update's bytes: the send topology, one value per update.

A trainer is one process (:meth:`SendTopology.single`), or ``M`` ranks of a sharded trainer that
either gather each bucket and send it from rank 0 (:meth:`SendTopology.gather`) or each send the
buckets of their own shards (:meth:`SendTopology.direct`). The topology is the trainer's: it travels
in the trainer's update request, not on the wire (engines see only each bucket's sending rank,
``BucketSpec.src_rank``). The parts that differ by topology (the bucket planner, the sender) read it
from there instead of from a mode set on them before each update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SendKind = Literal["single", "gather", "direct"]
"""How the bytes leave the trainer: one process; ``M`` ranks gathering each bucket for rank 0 to send;
``M`` ranks each sending its own shards."""


@dataclass(frozen=True)
class SendTopology:
    """Which trainer ranks send which bytes of one update.

    Attributes:
        kind: see :data:`SendKind`.
        ranks: the trainer's ranks in the weight-sync group (``0 .. ranks - 1``; engines' workers follow).
    """

    kind: SendKind = "single"
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1 or (self.kind == "single" and self.ranks != 1):
            raise ValueError(f"a {self.kind!r} send topology cannot have {self.ranks} trainer ranks")

    @classmethod
    def single(cls) -> SendTopology:
        """One trainer process, group rank 0, sending every bucket whole."""
        return cls()

    @classmethod
    def gather(cls, ranks: int) -> SendTopology:
        """``ranks`` trainer ranks gathering each bucket; rank 0 sends it whole (and hashes it as it sends)."""
        return cls("gather", ranks)

    @classmethod
    def direct(cls, ranks: int) -> SendTopology:
        """``ranks`` trainer ranks each sending the buckets of its own shards (nothing gathered); the ranks hash
        their own buckets before Prepare."""
        return cls("direct", ranks)

    @property
    def by_pieces(self) -> bool:
        """Whether the buckets are planned from every rank's pieces (each bucket sent by the rank that holds
        it: :func:`~wsync_grpc.core.planning.plan_pieces`) rather than from whole tensors."""
        return self.kind == "direct"


ONE_PROCESS = SendTopology()
"""The topology of a trainer that is one process (the default of every update)."""
