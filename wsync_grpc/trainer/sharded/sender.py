"""How a sharded trainer's ranks move an update's bytes: every rank a member of the weight-sync group.

The trainer holds one group rank per trainer rank (``wsync.v1.InitRequest.trainer_ranks``), so the
group is one broadcast group per trainer rank (:mod:`wsync_grpc.group.process_group`). Trainer rank
0's :class:`~wsync_grpc.trainer.client.TrainerClient` forms it with a :class:`ShardedSender`, which
has the other ranks join beside it (a :data:`~wsync_grpc.trainer.sharded.ranks.Command.JOIN` round,
then :class:`FollowerGroup` on each of them) while the engines' Init calls are in flight.

Per sync the job's :class:`~wsync_grpc.core.topology.SendTopology` (``kind``, the send mode the caller
chose) says how the bytes leave the ranks:

- ``"gather"``: rank 0 broadcasts every bucket whole; the ranks gather each bucket together first
  (:class:`~wsync_grpc.trainer.sharded.source.LockstepSource`). Rank 0 hashes each bucket as it sends
  it, as a single trainer does.
- ``"direct"``: every rank broadcasts the buckets of its own pieces
  (:class:`~wsync_grpc.trainer.sharded.source.DirectSource`). Before Prepare, rank 0 leads a
  :data:`~wsync_grpc.trainer.sharded.ranks.Command.DIGESTS` round: every rank hashes its own
  buckets (:func:`own_digests`, reading its shards once; nothing is gathered) and the ranks
  exchange the digests, which rank 0 declares in the bucket specs. Then rank 0 leads a
  :data:`~wsync_grpc.trainer.sharded.ranks.Command.SEND` round, sends its own buckets while the
  others send theirs (:func:`send_own`), and meanwhile waits in a
  :data:`~wsync_grpc.trainer.sharded.ranks.Command.SENT` round, in a helper thread, for every rank
  to report its sends done: a rank that fails or dies ends rank 0's sends at once, and the error
  names it. The other ranks watch rank 0 the same way
  (:meth:`~wsync_grpc.trainer.sharded.ranks.TrainerRanks.watch_leader`): rank 0 dying, or its
  sends failing, ends theirs.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from wsync_grpc.core.digests import Digest, DigestAlgorithm
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.trainer.client import TrainerClient
from wsync_grpc.trainer.sharded.ranks import Command, TrainerRankFailed, TrainerRanks
from wsync_grpc.transports.broadcast.sender import Broadcast, PackBuffers, SendJob, bucket_digest

__all__ = [
    "SEND_MODES",
    "FollowerGroup",
    "SendMode",
    "ShardedSender",
    "decode_digests",
    "encode_digests",
    "own_digests",
    "send_own",
]

log = logging.getLogger(__name__)

SendMode = Literal["gather", "direct"]
"""How a sharded trainer's bytes reach the engines: ``"gather"`` (per bucket, every rank gathers, rank 0
sends) or ``"direct"`` (every rank sends its own shards; nothing gathered)."""

SEND_MODES: tuple[str, ...] = ("gather", "direct")


class _Either(threading.Event):
    """Set when it is set, or when another event (the client's cancel signal) is."""

    def __init__(self, other: threading.Event) -> None:
        super().__init__()
        self._other = other

    def is_set(self) -> bool:
        return super().is_set() or self._other.is_set()


def send_own(job: SendJob, buffers: PackBuffers) -> float:
    """Broadcast the buckets of ``job`` whose sender is this process's group rank, in index order.

    Returns:
        The time spent packing, in seconds.

    Raises:
        Exception: the group's (a timeout, a peer gone) or :class:`~wsync_grpc.core.errors.Cancelled`.
    """
    rank = job.group.rank
    return Broadcast.of(job.own(rank), rank).run(job.layout, buffers)


_DIGEST_ENTRY = struct.Struct(">I16s")
"""One digest in a rank's share of the :data:`Command.DIGESTS` exchange: bucket index, XXH3-128 value."""


def own_digests(
    buckets: Sequence[Bucket], layout: Layout, tensors: Callable[[Bucket], Mapping[str, torch.Tensor]], rank: int
) -> dict[int, Digest]:
    """The digests of the buckets of ``buckets`` that group rank ``rank`` sends, hashed from its own pieces
    (``tensors(bucket)``, e.g. a :meth:`WeightSource.bucket_tensors
    <wsync_grpc.trainer.source.WeightSource.bucket_tensors>`).

    Raises:
        Exception: reading a piece failed.
    """
    return {b.index: bucket_digest(b, tensors(b), layout) for b in buckets if b.src == rank}


def encode_digests(digests: Mapping[int, Digest]) -> bytes:
    """A rank's digests as its share of the exchange (:data:`_DIGEST_ENTRY` per bucket; XXH3-128 only)."""
    return b"".join(_DIGEST_ENTRY.pack(i, d.value) for i, d in digests.items())


def decode_digests(payload: bytes) -> dict[int, Digest]:
    """The digests :func:`encode_digests` wrote."""
    return {i: Digest(DigestAlgorithm.XXH3_128, value) for i, value in _DIGEST_ENTRY.iter_unpack(payload)}


class _SentRound:
    """Rank 0's :data:`Command.SENT` round, in a helper thread, while it sends its own buckets.

    Attributes:
        error: why the round failed (a rank's sends failed, or a rank is gone); ``None`` if it did not.
    """

    def __init__(self, ranks: TrainerRanks, stop: threading.Event) -> None:
        self._ranks = ranks
        self._stop = stop
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wsync-sent-round", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._ranks.lead(Command.SENT)
        except BaseException as e:
            self.error = e
            self._stop.set()  # rank 0's own sends stop at their next wait

    def join(self) -> None:
        """Wait for the round (a rank that never reports fails it after the control group's timeout)."""
        self._thread.join()


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
        self._sent: _SentRound | None = None

    @property
    def trainer_ranks(self) -> int:
        """See :meth:`Sender.trainer_ranks`: every trainer rank is a group rank."""
        return self._ranks.size

    @property
    def rank(self) -> int:
        """See :meth:`Sender.rank`: the trainer rank (0)."""
        return self._ranks.rank

    def forming(self, port: int, world_size: int) -> None:
        """See :meth:`Sender.forming`: the other ranks join now (a :data:`Command.JOIN` round).

        Raises:
            TrainerRankLost, TrainerRankFailed: the round failed.
        """
        self._ranks.lead(Command.JOIN, port, world_size)

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """See :meth:`Sender.digests_before_send`. Gathered (``job.topology.kind == "gather"``): none (rank 0
        hashes what it sends). Direct: a :data:`Command.DIGESTS` round, every rank hashing its own buckets.

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not hash its buckets (it reported failure), or a rank failed
                its part of the previous command.
        """
        if job.topology.kind != "direct":
            return None
        self._ranks.lead(Command.DIGESTS)
        error: Exception | None = None
        try:
            mine = encode_digests(own_digests(job.buckets, job.layout, job.tensors, self.rank))
        except Exception as e:  # the exchange is collective: take part, then fail
            error, mine = e, b""
        shares = self._ranks.exchange(mine, "exchanging the buckets' digests")
        if error is not None:
            raise error
        digests: dict[int, Digest] = {}
        for share in shares:
            digests.update(decode_digests(share))
        missing = sorted({b.src for b in job.buckets if b.index not in digests})
        if missing:
            raise TrainerRankFailed(
                f"trainer rank {', '.join(map(str, missing))} could not hash its buckets (see its own error)", missing
            )
        return digests

    def send(self, job: SendJob) -> float:
        """See :meth:`Sender.send`. Gathered: rank 0 broadcasts every bucket, gathered in lockstep. Direct: this
        rank's buckets, while the others send theirs (their digests went with Prepare: ``job.on_digest`` is
        not called).

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
        stop = _Either(job.cancel)
        self._ranks.lead(Command.SEND)
        sent = self._sent = _SentRound(self._ranks, stop)
        try:
            pack_s = send_own(dataclasses.replace(job, cancel=stop), self._buffers)
        except BaseException as e:
            self._ranks.release_followers(ok=False)  # their sends stop too
            if sent.error is not None and isinstance(e, Exception):  # another rank's failure stopped this one
                raise sent.error from e
            raise
        self._ranks.release_followers(ok=True)
        self.settle()
        return pack_s

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

    def release(self) -> None:
        """See :meth:`Sender.release`."""
        self._buffers.release()


class FollowerGroup:
    """A trainer rank other than 0: its membership of the weight-sync group, joined when rank 0 forms one.

    Args:
        settings: this rank's client (its ``master_address`` is rank 0's store host; its group name,
            backend, device and group timeout are rank 0's).
        ranks: the trainer's ranks.
    """

    def __init__(self, settings: TrainerClient, ranks: TrainerRanks) -> None:
        self._settings = settings
        self._ranks = ranks
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._group: WeightSyncGroup | None = None
        self._error: BaseException | None = None
        self._generation = 0

    def join(self, port: int, world_size: int) -> None:
        """Leave the current group and start joining the one being formed (in a helper thread)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            old, self._group, self._error = self._group, None, None
        if old is not None:
            old.destroy()
        s = self._settings

        def run() -> None:
            try:
                g = join_group(
                    master_address=s.master_address,
                    master_port=port,
                    rank=self._ranks.rank,
                    world_size=world_size,
                    group_name=s.group_name,
                    backend=s.backend,
                    device=s.device,
                    timeout_s=s.group_timeout_s,
                    trainer_ranks=self._ranks.size,
                )
            except BaseException as e:
                with self._lock:
                    if generation == self._generation:
                        self._error = e
                return
            with self._lock:
                if generation == self._generation:
                    self._group = g
                    return
            g.destroy()  # a newer formation (or close) came first

        self._thread = threading.Thread(target=run, name="wsync-follower-join", daemon=True)
        self._thread.start()

    def group(self) -> WeightSyncGroup:
        """The joined group, waiting for a join in progress (bounded by the group timeout).

        Raises:
            RuntimeError: never joined, or the join failed or has not ended.
        """
        thread = self._thread
        if thread is not None:
            thread.join(self._settings.group_timeout_s + 5.0)
        with self._lock:
            if self._group is not None:
                return self._group
            if self._error is not None:
                raise RuntimeError(f"trainer rank {self._ranks.rank} could not join the group: {self._error}")
        raise RuntimeError(f"trainer rank {self._ranks.rank} is not a member of the weight-sync group")

    def close(self) -> None:
        """Leave the group (idempotent; a join in progress destroys its group when it ends)."""
        with self._lock:
            self._generation += 1
            group, self._group = self._group, None
        if group is not None:
            group.destroy()
