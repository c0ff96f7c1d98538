"""The shared-memory transport's trainer half: a ring of slots in one memfd, handed over per update.

:class:`SharedMemorySender` keeps one :class:`~wsync_grpc.transports.shared_memory.handover.Segment` (a
memfd of ``slots * slot_bytes`` bytes, mapped read-write here) between updates, so that its pages stay
touched; it is replaced by a larger one when a bucket no longer fits a slot, and dropped by
:meth:`SharedMemorySender.release`.

Per update (:meth:`SharedMemorySender.header_fields`, before Prepare) a
:class:`~wsync_grpc.transports.shared_memory.handover.Handover` listens on a
fresh abstract Unix socket with a fresh token: each engine worker that connects from this user
(``SO_PEERCRED``) and sends the token gets the segment's descriptor, opened read-only. Connections from
another user, with another token, or once the send began are closed and logged. The send
(:meth:`SharedMemorySender.send`) takes the workers connected by then as the update's readers (every
engine answered Prepare only once its receivers were armed, i.e. connected) and closes the listener:

- bucket ``k`` goes in slot ``k % slots`` once every reader acknowledged the bucket that was there;
  it is packed as the broadcast's flattened layout packs it (zero padding:
  :func:`~wsync_grpc.core.packing.pack_bucket`), so its digest is the same;
- each reader is told (bucket index, slot, size); meanwhile the trainer hashes the slot (when the
  update's digests follow: ``job.on_digest``) and then packs the next bucket into the other slot;
- a bucket whose tensors all live in this process's shared memory already (CPU, contiguous, in the wire
  dtype: ``Module.share_memory()``) is not packed (the zero-copy path, on unless
  :attr:`SharedMemorySender.storages` is false): each reader is told it comes from storages and gets
  read-only descriptors of them with the reads that place each tensor in the bucket
  (:mod:`~wsync_grpc.transports.shared_memory.storages`); the trainer hashes it from its own memory;
  :attr:`SharedMemorySender.last_send` counts the buckets of each kind;
- a bucket is reported sent (``job.on_sent``) once every reader acknowledged it;
- the waits look at ``job.cancel`` every :data:`~wsync_grpc.transports.shared_memory.protocol.POLL_S`
  seconds and give up after the send site's ``timeout_s`` (the client's group timeout) without an
  acknowledgement; a reader that
  closes its socket before the last bucket fails the send (its engine abandoned the update).

A sharded trainer's direct sends (``job.topology.kind == "direct"``; the peers are :class:`RankRings`): every rank
has a sender of its own (rank 0 this one; the others their follower's), and each opens a ring for its own buckets
(:meth:`SharedMemorySender.open_own`) in a round of the ranks that hands rank 0 every handle for the header's
``shared_memory_ranks``; then each sends its own buckets through its ring (:meth:`SharedMemorySender.send_own`) while
the others send theirs. The digests are the ranks' own, exchanged before Prepare, as for a direct broadcast.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import torch

from wsync_grpc.core.digests import Digest, digest_of
from wsync_grpc.core.errors import Cancelled, DataLoss, GroupTimeout, Unavailable
from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.packing import pack_bucket
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.transports.sending import SendJob, SendSite, TrainerPeers
from wsync_grpc.transports.shared_memory.backing import RingMemory, RingMemoryKind
from wsync_grpc.transports.shared_memory.handover import MEMFD, Handover, page_round
from wsync_grpc.transports.shared_memory.protocol import ACK, BUCKET, POLL_S, boot_id
from wsync_grpc.transports.shared_memory.storages import (
    STORAGE_SLOT,
    SendCounts,
    StorageBucket,
    StorageFds,
    may_read,
    opened_read_only,
    send_group,
)

log = logging.getLogger(__name__)

SLOTS = 2
"""Ring slots of a segment: the trainer packs one while the engines copy the other."""


class Ring:
    """One update's send through a ring's slots to its readers (see the module).

    Args:
        segment: the ring's memory (a memfd :class:`~wsync_grpc.transports.shared_memory.handover.Segment`, or GPU
            memory: :mod:`wsync_grpc.transports.cuda_ipc.memory`).
        readers: one connected socket per engine worker (a timeout of at most ``POLL_S`` set).
        job: the update.
        timeout_s: the longest wait for an acknowledgement, in seconds.
        storages: the look-up of the trainer's shared-memory storages, for buckets the engines read from them
            (:mod:`~wsync_grpc.transports.shared_memory.storages`); ``None``: every bucket is packed into a slot.
        helper: a thread that copies half of each large tensor as a bucket is packed (``pack_bucket``'s); ``None``:
            packing on this thread alone.
    """

    def __init__(
        self,
        segment: RingMemory,
        readers: Sequence[socket.socket],
        job: SendJob,
        timeout_s: float,
        storages: StorageFds | None = None,
        helper: Executor | None = None,
    ) -> None:
        self.segment = segment
        self.readers = list(readers)
        self.job = job
        self.timeout_s = timeout_s
        self.storages = storages
        self._helper = helper
        self.counts = SendCounts()
        """What the send did with its buckets (packed, or read from the trainer's storages)."""
        self.buckets = list(job.buckets)
        self.acked = [0] * len(self.readers)
        """Per reader: how many buckets it acknowledged (in index order)."""
        self.posted = 0
        """Buckets told to every reader."""
        self.reported = 0
        """Buckets reported sent (``job.on_sent``)."""
        self.sent = 0
        """Bytes every reader acknowledged, in bytes."""
        self._partial = [b""] * len(self.readers)
        self._selector = selectors.DefaultSelector()
        for i, r in enumerate(self.readers):
            self._selector.register(r, selectors.EVENT_READ, i)

    def run(self) -> float:
        """Send every bucket; returns the time spent packing, in seconds.

        Raises:
            Cancelled: ``job.cancel`` was set.
            GroupTimeout: the readers did not acknowledge a bucket within ``timeout_s``.
            Unavailable: SHARED_MEMORY_READER_LOST, a reader closed its socket before the last bucket.
            DataLoss: SHARED_MEMORY_PROTOCOL, a reader acknowledged another bucket than the next.
        """
        try:
            return self._run()
        finally:
            self._selector.close()

    def _run(self) -> float:
        job, segment = self.job, self.segment
        pack_s = 0.0
        for pos, b in enumerate(self.buckets):
            self._check_cancel()
            self._wait(pos - segment.slots + 1)  # the bucket that was in this slot was copied out everywhere
            slot = pos % segment.slots
            tensors = job.tensors(b)
            storages = self.storages.plan(b, tensors) if self.storages is not None else None
            if storages is not None:  # the engines read the trainer's own storages: nothing packed
                self._post_storages(storages)
                continue
            t = time.monotonic()
            buf = segment.slot(slot, b.size_bytes)
            try:
                pack_bucket(b, tensors, buf, zero_padding=True, helper=self._helper)  # padding zeroed: no stale bytes
                segment.packed(slot)  # in the ring (a GPU's stream synchronized) before the readers are told
                pack_s += time.monotonic() - t
                del tensors
                self.counts.packed_buckets += 1
                self.counts.packed_bytes += b.size_bytes
                self._tell(BUCKET.pack(b.index, slot, b.size_bytes))
                self.posted += 1
                if job.on_digest is not None:  # hashed while the readers copy it (both only read the slot)
                    job.on_digest(b, digest_of([buf]))
            finally:
                del buf  # not even a failed send's traceback keeps a view of the ring (its mapping) alive
            self._read(0.0)
        self._wait(len(self.buckets))
        return pack_s

    def _post_storages(self, storages: StorageBucket) -> None:
        """Tell every reader that ``storages``' bucket is to be read from the trainer's storages, then send its
        groups (read-only descriptors opened per group, closed once every reader has them); hash it meanwhile.

        Raises:
            Unavailable: SHARED_MEMORY_READER_LOST.
            OSError: a storage's descriptor could not be re-opened read-only.
        """
        b = storages.bucket
        self._tell(BUCKET.pack(b.index, STORAGE_SLOT, b.size_bytes))
        groups = list(storages.groups())
        for g, (fds, reads) in enumerate(groups):
            with opened_read_only(fds) as ro:
                for i, r in enumerate(self.readers):
                    try:
                        send_group(r, b.index, ro, reads, g == len(groups) - 1, self.timeout_s)
                    except OSError as e:
                        raise self._lost(i, str(e)) from e
        self.posted += 1
        self.counts.storage_buckets += 1
        self.counts.storage_bytes += b.size_bytes
        if self.job.on_digest is not None:  # hashed from the trainer's memory while the readers read it
            self.job.on_digest(b, storages.digest())
        self._read(0.0)

    def _tell(self, message: bytes) -> None:
        """Send ``message`` to every reader.

        Raises:
            Unavailable: SHARED_MEMORY_READER_LOST.
        """
        for i, r in enumerate(self.readers):
            try:
                r.sendall(message)
            except OSError as e:
                raise self._lost(i, str(e)) from e

    def _check_cancel(self) -> None:
        if self.job.cancel.is_set():
            raise Cancelled("the update was cancelled")

    def _lost(self, i: int, why: str) -> Unavailable:
        return Unavailable(
            "SHARED_MEMORY_READER_LOST",
            f"engine worker {i} of {len(self.readers)} left after {self.acked[i]} of {len(self.buckets)} buckets "
            f"({why}): its engine abandoned the update, or died",
        )

    def _wait(self, count: int) -> None:
        """Until every reader acknowledged ``count`` buckets (nothing when ``count`` <= 0).

        Raises:
            Cancelled, GroupTimeout, Unavailable, DataLoss: see :meth:`run`.
        """
        deadline = time.monotonic() + self.timeout_s
        while min(self.acked) < count:
            self._check_cancel()
            if self._read(POLL_S):
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                b = self.buckets[min(self.acked)]
                raise GroupTimeout(f"the engine workers did not copy bucket {b.index} out within {self.timeout_s:g} s")

    def _read(self, wait_s: float) -> bool:
        """Take in the acknowledgements that came within ``wait_s`` seconds and report the buckets every reader
        acknowledged; whether any came."""
        came = False
        for key, _ in self._selector.select(wait_s):
            i = int(key.data)
            sock = self.readers[i]
            try:
                data = sock.recv(4096)
            except (BlockingIOError, TimeoutError):
                continue
            except OSError as e:
                raise self._lost(i, str(e)) from e
            if not data:
                if self.acked[i] < len(self.buckets):
                    raise self._lost(i, "it closed its socket")
                self._selector.unregister(sock)
                continue
            buffered = self._partial[i] + data
            whole = len(buffered) - len(buffered) % ACK.size
            for (index,) in ACK.iter_unpack(buffered[:whole]):
                n = self.acked[i]
                if n >= self.posted or index != self.buckets[n].index:
                    expected = f"bucket {self.buckets[n].index}" if n < self.posted else "no bucket"
                    raise DataLoss(
                        "SHARED_MEMORY_PROTOCOL",
                        f"engine worker {i} acknowledged bucket {index}; {expected} was due",
                        bucket=str(index),
                    )
                self.acked[i] = n + 1
                came = True
            self._partial[i] = buffered[whole:]
        done = min(self.acked)
        while self.reported < done:
            b = self.buckets[self.reported]
            self.reported += 1
            self.sent += b.size_bytes
            if self.job.on_sent is not None:
                self.job.on_sent(b, self.sent)
        return came


@runtime_checkable
class RankRings(TrainerPeers, Protocol):
    """The trainer's ranks when every one of them sends its own buckets from a ring of its own (a sharded trainer's
    ``direct`` topology through shared memory): what the shared-memory sender asks of them besides
    :class:`~wsync_grpc.transports.sending.TrainerPeers`. The ranks' coordination is the trainer's (the rank rounds of
    :mod:`wsync_grpc.trainer.sharded.rounds`).
    """

    def direct_digests(self, job: SendJob) -> Mapping[int, Digest]:
        """Every bucket's digest, each hashed by the rank that sends it, exchanged before Prepare.

        Raises:
            Exception: a rank failed to hash its buckets or is gone.
        """
        ...

    def direct_rings(
        self, job: SendJob, own: Callable[[SendJob, int], SharedMemoryHandle]
    ) -> Sequence[SharedMemoryHandle]:
        """Every rank opens its ring for its own buckets of ``job`` (this one with ``own(job, rank)``, the others
        with their own sender's :meth:`SharedMemorySender.open_own`); the handles, entry ``r`` trainer rank ``r``'s.

        Raises:
            Exception: a rank could not open its ring, or is gone.
        """
        ...

    def direct_ring_send(self, job: SendJob, own: Callable[[SendJob, int], float]) -> float:
        """Every rank sends its own buckets of ``job`` through its ring (this one with ``own(job, rank)``); returns
        once every rank's sends ended. Returns this rank's packing time, in seconds.

        Raises:
            Exception: a rank's sends failed or it is gone (this rank's own sends stop at once).
        """
        ...


class SharedMemorySender:
    """The shared-memory transport's trainer half (a :class:`~wsync_grpc.transports.sending.TransportSender`).

    Args:
        site: where it runs (one trainer process, or a sharded trainer's rank 0 whose ranks gather each bucket
            with it: the segment is this process's); ``site.timeout_s`` bounds the wait for the engines'
            acknowledgement of a bucket, in seconds.
        slots: the ring's slots (at least 2).
        storages: offer the engines the zero-copy path: a bucket whose tensors all live in this process's shared
            memory (CPU, contiguous, in the wire dtype) is read by the engines straight from their storages, not
            packed (:mod:`~wsync_grpc.transports.shared_memory.storages`). Offered in an update's handle
            (``storages``, which an engine of a wsync without the path refuses) only when some bucket of a trainer
            of one process may go that way. ``False``: every bucket through the ring. Settable between updates
            (:attr:`storages`). Never offered where ``memory`` has no such path (GPU memory).
        memory: what backs the ring (:mod:`~wsync_grpc.transports.shared_memory.backing`): a memfd (default,
            ``TRANSPORT_SHARED_MEMORY``) or GPU memory (:data:`wsync_grpc.transports.cuda_ipc.memory.CUDA_RING`,
            ``TRANSPORT_CUDA_IPC``).
    """

    def __init__(
        self, site: SendSite, *, slots: int = SLOTS, storages: bool = True, memory: RingMemoryKind = MEMFD
    ) -> None:
        if slots < 2:
            raise ValueError(f"a ring needs at least 2 slots, not {slots}")
        self._site = site
        self._slots = slots
        self._memory = memory
        self._segment: RingMemory | None = None
        self._handover: Handover | None = None
        self._helper: ThreadPoolExecutor | None = None
        self.storages = storages
        """Whether the next updates offer the zero-copy path (see the class)."""
        self.last_send = SendCounts()
        """What the last send did with its buckets: packed into the ring, or read from the trainer's storages
        (zero-copy); all 0 before the first send."""

    @property
    def segment(self) -> RingMemory | None:
        """The ring's memory kept between updates; ``None`` before the first update and after :meth:`release`."""
        return self._segment

    def check_send(
        self, buckets: Sequence[Bucket], tensors: Callable[[Bucket], Mapping[str, torch.Tensor]], topology: SendTopology
    ) -> None:
        """Whether the ring's memory can carry a send of ``buckets`` (e.g. CPU tensors over CUDA IPC cannot); called
        by the update runner before any call (:class:`~wsync_grpc.transports.sending.ChecksSend`).

        Raises:
            ValueError: it cannot.
        """
        self._memory.place_of(buckets, tensors, topology, self._site.device)

    def _check(self, job: SendJob) -> None:
        if job.layout is not Layout.FLATTENED:
            raise ValueError("shared memory carries the flattened layout only: bucket by bucket through its slots")
        if job.topology.ranks != self._site.peers.trainer_ranks:
            raise ValueError(
                f"a trainer of {self._site.peers.trainer_ranks} rank(s) cannot send {job.topology.kind} sends of "
                f"{job.topology.ranks} ranks"
            )
        if not job.buckets:
            raise ValueError("nothing to send: the update has no bucket")

    def _rank_rings(self) -> RankRings:
        """The peers, as ranks that each send their own buckets from a ring of their own (the direct topology).

        Raises:
            ValueError: they are one process (or cannot).
        """
        peers = self._site.peers
        if not isinstance(peers, RankRings):
            raise ValueError(
                f"a trainer of {peers.trainer_ranks} rank(s) without rings of its ranks cannot send 'direct' through "
                "shared memory"
            )
        return peers

    def header_fields(self, job: SendJob) -> Mapping[str, Any]:
        """``{"shared_memory": handle}``: the segment (kept, or a larger one made for ``job``'s largest bucket) and
        a fresh socket and token for this update's engine workers. A sharded trainer's direct sends:
        ``{"shared_memory_ranks": handles}``, one ring per rank, each rank's for its own buckets
        (:meth:`RankRings.direct_rings`, which calls :meth:`open_own` on every rank).

        Raises:
            ValueError: a layout or topology shared memory does not carry (individual; direct from a trainer of one
                process).
            Unavailable: SHARED_MEMORY_HOST, this host's boot id cannot be read.
            OSError: the segment or the socket could not be made.
            Exception: (direct) a rank could not open its ring, or is gone.
        """
        self._check(job)
        if job.topology.kind == "direct":
            return {"shared_memory_ranks": tuple(self._rank_rings().direct_rings(job, self.open_own))}
        # Offered only where some bucket may go as storage reads (one process's own tensors, looked at cheaply): an
        # engine of a wsync without the path refuses a handle that offers it.
        offer = (
            self.storages
            and self._memory.storages
            and job.topology.kind == "single"
            and any(may_read(b, job.tensors(b)) for b in job.buckets)
        )
        return {"shared_memory": self._open(job, offer)}

    def _open(self, job: SendJob, offer: bool) -> SharedMemoryHandle:
        """This process's ring for ``job``'s buckets (the segment kept, or a larger one for its largest bucket; one
        page when it has none) and a fresh handover; its handle (``offer``: the zero-copy path).

        Raises:
            Unavailable: SHARED_MEMORY_HOST.
            ValueError: the ring's memory cannot carry ``job`` (:meth:`check_send`).
            OSError: the segment or the socket could not be made.
            Exception: GPU memory could not be allocated (:class:`~wsync_grpc.transports.cuda_ipc.cudart.CudaError`).
        """
        self._end_handover()
        host = boot_id()
        if not host:
            raise Unavailable("SHARED_MEMORY_HOST", "this host's boot id cannot be read (/proc is needed)")
        place = None  # a rank of a direct send with no bucket of its own: any ring will do
        if job.buckets:
            place = self._memory.place_of(job.buckets, job.tensors, job.topology, self._site.device)
        needed = page_round(max((b.size_bytes for b in job.buckets), default=1))
        seg = self._segment
        if (
            seg is None
            or seg.slot_bytes < needed
            or seg.slots != self._slots
            or (place is not None and seg.place != place)
        ):
            self._close_segment()  # the old one goes before the larger one is made
            self._segment = seg = self._memory.allocate(needed, self._slots, place or "cpu")
        self._handover = Handover(seg, job.update_id, storages=offer)
        return self._handover.handle(host)

    def open_own(self, job: SendJob, rank: int) -> SharedMemoryHandle:
        """A sharded trainer's direct sends, on trainer rank ``rank`` (every rank, this one's sender): this rank's
        ring for its own buckets of ``job`` (those whose ``src`` is ``rank``; possibly none: a ring of one page that
        carries nothing) and a fresh handover, kept for :meth:`send_own`; its handle. No zero-copy path.

        Raises:
            Unavailable: SHARED_MEMORY_HOST.
            OSError: the segment or the socket could not be made.
        """
        return self._open(job.own(rank), False)

    def send_own(self, job: SendJob, rank: int) -> float:
        """A sharded trainer's direct sends, on trainer rank ``rank``: its own buckets of ``job`` through the ring
        :meth:`open_own` opened, to the engine workers connected by now (they read each bucket from the ring of its
        rank, in index order); their digests went before Prepare (``job.on_digest`` is not called). Returns the
        time spent packing, in seconds.

        Raises:
            as :meth:`send`.
        """
        own = dataclasses.replace(job.own(rank), on_digest=None)
        return self._send(own)

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """``None``: each bucket is hashed as it is packed, and its digest follows the Prepare. A sharded trainer's
        direct sends: every bucket's, each hashed by the rank that sends it, exchanged before Prepare
        (:meth:`RankRings.direct_digests`).

        Raises:
            Exception: (direct) a rank failed to hash its buckets, or is gone.
        """
        if job.topology.kind == "direct":
            return self._rank_rings().direct_digests(job)
        return None

    def send(self, job: SendJob) -> float:
        """Every bucket of ``job`` through the ring to the workers connected at Prepare (see the module); returns
        the time spent packing, in seconds. A sharded trainer's direct sends: every rank its own buckets through its
        own ring, at once (:meth:`RankRings.direct_ring_send`, which calls :meth:`send_own` on every rank).

        Raises:
            ValueError: :meth:`header_fields` was not called for this update, or a layout or topology shared
                memory does not carry.
            Unavailable: SHARED_MEMORY_NO_READER (no engine worker connected), SHARED_MEMORY_READER_LOST.
            Cancelled: ``job.cancel`` was set.
            GroupTimeout: a bucket was not acknowledged within the timeout.
            DataLoss: SHARED_MEMORY_PROTOCOL.
        """
        self._check(job)
        if job.topology.kind == "direct":
            return self._rank_rings().direct_ring_send(job, self.send_own)
        return self._send(job)

    def _send(self, job: SendJob) -> float:
        """Every bucket of ``job`` through the ring :meth:`_open` opened for it (see :meth:`send`)."""
        handover, self._handover = self._handover, None
        if handover is None or handover.update_id != job.update_id or self._segment is None:
            if handover is not None:
                handover.close()
            raise ValueError(f"no segment was handed over for update {job.update_id!r} (header_fields first)")
        readers = handover.take_readers()
        try:
            if not readers:
                raise Unavailable("SHARED_MEMORY_NO_READER", "no engine worker connected to take the segment")
            if not job.buckets:  # a rank of a direct send with no bucket of its own: nothing to wait for
                self.last_send = SendCounts()
                return 0.0
            ring = Ring(
                self._segment,
                readers,
                job,
                self._site.timeout_s,
                StorageFds() if handover.storages else None,
                self._pack_helper(),
            )
            self.last_send = ring.counts
            return ring.run()
        finally:
            for r in readers:
                r.close()

    def _end_handover(self) -> None:
        handover, self._handover = self._handover, None
        if handover is not None:
            handover.close()

    def _close_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()

    def _pack_helper(self) -> Executor:
        """The thread that packs half of each large tensor beside the sending one (``pack_bucket``'s ``helper``):
        the engines' copies out of the other slot take about as long, so two threads keep the ring full."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="wsync-shm-pack")
        return self._helper

    def release(self) -> None:
        """Close an open handover and drop the segment (the client closing, or an update abandoned: a send cut
        short may leave readers behind; the next update makes a fresh segment); end the packing thread."""
        self._end_handover()
        self._close_segment()
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=False)
