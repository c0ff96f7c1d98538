"""How a sharded trainer's ranks move an update's bytes: every rank a member of the weight-sync group.

The trainer holds one group rank per trainer rank (``wsync.v1.InitRequest.trainer_ranks``), so the
group is one broadcast group per trainer rank (:mod:`wsync_grpc.group.process_group`). Trainer rank
0's :class:`~wsync_grpc.trainer.client.TrainerClient` forms it with a :class:`ShardedSender`, which
has the other ranks join beside it (the :data:`~wsync_grpc.trainer.sharded.rounds.JOIN` round) while
the engines' Init calls are in flight.

Per sync the job's :class:`~wsync_grpc.core.topology.SendTopology` (``kind``, the send mode the caller
chose) says how the bytes leave the ranks:

- ``"gather"``: rank 0 broadcasts every bucket whole; the ranks gather each bucket together first
  (:class:`~wsync_grpc.trainer.sharded.source.LockstepSource`, the
  :data:`~wsync_grpc.trainer.sharded.rounds.GATHER` round). Rank 0 hashes each bucket as it sends it,
  as a single trainer does.
- ``"direct"``: every rank broadcasts the buckets of its own pieces
  (:class:`~wsync_grpc.trainer.sharded.source.DirectSource`). Before Prepare, rank 0 leads the
  :data:`~wsync_grpc.trainer.sharded.rounds.DIGESTS` round (every rank hashes its own buckets, the
  ranks exchange the digests, which rank 0 declares in the bucket specs); then the
  :data:`~wsync_grpc.trainer.sharded.rounds.SEND` round (every rank sends its own buckets, while rank
  0 waits in the :data:`~wsync_grpc.trainer.sharded.rounds.SENT` round, in a helper thread, for every
  rank to report its sends done).

What each round does, on rank 0 and on the others, is in :mod:`wsync_grpc.trainer.sharded.rounds`.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

from wsync_grpc.core.digests import Digest
from wsync_grpc.trainer.sharded.ranks import TrainerRankLost, TrainerRanks
from wsync_grpc.trainer.sharded.rounds import AGAIN, DIGESTS, JOIN, SEND, SentWait
from wsync_grpc.transports.broadcast.sender import Broadcast, PackBuffers, SendJob

log = logging.getLogger(__name__)

__all__ = ["SEND_MODES", "SendMode", "ShardedSender"]

SendMode = Literal["gather", "direct"]
"""How a sharded trainer's bytes reach the engines: ``"gather"`` (per bucket, every rank gathers, rank 0
sends) or ``"direct"`` (every rank sends its own shards; nothing gathered)."""

SEND_MODES: tuple[str, ...] = ("gather", "direct")


class ShardedSender:
    """Trainer rank 0's :class:`~wsync_grpc.trainer.sender.Sender`: one group rank per trainer rank.

    Each update's job says how its bytes leave the ranks (``job.topology``: gathered for rank 0, or
    sent by every rank).

    Args:
        ranks: the trainer's ranks (this process is rank 0).
        buffers: rank 0's two pack buffers.
    """

    def __init__(self, ranks: TrainerRanks, buffers: PackBuffers) -> None:
        self._ranks = ranks
        self._buffers = buffers
        self._sent: SentWait | None = None

    @property
    def trainer_ranks(self) -> int:
        """See :meth:`Sender.trainer_ranks`: every trainer rank is a group rank."""
        return self._ranks.size

    @property
    def rank(self) -> int:
        """See :meth:`Sender.rank`: the trainer rank (0)."""
        return self._ranks.rank

    def forming(self, port: int, world_size: int) -> None:
        """See :meth:`Sender.forming`: the other ranks join now (the :data:`~wsync_grpc.trainer.sharded.rounds.JOIN`
        round).

        Raises:
            TrainerRankLost, TrainerRankFailed: the round failed.
        """
        JOIN.lead(self._ranks, port, world_size)

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """See :meth:`Sender.digests_before_send`. Gathered (``job.topology.kind == "gather"``): none (rank 0
        hashes what it sends). Direct: the :data:`~wsync_grpc.trainer.sharded.rounds.DIGESTS` round, every rank
        hashing its own buckets.

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not hash its buckets (it reported failure), or a rank failed
                its part of the previous command.
        """
        if job.topology.kind != "direct":
            return None
        return DIGESTS.lead(self._ranks, job)

    def send(self, job: SendJob) -> float:
        """See :meth:`Sender.send`. Gathered: rank 0 broadcasts every bucket, gathered in lockstep. Direct: the
        :data:`~wsync_grpc.trainer.sharded.rounds.SEND` round, this rank's buckets while the others send
        theirs (their digests went with Prepare: ``job.on_digest`` is not called).

        Raises:
            TrainerRankLost, TrainerRankFailed: another rank died or its sends failed (rank 0's own
                sends stop at once).
            ValueError: a single process's topology.
            Exception: as for :meth:`Sender.send`.
        """
        if job.topology.kind == "single" or job.topology.ranks != self.trainer_ranks:
            raise ValueError(f"a sharded trainer of {self.trainer_ranks} ranks cannot send {job.topology}")
        if job.topology.kind == "gather":
            return Broadcast.of(job, self.rank, materialises=True).run(job.layout, self._buffers)
        pack_s = SEND.lead(self._ranks, job, self._buffers, self._waiting)
        self.settle()
        return pack_s

    def _waiting(self, sent: SentWait) -> None:
        """Keep the :data:`~wsync_grpc.trainer.sharded.rounds.SENT` round running, for :meth:`settle`."""
        self._sent = sent

    def settle(self) -> None:
        """Wait for the ranks' sends of the last direct sync to end (before any other round).

        After a failed send it returns once the other ranks' sends ended too (the engines cancel
        the update, which fails them).

        Raises:
            TrainerRankLost, TrainerRankFailed: the round's failure, once.
        """
        sent, self._sent = self._sent, None
        if sent is None:
            return
        sent.join()
        if sent.error is not None:
            raise sent.error

    def repeating(self) -> None:
        """See :meth:`Sender.repeating`: once the last attempt's sends ended on every rank (their failure is
        the attempt's, logged), an :data:`~wsync_grpc.trainer.sharded.rounds.AGAIN` round: every rank forgets
        it and follows the next attempt.

        Raises:
            TrainerRankLost: a trainer rank is gone.
        """
        try:
            self.settle()
        except TrainerRankLost:
            raise
        except Exception as e:
            log.info("the last attempt's sends failed on another trainer rank too: %s", e)
        AGAIN.lead(self._ranks)

    def release(self) -> None:
        """See :meth:`Sender.release`."""
        self._buffers.release()
