"""Which trainer rank sends which bytes: the :class:`Sender` seam, and today's one sender.

The weight-sync group's ranks are the trainer's first (``0 .. trainer_ranks - 1``), then every
engine's workers in target order: the membership asks the sender how many ranks the trainer holds
and which one this process joins as, so that no other part assumes the trainer is one process.
A sender then moves one update's buckets over the group (one
:class:`~wsync_grpc.transports.broadcast.sender.SendJob`), reading their tensors from the update's
:class:`~wsync_grpc.trainer.source.WeightSource` one bucket at a time, from the trainer ranks the
job's :class:`~wsync_grpc.core.topology.SendTopology` names.

:class:`BroadcastSender` is the first sender: one trainer process at group rank 0 broadcasting
every bucket whole (:class:`~wsync_grpc.transports.broadcast.sender.Broadcast`), the contract's
single-sender trainer. A sharded trainer's sender
(:class:`~wsync_grpc.trainer.sharded.sender.ShardedSender`) holds a rank per trainer process and
sends from all of them (each rank its own shards) or from rank 0 (the ranks gathering each bucket).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from wsync_grpc.core.digests import Digest
from wsync_grpc.transports.broadcast.sender import Broadcast, Corruption, PackBuffers, SendJob

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

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """Every bucket's digest of ``job``, computed before the update is prepared; ``None``: the sender hashes
        each bucket as it sends it (:meth:`send` calls ``job.on_digest``), and the digests follow the Prepare.

        Raises:
            Exception: a trainer rank failed or is gone (the update is abandoned before Prepare).
        """
        ...

    def send(self, job: SendJob) -> float:
        """Send every bucket of one update (``job``), in index order, in ``job.layout``, from the ranks
        ``job.topology`` names.

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

    def repeating(self) -> None:
        """The update that just failed runs again over fewer engines (a fleet policy left some out): the
        trainer's other ranks, if any, must follow the next attempt.

        Raises:
            Exception: a trainer rank is gone (the update is not run again).
        """
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

    def send(self, job: SendJob) -> float:
        """See :meth:`Sender.send`: a broadcast from rank 0 per bucket (flattened) or per tensor (individual).

        Raises:
            ValueError: ``job.topology`` is not a single process's.
            Exception: as for :meth:`Sender.send`.
        """
        if job.topology.kind != "single":
            raise ValueError(f"one trainer process cannot send a {job.topology.kind!r} topology")
        return Broadcast.of(job, SENDING_RANK, corrupt=self._corrupt).run(job.layout, self._buffers)

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """See :meth:`Sender.digests_before_send`: none, this process hashes each bucket as it sends it."""
        return None

    def release(self) -> None:
        """See :meth:`Sender.release`."""
        self._buffers.release()

    def repeating(self) -> None:
        """See :meth:`Sender.repeating`: nothing, this process is the trainer's only rank."""
