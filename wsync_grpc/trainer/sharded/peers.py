"""How a sharded trainer's ranks move an update's bytes: every rank a member of the weight-sync group.

The trainer holds one group rank per trainer rank (``wsync.v1.InitRequest.trainer_ranks``), so the
group is one broadcast group per trainer rank (:mod:`wsync_grpc.group.process_group`). Trainer rank
0's :class:`~wsync_grpc.trainer.client.TrainerClient` forms it with :class:`ShardedPeers`, which
have the other ranks join beside it (the :data:`~wsync_grpc.trainer.sharded.rounds.JOIN` round) while
the engines' Init calls are in flight.

Per sync the job's :class:`~wsync_grpc.core.topology.SendTopology` (``kind``, the send mode the caller
chose) says how the bytes leave the ranks; the broadcast transport's sender
(:class:`~wsync_grpc.transports.broadcast.sender.BroadcastSender`) reads it and asks the peers for the
rounds:

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

Through shared memory (``TRANSPORT_SHARED_MEMORY``) no group is formed and :meth:`ShardedPeers.forming` is never
called. ``"gather"``: rank 0's :class:`~wsync_grpc.transports.shared_memory.sender.SharedMemorySender` packs each
bucket into its ring as ``job.tensors`` gathers it (the same :data:`~wsync_grpc.trainer.sharded.rounds.GATHER`
rounds). ``"direct"`` (:class:`~wsync_grpc.transports.shared_memory.sender.RankRings`): the same
:data:`~wsync_grpc.trainer.sharded.rounds.DIGESTS` round, then the
:data:`~wsync_grpc.trainer.sharded.rounds.RINGS` round (every rank opens a ring for its own buckets; rank 0 puts
the handles in the Prepare header), then the :data:`~wsync_grpc.trainer.sharded.rounds.SEND` round, every rank
packing its own buckets into its own ring.

What each round does, on rank 0 and on the others, is in :mod:`wsync_grpc.trainer.sharded.rounds`.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.trainer.sharded.ranks import TrainerRankLost, TrainerRanks
from wsync_grpc.trainer.sharded.rounds import AGAIN, DIGESTS, JOIN, RINGS, SEND, SentWait, send_own
from wsync_grpc.transports.broadcast.sender import PackBuffers, SendJob

log = logging.getLogger(__name__)

__all__ = ["SEND_MODES", "SendMode", "ShardedPeers"]

SendMode = Literal["gather", "direct"]
"""How a sharded trainer's bytes reach the engines: ``"gather"`` (per bucket, every rank gathers, rank 0
sends) or ``"direct"`` (every rank sends its own shards; nothing gathered)."""

SEND_MODES: tuple[str, ...] = ("gather", "direct")


class ShardedPeers:
    """Trainer rank 0's view of its ranks for the weight-sync group and the broadcast transport's sender:
    one group rank per trainer rank (:class:`~wsync_grpc.transports.sending.TrainerPeers`, and
    :class:`~wsync_grpc.transports.broadcast.sender.DirectSends` or, through shared memory,
    :class:`~wsync_grpc.transports.shared_memory.sender.RankRings` for the ``direct`` topology), each
    call leading one round of :mod:`~wsync_grpc.trainer.sharded.rounds`.

    Args:
        ranks: the trainer's ranks (this process is rank 0).
    """

    def __init__(self, ranks: TrainerRanks) -> None:
        self._ranks = ranks
        self._sent: SentWait | None = None

    @property
    def trainer_ranks(self) -> int:
        """Every trainer rank is a group rank."""
        return self._ranks.size

    @property
    def rank(self) -> int:
        """The trainer rank (0)."""
        return self._ranks.rank

    def forming(self, port: int, world_size: int) -> None:
        """The other ranks join now (the :data:`~wsync_grpc.trainer.sharded.rounds.JOIN` round).

        Raises:
            TrainerRankLost, TrainerRankFailed: the round failed.
        """
        JOIN.lead(self._ranks, port, world_size)

    def direct_digests(self, job: SendJob) -> Mapping[int, Digest]:
        """The :data:`~wsync_grpc.trainer.sharded.rounds.DIGESTS` round: every rank hashes its own buckets.

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not hash its buckets (it reported failure), or a rank failed
                its part of the previous command.
        """
        return DIGESTS.lead(self._ranks, job)

    def direct_send(self, job: SendJob, buffers: PackBuffers) -> float:
        """The :data:`~wsync_grpc.trainer.sharded.rounds.SEND` round: this rank's buckets while the others send
        theirs (their digests went with Prepare: ``job.on_digest`` is not called); then the
        :data:`~wsync_grpc.trainer.sharded.rounds.SENT` round, every rank's sends ended.

        Raises:
            TrainerRankLost, TrainerRankFailed: another rank died or its sends failed (rank 0's own
                sends stop at once).
            Exception: as :meth:`TransportSender.send <wsync_grpc.transports.sending.TransportSender.send>`.
        """
        pack_s = SEND.lead(self._ranks, job, lambda j: send_own(j, buffers), self._waiting)
        self.settle()
        return pack_s

    def direct_rings(
        self, job: SendJob, own: Callable[[SendJob, int], SharedMemoryHandle]
    ) -> Sequence[SharedMemoryHandle]:
        """The :data:`~wsync_grpc.trainer.sharded.rounds.RINGS` round (shared memory): every rank opens a ring for
        its own buckets (this one with ``own``); the handles, entry ``r`` trainer rank ``r``'s.

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not open its ring, or failed its part of the previous command.
            Exception: this rank could not open its own.
        """
        return RINGS.lead(self._ranks, job, own)

    def direct_ring_send(self, job: SendJob, own: Callable[[SendJob, int], float]) -> float:
        """The :data:`~wsync_grpc.trainer.sharded.rounds.SEND` round through shared memory: this rank's buckets
        through its ring (``own``) while the others send theirs through theirs; then the
        :data:`~wsync_grpc.trainer.sharded.rounds.SENT` round, every rank's sends ended.

        Raises:
            TrainerRankLost, TrainerRankFailed: another rank died or its sends failed (this rank's own sends
                stop at once).
            Exception: as :meth:`SharedMemorySender.send
                <wsync_grpc.transports.shared_memory.sender.SharedMemorySender.send>`.
        """
        pack_s = SEND.lead(self._ranks, job, lambda j: own(j, self.rank), self._waiting)
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
        """Once the last attempt's sends ended on every rank (their failure is the attempt's, logged), an
        :data:`~wsync_grpc.trainer.sharded.rounds.AGAIN` round: every rank forgets it and follows the next
        attempt.

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
