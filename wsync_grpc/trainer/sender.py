"""Which trainer rank sends which bytes: the :class:`Sender` seam, and today's one sender.

The weight-sync group's ranks are the trainer's first (``0 .. trainer_ranks - 1``), then every
engine's workers in target order: the membership asks the sender how many ranks the trainer holds
and which one this process joins as, so that no other part assumes the trainer is one process.
A sender then moves one update's buckets over the group, reading their tensors from the update's
:class:`~wsync_grpc.trainer.source.WeightSource` one bucket at a time.

:class:`BroadcastSender` is the first sender: one trainer process at group rank 0 broadcasting
every bucket whole (:class:`~wsync_grpc.transports.broadcast.sender.Broadcast`), the contract's
single-sender trainer. A sharded trainer's sender
(:class:`~wsync_grpc.trainer.sharded.sender.ShardedSender`) holds a rank per trainer process and
sends from all of them (each rank its own shards) or from rank 0 (the ranks gathering each bucket).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.transports.broadcast.sender import Broadcast, Corruption, PackBuffers

SENDING_RANK = 0
"""The group rank of a single trainer process, which sends every bucket (the contract's rank 0)."""


class Sender(Protocol):
    """Moves one update's buckets from the trainer's ranks to every engine's workers."""

    @property
    def trainer_ranks(self) -> int:
        """How many group ranks the trainer holds (``0 .. trainer_ranks - 1``); engines' workers follow."""
        ...

    @property
    def rank(self) -> int:
        """The group rank this process joins the weight-sync group as."""
        ...

    def forming(self, port: int, world_size: int) -> None:
        """The membership is about to form a group (store at ``port``, ``world_size`` ranks).

        Called before the engines' Init calls go out: a sender of several trainer ranks has its
        other ranks join now, beside this one (each blocks until the whole group formed).
        """
        ...

    def digests_before_send(
        self, buckets: Sequence[Bucket], layout: Layout, source: WeightSource
    ) -> Mapping[int, Digest] | None:
        """Every bucket's digest, computed before the update is prepared; ``None``: the sender hashes each bucket
        as it sends it (:meth:`send`'s ``on_digest``), and the digests follow the Prepare.

        Raises:
            Exception: a trainer rank failed or is gone (the update is abandoned before Prepare).
        """
        ...

    def send(
        self,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        layout: Layout,
        source: WeightSource,
        on_sent: Callable[[Bucket, int], None] | None,
        cancel: threading.Event,
        on_digest: Callable[[Bucket, Digest], None] | None = None,
    ) -> float:
        """Send every bucket of one update, in index order, in ``layout``.

        Args:
            group: this process's membership of the weight-sync group.
            buckets: the update's planned buckets.
            layout: how buckets travel (one collective per bucket, or one per tensor).
            source: the update's tensors, asked for one bucket at a time.
            on_sent: called from this thread once a bucket is on every engine, with the bucket
                and the bytes on every engine so far (bytes); ``None`` for none.
            cancel: set to stop at the next wait.
            on_digest: called with each bucket and its digest as soon as it was hashed (while it is on
                the wire); ``None``: nothing is hashed while sending.

        Returns:
            The time spent packing or preparing tensors, in seconds (overlapped with the wire).

        Raises:
            Exception: the group's (a timeout, a peer gone) or
                :class:`~wsync_grpc.core.errors.Cancelled`; the update is then abandoned.
        """
        ...

    def release(self) -> None:
        """Drop what the sender keeps between updates (its pack buffers); an abandoned send may still read them."""
        ...


class BroadcastSender:
    """One trainer process at group rank 0 broadcasting every bucket whole.

    Args:
        buffers: the two flat pack buffers the flattened layout packs into (kept between updates or not).
        corrupt: a test hook: flip a byte of one bucket after hashing it
            (:class:`~wsync_grpc.transports.broadcast.sender.Corruption`); ``None`` (always, outside tests).
    """

    trainer_ranks = 1
    """One trainer rank: rank 0."""
    rank = SENDING_RANK
    """This process joins as rank 0."""

    def __init__(self, buffers: PackBuffers, *, corrupt: Corruption | None = None) -> None:
        self._buffers = buffers
        self._corrupt = corrupt

    def forming(self, port: int, world_size: int) -> None:
        """See :meth:`Sender.forming`: nothing, this process is the trainer's only rank."""

    def send(
        self,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        layout: Layout,
        source: WeightSource,
        on_sent: Callable[[Bucket, int], None] | None,
        cancel: threading.Event,
        on_digest: Callable[[Bucket, Digest], None] | None = None,
    ) -> float:
        """See :meth:`Sender.send`: a broadcast from rank 0 per bucket (flattened) or per tensor (individual)."""
        job = Broadcast(
            group,
            buckets,
            source.bucket_tensors,
            on_sent,
            cancel,
            src=SENDING_RANK,
            on_digest=on_digest,
            corrupt=self._corrupt,
        )
        return job.run(layout, self._buffers)

    def digests_before_send(
        self, buckets: Sequence[Bucket], layout: Layout, source: WeightSource
    ) -> Mapping[int, Digest] | None:
        """See :meth:`Sender.digests_before_send`: none, this process hashes each bucket as it sends it."""
        return None

    def release(self) -> None:
        """See :meth:`Sender.release`."""
        self._buffers.release()
