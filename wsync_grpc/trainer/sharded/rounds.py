"""The rank protocol of a sharded trainer: every round, its leader half beside its follower half.

Trainer rank 0 leads one round at a time (:meth:`TrainerRanks.lead
<wsync_grpc.trainer.sharded.ranks.TrainerRanks.lead>`: one ``all_gather`` in which it names a
:class:`~wsync_grpc.trainer.sharded.ranks.Command` and every other rank reports whether its part of the
previous one failed); the other ranks wait in :func:`follow`, which dispatches each command to its
round's follower half. A round is declared here once, as a :class:`Round` with its ``lead`` (called on
rank 0 by whoever leads it) and its ``follow`` (called on every other rank by :func:`follow`), so that
reading one round is reading one class and the two halves cannot drift apart:

- :data:`JOIN` (led by :class:`~wsync_grpc.trainer.sharded.peers.ShardedPeers` while rank 0 forms the
  weight-sync group): every other rank starts joining it.
- :data:`GATHER` (led by :class:`~wsync_grpc.trainer.sharded.source.LockstepSource` before each bucket,
  gather mode): every rank gathers the bucket; rank 0 sends it, the others drop it.
- :data:`DIGESTS` (led by the sender before Prepare, direct mode): every rank hashes its own buckets and
  the ranks exchange the digests.
- :data:`RINGS` (led by the shared-memory sender before Prepare, direct mode): every rank opens a ring of its own
  for its own buckets; the ranks exchange the rings' handles, which rank 0 puts in the Prepare header.
- :data:`SEND` (led by the sender, direct mode): every rank sends its own buckets (by broadcast, or through its ring
  by the request's transport); rank 0 meanwhile leads :data:`SENT` in a helper thread, in which every rank reports
  its sends done.
- :data:`AGAIN` (led by the sender when rank 0's fleet policy runs a failed update again over fewer
  engines): every rank forgets the failed attempt's failures and follows the next attempt.
- :data:`OUTCOME` (led by :class:`~wsync_grpc.trainer.sharded.client.ShardedTrainerClient` at the end of
  every call): rank 0's result or error, as JSON, to every rank.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from google.protobuf.message import DecodeError
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.digests import Digest, DigestAlgorithm
from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.core.layout import Bucket, Layout, Transport
from wsync_grpc.trainer.results import SyncResult
from wsync_grpc.trainer.sharded.follower import FollowedCall
from wsync_grpc.trainer.sharded.outcome import decode_outcome, encode_error, encode_result
from wsync_grpc.trainer.sharded.ranks import Command, TrainerRankFailed, TrainerRanks
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.transports.broadcast.sender import Broadcast, PackBuffers, SendJob, bucket_digest
from wsync_grpc.wire.convert import shared_memory_from_proto, shared_memory_to_proto

__all__ = [
    "AGAIN",
    "DIGESTS",
    "GATHER",
    "JOIN",
    "OUTCOME",
    "RINGS",
    "ROUNDS",
    "SEND",
    "SENT",
    "Ended",
    "Round",
    "SentWait",
    "decode_digests",
    "decode_handle",
    "encode_digests",
    "encode_handle",
    "follow",
    "own_digests",
    "send_own",
]

log = logging.getLogger(__name__)


class Round(abc.ABC):
    """One round of the rank protocol: rank 0's half (``lead``) and every other rank's half (:meth:`follow`).

    Each round's ``lead`` takes what its leader has at hand (its own arguments, so not declared here); a
    subclass that lacks either half, or its :attr:`command`, is refused when it is declared.
    """

    command: ClassVar[Command]
    """The command rank 0 names in the round."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("command", "lead", "follow") if name not in vars(cls)]
        if missing:
            raise TypeError(f"round {cls.__name__} lacks {', '.join(missing)}")

    @abc.abstractmethod
    def follow(self, call: FollowedCall, arg: int, arg2: int) -> Ended | None:
        """A rank other than 0: its part of the round, with the round's two arguments.

        Returns:
            The call's end (rank 0's result) when the round ends the call; ``None`` to wait for the next round.
        """


@dataclasses.dataclass(frozen=True)
class Ended:
    """A call ended by rank 0's outcome: its result (``None``: the call had nothing to do)."""

    result: SyncResult | None


# ---------------------------------------------------------------------- JOIN


class JoinRound(Round):
    """Rank 0 forms the weight-sync group (one broadcast group per trainer rank); every rank joins it."""

    command = Command.JOIN

    def lead(self, ranks: TrainerRanks, port: int, world_size: int) -> None:
        """Rank 0, while it sends the engines' Init calls: the others join now, at store port ``port``.

        Raises:
            TrainerRankLost, TrainerRankFailed: the round failed.
        """
        ranks.lead(Command.JOIN, port, world_size)

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Leave the last group and start joining this one (store port ``arg``, world size ``arg2``) in a
        helper thread; the next send waits for it."""
        call.follower.group.join(arg, arg2)


# ---------------------------------------------------------------------- GATHER


class GatherRound(Round):
    """Gather mode, before each bucket: every rank gathers the bucket (collectively); rank 0 sends it."""

    command = Command.GATHER

    def lead(self, ranks: TrainerRanks, source: WeightSource, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        """Rank 0: tell the others to gather ``bucket``, then gather it here too.

        Returns:
            The bucket's tensors whole, to send.

        Raises:
            TrainerRankFailed: a rank's last gather failed.
            TrainerRankLost: a rank is gone (before the gather, or inside it).
        """
        ranks.lead(Command.GATHER, bucket.index)
        try:
            return source.bucket_tensors(bucket)
        except RuntimeError as e:  # the all-gather broke: a rank gone mid-gather is named
            raise ranks.broken(f"gathering bucket {bucket.index}", e) from e

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Gather bucket ``arg`` with every rank and drop it; a failure is reported in the next round."""
        try:
            call.source.bucket_tensors(call.buckets[arg])  # collective with every rank; dropped at once
        except Exception as e:
            log.exception("trainer rank %d: gathering bucket %d failed", call.ranks.rank, arg)
            call.failed(e, report=True)


# ---------------------------------------------------------------------- DIGESTS

_DIGEST_ENTRY = struct.Struct(">I16s")
"""One digest in a rank's share of the :data:`DIGESTS` exchange: bucket index, XXH3-128 value."""


def own_digests(
    buckets: Sequence[Bucket],
    layout: Layout,
    tensors: Callable[[Bucket], Mapping[str, torch.Tensor]],
    rank: int,
    digest_of: Callable[[Bucket], Digest] | None = None,
) -> dict[int, Digest]:
    """The digests of the buckets of ``buckets`` that group rank ``rank`` sends, hashed from its own pieces
    (``tensors(bucket)``, e.g. a :meth:`WeightSource.bucket_tensors
    <wsync_grpc.trainer.source.WeightSource.bucket_tensors>``; a delta's: ``digest_of(bucket)``).

    Raises:
        Exception: reading a piece failed.
    """
    if digest_of is not None:
        return {b.index: digest_of(b) for b in buckets if b.src == rank}
    return {b.index: bucket_digest(b, tensors(b), layout) for b in buckets if b.src == rank}


def encode_digests(digests: Mapping[int, Digest]) -> bytes:
    """A rank's digests as its share of the exchange (:data:`_DIGEST_ENTRY` per bucket; XXH3-128 only)."""
    return b"".join(_DIGEST_ENTRY.pack(i, d.value) for i, d in digests.items())


def decode_digests(payload: bytes) -> dict[int, Digest]:
    """The digests :func:`encode_digests` wrote."""
    return {i: Digest(DigestAlgorithm.XXH3_128, value) for i, value in _DIGEST_ENTRY.iter_unpack(payload)}


_DIGESTS_EXCHANGE = "exchanging the buckets' digests"


class DigestsRound(Round):
    """Direct mode, before Prepare: every rank hashes its own buckets; the ranks exchange the digests."""

    command = Command.DIGESTS

    def lead(self, ranks: TrainerRanks, job: SendJob) -> dict[int, Digest]:
        """Rank 0: every bucket's digest (rank 0 declares them in the bucket specs), hashed where it is sent.

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not hash its buckets (it reported failure), or a rank failed
                its part of the previous command.
        """
        ranks.lead(Command.DIGESTS, int(job.digest_of is not None))  # 1: the delta's buckets
        error: Exception | None = None
        try:
            mine = encode_digests(own_digests(job.buckets, job.layout, job.tensors, ranks.rank, job.digest_of))
        except Exception as e:  # the exchange is collective: take part, then fail
            error, mine = e, b""
        shares = ranks.exchange(mine, _DIGESTS_EXCHANGE)
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

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Hash this rank's own buckets and take part in the exchange (with nothing, when hashing failed:
        rank 0 names this rank as the one whose digests are missing)."""
        mine = b""
        try:
            buckets, tensors, digest_of = call.plan(delta=bool(arg))
            mine = encode_digests(own_digests(buckets, call.request.layout, tensors, call.ranks.rank, digest_of))
        except Exception as e:
            log.exception("trainer rank %d: hashing its buckets failed", call.ranks.rank)
            call.failed(e, report=False)
        call.ranks.exchange(mine, _DIGESTS_EXCHANGE)


# ---------------------------------------------------------------------- RINGS


def encode_handle(h: SharedMemoryHandle) -> bytes:
    """A rank's ring handle as its share of the :data:`RINGS` exchange: the contract's ``wsync.v1.SharedMemoryHandle``
    message, serialized (its ``cuda_ipc`` included; never pickle)."""
    return shared_memory_to_proto(h).SerializeToString()


def decode_handle(payload: bytes) -> SharedMemoryHandle:
    """The handle :func:`encode_handle` wrote.

    Raises:
        ValueError: not such a share (the engines check the handle's fields again at Prepare).
    """
    try:
        m = pb.SharedMemoryHandle.FromString(payload)
    except DecodeError as e:
        raise ValueError(f"a ring handle is a serialized wsync.v1.SharedMemoryHandle: {e}") from e
    return shared_memory_from_proto(m)


_RINGS_EXCHANGE = "exchanging the rings' handles"


class RingsRound(Round):
    """Direct mode through shared memory, before Prepare: every rank opens a ring of its own for its own buckets
    (:meth:`SharedMemorySender.open_own <wsync_grpc.transports.shared_memory.sender.SharedMemorySender.open_own>`);
    the ranks exchange the handles."""

    command = Command.RINGS

    def lead(
        self, ranks: TrainerRanks, job: SendJob, own: Callable[[SendJob, int], SharedMemoryHandle]
    ) -> list[SharedMemoryHandle]:
        """Rank 0: every rank's handle, entry ``r`` trainer rank ``r``'s (rank 0's own from ``own(job, 0)``).

        Raises:
            TrainerRankLost: the round or the exchange failed.
            TrainerRankFailed: a rank could not open its ring (it shared nothing), or a rank failed its part of
                the previous command.
            Exception: rank 0 could not open its own ring.
        """
        ranks.lead(Command.RINGS, int(job.digest_of is not None))  # 1: the delta's buckets
        error: Exception | None = None
        try:
            mine = encode_handle(own(job, ranks.rank))
        except Exception as e:  # the exchange is collective: take part, then fail
            error, mine = e, b""
        shares = ranks.exchange(mine, _RINGS_EXCHANGE)
        if error is not None:
            raise error
        missing = [r for r, share in enumerate(shares) if not share]
        if missing:
            raise TrainerRankFailed(
                f"trainer rank {', '.join(map(str, missing))} could not open its ring (see its own error)", missing
            )
        return [decode_handle(share) for share in shares]

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Open this rank's ring for its own buckets and take part in the exchange (with nothing, when opening
        failed: rank 0 names this rank)."""
        mine = b""
        try:
            buckets, tensors, _digest_of = call.plan(delta=bool(arg))
            request = call.request
            job = SendJob(None, buckets, request.layout, tensors, request.topology, threading.Event())
            mine = encode_handle(call.follower.rings.open_own(job, call.ranks.rank))
        except Exception as e:
            log.exception("trainer rank %d: opening its ring failed", call.ranks.rank)
            call.failed(e, report=False)
        call.ranks.exchange(mine, _RINGS_EXCHANGE)


# ---------------------------------------------------------------------- SEND and SENT


def send_own(job: SendJob, buffers: PackBuffers) -> float:
    """Broadcast the buckets of ``job`` whose sender is this process's group rank, in index order.

    Returns:
        The time spent packing, in seconds.

    Raises:
        Exception: the group's (a timeout, a peer gone) or :class:`~wsync_grpc.core.errors.Cancelled`.
    """
    rank = job.joined().rank
    return Broadcast.of(job.own(rank), rank).run(job.layout, buffers)


class _Either(threading.Event):
    """Set when it is set, or when another event (the client's cancel signal) is."""

    def __init__(self, other: threading.Event) -> None:
        super().__init__()
        self._other = other

    def is_set(self) -> bool:
        return super().is_set() or self._other.is_set()


SENT_GRACE_S = 3.0
"""How long rank 0, its own sends broken, waits for the :data:`SENT` round to name the rank that failed or
died, in seconds (the other ranks' sends stop at once; a dead rank fails the round within moments)."""


class SentWait:
    """Rank 0's :data:`SENT` round, in a helper thread, while it sends its own buckets.

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

    def wait(self, timeout_s: float) -> None:
        """Wait for the round at most ``timeout_s`` seconds (it goes on afterwards; :meth:`join` ends it)."""
        self._thread.join(timeout_s)


class SendRound(Round):
    """Direct mode: every rank sends its own buckets now, straight from its shards."""

    command = Command.SEND

    def lead(
        self,
        ranks: TrainerRanks,
        job: SendJob,
        own: Callable[[SendJob], float],
        waiting: Callable[[SentWait], None],
    ) -> float:
        """Rank 0: start every rank's sends, then send its own (``own(job)``, returning its packing time in seconds:
        :func:`send_own` by broadcast, or through its ring) while it waits in the :data:`SENT` round
        (handed to ``waiting`` as soon as it runs, for the caller to wait for it afterwards); then tell
        the others whether its own sends succeeded (:meth:`TrainerRanks.release_followers
        <wsync_grpc.trainer.sharded.ranks.TrainerRanks.release_followers>`).

        Returns:
            The time spent packing, in seconds.

        Raises:
            TrainerRankLost, TrainerRankFailed: another rank died or its sends failed (rank 0's own sends
                stop at once).
            Exception: as for :func:`send_own`.
        """
        stop = _Either(job.cancel)
        ranks.lead(Command.SEND, int(job.digest_of is not None))  # 1: the delta's buckets
        sent = SENT.lead(ranks, stop)
        waiting(sent)
        try:
            pack_s = own(dataclasses.replace(job, cancel=stop))
        except BaseException as e:
            ranks.release_followers(ok=False)  # their sends stop too
            if isinstance(e, Exception):
                # A rank that died breaks the group's broadcasts at once, and the round may name it a moment
                # later: its word says more than the broken broadcast that stopped this rank's sends.
                sent.wait(SENT_GRACE_S)
                if sent.error is not None:
                    raise sent.error from e
            raise
        ranks.release_followers(ok=True)
        return pack_s

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Send this rank's own buckets (by broadcast, or through the ring it opened in :data:`RINGS`, by the
        request's transport), watching rank 0 meanwhile (rank 0 gone, or its sends failed, stops them); then wait
        for rank 0's word that its own sends ended. A failure is reported in :data:`SENT`."""
        ranks, follower = call.ranks, call.follower
        stop = threading.Event()
        watch = ranks.watch_leader(stop)
        try:
            request = call.request
            buckets, tensors, _digest_of = call.plan(delta=bool(arg))
            if request.transport is Transport.SHARED_MEMORY:
                job = SendJob(None, buckets, request.layout, tensors, request.topology, stop)
                follower.rings.send_own(job, ranks.rank)
            else:
                job = SendJob(follower.group.group(), buckets, request.layout, tensors, request.topology, stop)
                send_own(job, follower.buffers)
            watch.join(ranks.timeout_s)  # rank 0's word that its own sends ended
        except Exception as e:  # rank 0 gone or failed (stop set), or this rank's own failure
            watch.join(ranks.timeout_s)
            log.warning("trainer rank %d: sending its buckets failed: %s", ranks.rank, e)
            call.failed(e, report=True)


class SentRound(Round):
    """Direct mode, while the ranks send: every rank reports its sends done (or failed)."""

    command = Command.SENT

    def lead(self, ranks: TrainerRanks, stop: threading.Event) -> SentWait:
        """Rank 0: lead the round in a helper thread; its failure sets ``stop`` (rank 0's own sends end)."""
        return SentWait(ranks, stop)

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Nothing more: this rank's status (its sends failed or not) went with the round."""


# ---------------------------------------------------------------------- OUTCOME

_SHARING = "sharing the outcome"


class OutcomeRound(Round):
    """The call is over: rank 0's result or error (JSON, never pickle), on every rank."""

    command = Command.OUTCOME

    def lead(self, ranks: TrainerRanks, outcome: SyncResult | BaseException | None) -> None:
        """Rank 0: end the call, giving every other rank ``outcome``: one round (whose argument is the
        length), then a broadcast of the bytes. A follower's failure of its own is not raised here: the
        follower raises it.

        Raises:
            TrainerRankLost: the round or the broadcast failed.
        """
        payload = encode_error(outcome) if isinstance(outcome, BaseException) else encode_result(outcome)
        with contextlib.suppress(TrainerRankFailed):  # the outcome tells; a follower's own error is raised on it
            ranks.lead(Command.OUTCOME, len(payload))
        if payload:
            ranks.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), _SHARING)

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> Ended:
        """Take the ``arg`` bytes rank 0 shares: its result, or its error raised here (this rank's own
        failure, if any, as its cause); then this rank's own failure, if any, is raised.

        Raises:
            SyncError, ValueError, ClientError: rank 0's (:func:`~wsync_grpc.trainer.sharded.outcome.decode_outcome`).
            TrainerRankLost: the broadcast failed.
            Exception: this rank's own first failure of the call.
        """
        data = torch.empty(arg, dtype=torch.uint8)
        if arg:
            call.ranks.broadcast(data, _SHARING)
        try:
            result = decode_outcome(bytes(data.numpy().tobytes()))  # rank 0's error says the most
        except Exception as outcome:
            raise outcome from call.error
        if call.error is not None:
            raise call.error
        return Ended(result)


# ---------------------------------------------------------------------- the table

# ---------------------------------------------------------------------- AGAIN


class AgainRound(Round):
    """Rank 0's fleet policy left engines out of a failed attempt and runs the update again over the others
    (:class:`~wsync_grpc.trainer.roster.Roster`): every rank forgets the failures of the attempt that
    ended, which followed from it (a send into a broken group), and follows the next attempt's rounds."""

    command = Command.AGAIN

    def lead(self, ranks: TrainerRanks) -> None:
        """Rank 0, before it runs the update again (its own and the other ranks' sends of the last attempt
        ended). The other ranks' failures of the attempt are what it leaves behind: not raised.

        Raises:
            TrainerRankLost: the round failed (a rank gone).
        """
        with contextlib.suppress(TrainerRankFailed):
            ranks.lead(Command.AGAIN)

    def follow(self, call: FollowedCall, arg: int, arg2: int) -> None:
        """Forget this call's failure so far (the attempt it came from was abandoned everywhere)."""
        if call.error is not None:
            log.info(
                "trainer rank %d: the update runs again; the last attempt's failure is dropped: %s",
                call.ranks.rank,
                call.error,
            )
        call.error = None


# ---------------------------------------------------------------------- the table

JOIN = JoinRound()
GATHER = GatherRound()
DIGESTS = DigestsRound()
RINGS = RingsRound()
SEND = SendRound()
SENT = SentRound()
OUTCOME = OutcomeRound()
AGAIN = AgainRound()

ROUNDS: Mapping[Command, Round] = {r.command: r for r in (JOIN, GATHER, DIGESTS, RINGS, SEND, SENT, OUTCOME, AGAIN)}
"""Every command rank 0 may name, and its round."""


def follow(call: FollowedCall) -> SyncResult | None:
    """A rank other than 0: do what rank 0 asks, round by round, until it shares the outcome.

    Returns:
        Rank 0's result (``None``: the call had nothing to do).

    Raises:
        as the rounds' follower halves (:meth:`OutcomeRound.follow` raises rank 0's error, or this rank's).
        TrainerRankLost: a round failed (rank 0 gone, or no command within the timeout).
    """
    while True:
        command, arg, arg2 = call.ranks.follow()
        r = ROUNDS.get(command)
        if r is None:
            raise AssertionError(f"unexpected command {command!r} from trainer rank 0")
        ended = r.follow(call, arg, arg2)
        if ended is not None:
            return ended.result
