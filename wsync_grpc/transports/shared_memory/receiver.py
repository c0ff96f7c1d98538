"""The shared-memory transport's engine half: one thread per worker, copying each bucket out of the trainer's ring.

:class:`SharedMemoryReceiver`, at its start (while Prepare waits for the receivers to be armed):

1. connects to the trainer's abstract Unix socket (``SharedMemoryHandle.socket_name``) and checks that
   the process listening there is this worker's user (``SO_PEERCRED``; else PERMISSION_DENIED
   SHARED_MEMORY_PEER) before it sends anything;
2. sends the update's token and receives the segment's descriptor (``SCM_RIGHTS``) with the trainer's
   slots and slot size, which must be the handle's;
3. checks the descriptor: a regular file sealed against shrinking (``F_SEAL_SHRINK``: no page can vanish
   under the mapping, which would be a ``SIGBUS``; else INVALID_ARGUMENT SHARED_MEMORY_SEALS) of at least
   ``slots * slot_bytes`` bytes (else INVALID_ARGUMENT SHARED_MEMORY_SIZE), maps that many bytes
   read-only, closes the descriptor received at once (Python's :class:`mmap.mmap` keeps a duplicate of
   it until it unmaps), and is armed.

Then, for each declared bucket in index order: it waits for the trainer's word that the bucket is in a
slot, copies the slot into a flat buffer of its own (from the worker's
:class:`~wsync_grpc.worker.buffers.BufferPool`: the slot is reused for a later bucket), acknowledges it
at once (the trainer may pack a later bucket there) and hashes the copy when the update promised digests.
When the handle says ``storages``, a bucket may come instead as reads of the trainer's own shared-memory
storages (the zero-copy path, :class:`~wsync_grpc.transports.shared_memory.storages.StorageReader`): the worker
reads them with ``pread`` into the same kind of buffer (never mapping them: they are not sealed, and a storage its
owner shrinks is then an error, DATA_LOSS SHARED_MEMORY_STORAGE, not a ``SIGBUS``), zeroes the padding, closes
their descriptors and goes on as for a slot.
A bucket is used only once its digest is known and matched (DATA_LOSS BUCKET_DIGEST_MISMATCH otherwise,
nothing of it used): it loads its tensors (streaming) or keeps them for Complete (staged); a staged
bucket that is one tensor of the served dtype and shape, on an engine that offers
:class:`~wsync_grpc.core.engine.StorageSwap`, is copied into an exact-size buffer the engine serves
from Complete on, as the broadcast receiver does. A bucket is split as it is copied out of its slot when
every one of its tensors can be (:meth:`SharedMemoryReceiver._split`): staged, each into an exact-size
buffer the engine then serves (that engine's Complete copies nothing); streaming without digests, each straight into
the served tensor (:class:`~wsync_grpc.core.engine.InPlaceReceive`: one copy in all). The ring does not wait for
digests: they come in
``Update`` calls a moment after their buckets, so buckets copied out wait for theirs (staged: all of
them, they are kept anyway; streaming: at most :data:`PENDING_STREAMING`, their buffers) while the
next ones are copied. Once the last bucket is copied out, or the receive ends for any reason, the
mapping and the socket are closed: no mapping outlives the update.

Every wait looks at the update's cancel signal every
:data:`~wsync_grpc.transports.shared_memory.protocol.POLL_S` seconds and is bounded by the engine's group
timeout (``ReceivePlan.timeout_s``). A trainer that closes its socket (it died, or it gave up) ends the
receive with UNAVAILABLE SHARED_MEMORY_TRAINER_LOST; the update is then abandoned.

A sharded trainer's direct sends (``ReceivePlan.shared_memory_ranks``) come through one ring per trainer rank: the
worker opens every rank's ring as above (each checked alike), then takes the buckets in index order, each from the
ring of the rank that sends it (``Bucket.src``), acknowledging it on that ring's socket. Each rank's ring waits only
for the acknowledgements of its own buckets, which the worker gives in index order, so no ring waits on another.
Such buckets hold pieces of tensors: each piece is copied into its tensor
(:class:`~wsync_grpc.core.pieces.PieceAssembler`), loaded or staged once whole, as from a direct broadcast.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import itertools
import logging
import mmap
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from wsync_grpc.core.digests import BucketHasher, Digest, check_digest
from wsync_grpc.core.engine import InPlaceReceive
from wsync_grpc.core.errors import (
    Cancelled,
    DataLoss,
    GroupError,
    GroupTimeout,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    WsyncError,
)
from wsync_grpc.core.header import SharedMemoryHandle
from wsync_grpc.core.layout import Bucket, TensorSlot
from wsync_grpc.core.packing import tensor_views
from wsync_grpc.core.pieces import PieceAssembler
from wsync_grpc.core.update import ReceivePlan
from wsync_grpc.transports.shared_memory.backing import MappedSegment, RingView
from wsync_grpc.transports.shared_memory.protocol import (
    ACK,
    BUCKET,
    GRANT,
    MAGIC,
    MAGIC_CUDA,
    MAGIC_STORAGES,
    POLL_S,
    Closed,
    address,
    own_uid,
    peer_credentials,
    recv_exact,
    recv_fds,
)
from wsync_grpc.transports.shared_memory.storages import STORAGE_SLOT, StorageReader
from wsync_grpc.worker.delta import expand, loaded, staged
from wsync_grpc.worker.feed import digest_missing, digest_timeout
from wsync_grpc.worker.receiver import ReceiverThread, ReceiveSite
from wsync_grpc.worker.swaps import SwapIn, served_target

log = logging.getLogger(__name__)

_T = TypeVar("_T")

PENDING_STREAMING = 2
"""Streaming apply: buckets copied out that may wait for their digests (their buffers) before the receiver waits
for the oldest one's; the ring goes on meanwhile."""


class _NotYet:
    """What a look for a digest finds while it was not declared yet."""


_NOT_YET = _NotYet()


class SharedMemoryReceiver(ReceiverThread):
    """Copies one shared-memory update's buckets out of the trainer's segment for one worker (a
    :class:`~wsync_grpc.worker.receiver.Receiver`; see the module).

    Args:
        site: where it runs (no group); its buffers come from ``site.pool``, on ``site.device``.
        plan: the update: its handle (``plan.shared_memory``, required), apply mode, digests and ``timeout_s``
            (the bound of each wait, in seconds).

    Raises:
        ValueError: ``plan`` has no shared-memory handle (the part's header check refuses such a header).
    """

    def __init__(self, site: ReceiveSite, plan: ReceivePlan) -> None:
        rings = plan.shared_memory_rings
        if not rings:
            raise ValueError("a shared-memory receiver needs the header's shared_memory (or shared_memory_ranks)")
        super().__init__(f"wsync-shm-reader-{site.worker}", site, plan)
        self.handle: SharedMemoryHandle = rings[0]
        """The first ring's handle (the only one, unless a sharded trainer's ranks each send from a ring)."""
        self._rings = [_Ring(r, h) for r, h in enumerate(rings)]
        self._pieces = PieceAssembler(site.device)  # pieces of a sharded trainer's direct sends
        self.device = site.device
        self.pool = site.pool
        self._timeout_s = plan.timeout_s
        self._digests_follow = plan.digests_follow
        self._held: list[torch.Tensor] = []  # staged: the flat buffers behind self.staged
        self._pending: collections.deque[_Received] = collections.deque()  # copied out, not used yet
        self._in_place = site.target if self.streaming and isinstance(site.target, InPlaceReceive) else None
        self.swap_in = SwapIn(site.target, self.device, self.streaming)
        """Staged apply on a :class:`~wsync_grpc.core.engine.StorageSwap` engine: lone tensors copied into buffers
        it serves as they are."""

    @property
    def timeout_s(self) -> float:
        """The bound of one wait (the segment, a bucket, a digest), in seconds."""
        return self._timeout_s

    @property
    def mapped(self) -> bool:
        """Whether a trainer's ring is mapped (or opened, in GPU memory) in this process now."""
        return any(r.view is not None for r in self._rings)

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        try:
            self._open()
            self.armed.set()
            self.first_post_at = time.monotonic()
            for i in itertools.count():
                bucket = self._poll(functools.partial(self.feed.get, i), f"no bucket {i} was declared")
                if bucket is None:
                    break
                self._bucket(i, bucket)
            self._settle(0)  # every bucket received is checked and used before the receive is done
        except BaseException as e:
            if isinstance(e, WsyncError):
                log.warning("shared-memory receiver of worker %d: %s %s", self.worker, e.reason, e.message)
            elif not isinstance(e, GroupError | GroupTimeout | Cancelled):
                log.exception("shared-memory receiver of worker %d failed", self.worker)
            self.error = e
        finally:
            self._close()
            self.armed.set()
            self.done.set()
            self.on_event(self)

    def _poll(self, fetch: Callable[[float], _T], what: str) -> _T:
        """``fetch(wait)`` (which raises :class:`GroupTimeout` when nothing came within ``wait`` seconds) until it
        answers, looking for a cancel at least every ``POLL_S``.

        Raises:
            Cancelled: the update was cancelled meanwhile.
            GroupTimeout: ``timeout_s`` passed without an answer (``what`` says what did not come).
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            if self.cancel.is_set():
                raise Cancelled("the update was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupTimeout(f"{what} within {self._timeout_s:g} s")
            try:
                return fetch(min(left, POLL_S))
            except GroupTimeout:
                continue

    # ------------------------------------------------------------------ the handover

    def _open(self) -> None:
        """Open every ring of the update (see :meth:`_open_ring`), in rank order; rings in GPU memory
        (``TRANSPORT_CUDA_IPC``) once each one's device was found to be this worker's, before anything is connected.

        Raises:
            InvalidArgument: CUDA_IPC_DEVICE (:func:`wsync_grpc.transports.cuda_ipc.memory.locate`).
            as :meth:`_open_ring`.
        """
        for ring in self._rings:
            m = ring.handle.cuda_ipc
            if m is not None:
                from wsync_grpc.transports.cuda_ipc.memory import locate  # the CUDA backing, imported when named

                ring.cuda_index = locate(m, self.device)
        for ring in self._rings:
            self._open_ring(ring)

    def _open_ring(self, ring: _Ring) -> None:
        """Connect, check the trainer, send the token, map the segment it hands over (see the module).

        Raises:
            Unavailable: SHARED_MEMORY_CONNECT, SHARED_MEMORY_HANDOVER, CUDA_IPC_OPEN.
            PermissionDenied: SHARED_MEMORY_PEER.
            InvalidArgument: SHARED_MEMORY_SEALS, SHARED_MEMORY_SIZE.
            DataLoss: SHARED_MEMORY_PROTOCOL.
            Cancelled, GroupTimeout: while waiting for the segment.
        """
        h = ring.handle
        sock = ring.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(address(h.socket_name))
        except OSError as e:
            raise Unavailable(
                "SHARED_MEMORY_CONNECT",
                f"cannot reach the trainer's socket {h.socket_name!r} ({e}): the trainer must run on this host, "
                "in this network namespace (abstract Unix sockets belong to one), and still be there",
            ) from e
        pid, uid = peer_credentials(sock)
        if uid != own_uid():
            raise PermissionDenied(
                "SHARED_MEMORY_PEER",
                f"the process behind socket {h.socket_name!r} (pid {pid}) runs as user {uid}, not as this engine's "
                f"user {own_uid()}: it is not taken as the trainer",
            )
        sock.settimeout(POLL_S)
        try:
            sock.sendall(h.token)
        except OSError as e:
            raise self._trainer_lost(f"sending the token failed: {e}") from e
        fd = self._grant(ring)
        if fd is None:  # GPU memory, named by the handle: opened by its CUDA IPC handle on the device located
            from wsync_grpc.transports.cuda_ipc.memory import CudaIpcView

            assert h.cuda_ipc is not None and ring.cuda_index is not None
            ring.view = CudaIpcView(h.cuda_ipc, ring.cuda_index)
            return
        try:
            ring.view = MappedSegment(self._map_segment(h, fd))
        finally:
            os.close(fd)  # the mapping holds the memory (and mmap's own duplicate of fd, closed as it unmaps)
        if h.storages:  # buckets may also come as reads of the trainer's own storages
            ring.storages = StorageReader(sock, self.cancel, self._timeout_s, self.worker)

    def _trainer_lost(self, why: str) -> Unavailable:
        return Unavailable(
            "SHARED_MEMORY_TRAINER_LOST",
            f"the trainer's shared-memory socket closed ({why}): the trainer gave the update up, or died",
        )

    def _grant(self, ring: _Ring) -> int | None:
        """The segment's descriptor, once the trainer granted it (the caller closes it); ``None`` for a ring in GPU
        memory (``cuda_ipc``: its grant comes with no descriptor).

        Raises:
            Unavailable: SHARED_MEMORY_HANDOVER, the trainer closed the socket instead.
            DataLoss: SHARED_MEMORY_PROTOCOL, another message than a grant of the handle's slots.
            Cancelled, GroupTimeout.
        """
        sock, h = ring.sock, ring.handle
        assert sock is not None
        try:
            msg, fds, flags = recv_fds(sock, GRANT.size, 1, self.cancel, self._timeout_s, "the trainer's segment")
        except OSError as e:
            raise Unavailable("SHARED_MEMORY_HANDOVER", f"receiving the segment failed: {e}") from e
        if not msg and not fds:
            raise Unavailable(
                "SHARED_MEMORY_HANDOVER",
                "the trainer closed the socket without handing the segment over (it refused this worker, or gave "
                "the update up)",
            )
        bad = ""
        cuda = h.cuda_ipc is not None
        if flags & socket.MSG_CTRUNC or len(fds) != (0 if cuda else 1) or len(msg) != GRANT.size:
            bad = f"{len(msg)} bytes and {len(fds)} descriptor(s) (flags {flags:#x})"
        else:
            magic, slots, slot_bytes = GRANT.unpack(msg)
            expected = MAGIC_CUDA if cuda else MAGIC_STORAGES if h.storages else MAGIC
            if magic != expected or slots != h.slots or slot_bytes != h.slot_bytes:
                bad = f"a grant of {slots} x {slot_bytes} bytes (magic {magic!r})"
        if bad:
            for fd in fds:
                os.close(fd)
            raise DataLoss(
                "SHARED_MEMORY_PROTOCOL",
                f"the trainer's socket sent {bad}, not a grant of the segment the header names "
                f"({h.slots} slots of {h.slot_bytes} bytes)",
            )
        return int(fds[0]) if fds else None

    def _map_segment(self, h: SharedMemoryHandle, fd: int) -> mmap.mmap:
        """Check the segment ``fd`` and map the handle ``h``'s bytes of it read-only.

        Raises:
            InvalidArgument: SHARED_MEMORY_SEALS, SHARED_MEMORY_SIZE.
            Unavailable: SHARED_MEMORY_HANDOVER, it cannot be mapped.
        """
        st = os.fstat(fd)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
        except OSError:
            seals = 0  # not a memfd: it takes no seals
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument(
                "SHARED_MEMORY_SEALS",
                "the segment handed over is not a memfd sealed against shrinking (F_SEAL_SHRINK): pages could "
                "vanish under the mapping",
            )
        if st.st_size < h.segment_bytes:
            raise InvalidArgument(
                "SHARED_MEMORY_SIZE",
                f"the segment handed over holds {st.st_size} bytes; the header names {h.slots} slots of "
                f"{h.slot_bytes} bytes ({h.segment_bytes} bytes)",
            )
        try:
            return mmap.mmap(fd, h.segment_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except OSError as e:
            raise Unavailable("SHARED_MEMORY_HANDOVER", f"mapping the segment failed: {e}") from e

    def _close(self) -> None:
        """Unmap every ring and close every socket (idempotent; from the receiver's thread). A ring in GPU memory
        that CUDA fails to close is logged (the receive's own outcome stands)."""
        for ring in self._rings:
            try:
                viewed = ring.close()
            except Exception:
                log.exception("shared-memory receiver of worker %d: closing the trainer's ring failed", self.worker)
                continue
            if viewed:
                log.warning("shared-memory receiver of worker %d: the segment is still viewed", self.worker)

    # ------------------------------------------------------------------ the buckets

    def _bucket(self, i: int, bucket: Bucket) -> None:
        """Copy bucket ``bucket`` (the ``i``-th) out of its slot in the ring of its sending rank (``bucket.src``),
        acknowledge it there, hash it; then use every bucket received whose digest is known (see :meth:`_settle`).

        Raises:
            Unavailable: SHARED_MEMORY_TRAINER_LOST.
            DataLoss: SHARED_MEMORY_PROTOCOL, BUCKET_DIGEST_MISMATCH.
            DeadlineExceeded, InvalidArgument: DIGEST_TIMEOUT, DIGEST_MISSING.
            Cancelled, GroupTimeout.
        """
        ring = self._rings[bucket.src]  # the part's plan refused a bucket whose src names no ring
        sock, h = ring.sock, ring.handle
        assert sock is not None
        what = f"trainer rank {bucket.src}'s word of bucket {bucket.index}"
        try:
            message = recv_exact(sock, BUCKET.size, self.cancel, self._timeout_s, what)
        except Closed as e:
            raise self._trainer_lost(str(e)) from e
        index, slot, nbytes = BUCKET.unpack(message)
        from_storages = slot == STORAGE_SLOT and ring.storages is not None
        if index != bucket.index or (slot >= h.slots and not from_storages) or nbytes != bucket.size_bytes:
            raise DataLoss(
                "SHARED_MEMORY_PROTOCOL",
                f"the trainer put bucket {index} ({nbytes} bytes) in slot {slot}; bucket {bucket.index} "
                f"({bucket.size_bytes} bytes) in one of {h.slots} slots was due",
                bucket=str(bucket.index),
            )
        if (not from_storages or self.device.type == "cpu") and (split := self._split(bucket)) is not None:
            self._split_out(i, bucket, ring, None if from_storages else slot, split)
            return
        swap = self.swap_in.swappable(bucket.lone)
        if swap:
            flat = self.pool.take_exact(bucket.size_bytes)
        else:
            flat = self.pool.take(bucket.size_bytes, self.feed.max_size_bytes if self.streaming else 0)
        received = _Received(bucket, flat, swap)
        self._pending.append(received)  # released with the others from here on
        if from_storages:
            assert ring.storages is not None
            try:
                ring.storages.read_bucket(bucket, flat)  # read (never mapped) from the trainer's own storages
            except Closed as e:
                raise self._trainer_lost(str(e)) from e
        else:
            ring.copy(slot, flat)
        self._acknowledge(ring, index)
        if self.feed.closed and i + 1 >= len(self.feed):
            self._close()  # the last bucket is out: no mapping outlives the transfer
        if bucket.has_delta:  # made whole (a copy of each served tensor it changes), then checked as whole
            hasher = BucketHasher()
            received.whole = expand(flat, bucket, self.target, lambda t: self.swap_in.buffer_for(t, self.pool), hasher)
            received.digest = hasher.digest()
        elif self._checked(bucket):
            hasher = BucketHasher()
            hasher.update(flat)
            received.digest = hasher.digest()
        self._settle(PENDING_STREAMING if self.streaming else None)

    def _split(self, bucket: Bucket) -> list[torch.Tensor] | None:
        """Where each tensor of ``bucket`` goes when the bucket is split as it is copied out of its slot: staged, an
        exact-size buffer per tensor that the engine serves at Complete (:meth:`SwapIn.swappable
        <wsync_grpc.worker.swaps.SwapIn.swappable>` for every tensor); streaming without a digest to wait for, the
        served tensors themselves (:func:`~wsync_grpc.worker.swaps.served_target` for every tensor), each as 1-D
        ``uint8`` of the tensor's bytes. ``None``: copy the bucket whole into a buffer, as usual (a delta, pieces,
        any tensor that cannot be split out; staged, a lone tensor, which that buffer already is)."""
        tensors = bucket.tensors
        if not tensors or bucket.has_delta or (len(tensors) < 2 and not self.streaming):
            return None  # staged, a lone tensor is swapped in whole (SwapIn.swappable): the same thing
        if not self.streaming:
            if not all(t.nbytes and self.swap_in.swappable(t) for t in tensors):
                return None
            return [self.pool.take_exact(t.nbytes) for t in tensors]
        if self._checked(bucket):
            return None  # streaming with a digest: nothing is written before it is checked
        served = [served_target(self._in_place, self.worker, self.device, t) for t in tensors]
        if any(w is None for w in served):
            return None
        self.wrote_served = True  # before the first byte lands
        return [w.view(-1).view(torch.uint8) for w in served if w is not None]

    def _split_out(self, i: int, bucket: Bucket, ring: _Ring, slot: int | None, split: list[torch.Tensor]) -> None:
        """Copy each tensor of bucket ``bucket`` (the ``i``-th) out of slot ``slot`` into ``split`` (:meth:`_split`),
        hashing the bucket's bytes in order (the padding between tensors read from the slot too) when it is checked,
        or (``slot`` ``None``: the zero-copy path) read each from the trainer's storages, the padding hashed as the
        zeros it is; acknowledge it; then use what is ready (:meth:`_settle`).

        Raises:
            as :meth:`_bucket`.
        """
        parts = list(zip(bucket.tensors, split, strict=True))
        received = _Received(bucket, None, False, parts=parts, in_place=self.streaming)
        self._pending.append(received)  # a staged one's buffers are released with the others from here on
        hasher = BucketHasher() if self._checked(bucket) else None
        if slot is None:
            assert ring.storages is not None
            try:
                ring.storages.read_bucket(bucket, None, split)  # read (never mapped) from the trainer's storages
            except Closed as e:
                raise self._trainer_lost(str(e)) from e
        at = 0
        for t, buf in sorted(parts, key=lambda p: p[0].offset):
            if hasher is not None:
                self._hash_padding(hasher, ring, slot, at, t.offset)
            if slot is not None:
                ring.copy(slot, buf, t.offset)
            if hasher is not None:
                hasher.update(buf)
            at = max(at, t.end)
        if hasher is not None:
            self._hash_padding(hasher, ring, slot, at, bucket.size_bytes)
        self._acknowledge(ring, bucket.index)
        if self.feed.closed and i + 1 >= len(self.feed):
            self._close()
        if hasher is not None:
            received.digest = hasher.digest()
        self._settle(PENDING_STREAMING if self.streaming else None)

    def _checked(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` is checked against a digest (its spec's, or one declared after it)."""
        return bucket.digest is not None or self._digests_follow

    def _hash_padding(self, hasher: BucketHasher, ring: _Ring, slot: int | None, start: int, end: int) -> None:
        """Hash a bucket's bytes ``start`` to ``end`` (padding between its tensors; none when ``end <= start``): read
        from slot ``slot``, or the zeros they are when the bucket came from the trainer's storages (``None``)."""
        if end <= start:
            return
        if slot is None:
            hasher.zeros(end - start)
            return
        gap = torch.empty(end - start, dtype=torch.uint8, device=self.device)
        ring.copy(slot, gap, start)
        hasher.update(gap)

    def _acknowledge(self, ring: _Ring, index: int) -> None:
        """Tell ring ``ring``'s trainer that bucket ``index`` is out of its slot.

        Raises:
            Unavailable: SHARED_MEMORY_TRAINER_LOST.
        """
        assert ring.sock is not None
        try:
            ring.sock.sendall(ACK.pack(index))
        except OSError as e:
            raise self._trainer_lost(f"acknowledging bucket {index} failed: {e}") from e
        self.last_arrival_at = time.monotonic()

    def _settle(self, keep: int | None) -> None:
        """Use the buckets received, in order, whose digest is known (or that have none to wait for); then, while
        more than ``keep`` wait for theirs, wait for the oldest one's (``None``: wait for none; 0: for all).

        Streaming apply keeps at most :data:`PENDING_STREAMING` buckets waiting (their buffers); staged apply keeps
        every bucket until Complete anyway, so the ring never waits for a digest while buckets still come.

        Raises:
            DataLoss: BUCKET_DIGEST_MISMATCH, nothing of that bucket was used.
            DeadlineExceeded, InvalidArgument, Cancelled: see :meth:`_expected`.
        """
        while self._pending:
            head = self._pending[0]
            wait = keep is not None and len(self._pending) > keep
            expected = self._expected(head.bucket, wait)
            if expected is _NOT_YET:
                return
            if expected is not None:
                assert isinstance(expected, Digest) and head.digest is not None
                check_digest(head.bucket.index, expected, head.digest)  # DataLoss: nothing of the bucket is used
                self.buckets_verified += 1
            self._pending.popleft()
            self._use(head)
            self.bytes_done += head.bucket.size_bytes
            self.buckets_done += 1
            self.on_event(self)

    def _expected(self, bucket: Bucket, wait: bool) -> Digest | _NotYet | None:
        """``bucket``'s digest: its spec's, or the one declared after it; ``None``: none promised; :data:`_NOT_YET`:
        not declared yet (only when not ``wait``ing for it).

        Raises:
            DeadlineExceeded: DIGEST_TIMEOUT.
            InvalidArgument: DIGEST_MISSING, the declarations ended (Complete) without it.
            Cancelled: the update was cancelled meanwhile.
        """
        if bucket.digest is not None or not self._digests_follow:
            return bucket.digest
        try:
            if wait:
                digest = self._poll(
                    lambda w: self.feed.digest(bucket.index, w), f"bucket {bucket.index}'s digest was not declared"
                )
            else:
                digest = self.feed.digest(bucket.index, 0)
        except GroupTimeout as e:
            if not wait:
                return _NOT_YET
            raise digest_timeout(bucket.index, self._timeout_s) from e
        if digest is None:
            raise digest_missing(bucket.index)
        return digest

    def _use(self, received: _Received) -> None:
        """Load a checked bucket's tensors (streaming), or keep them for Complete (staged: as views of its buffer,
        or its one tensor to swap in)."""
        bucket, flat = received.bucket, received.flat
        if received.parts is not None:  # split out of its slot
            if received.in_place:  # streaming: written into the served tensors as it was copied out
                self.tensors_applied += len(received.parts)
                return
            for t, buf in received.parts:
                self.swap_in.add(t, buf)
            return
        assert flat is not None
        if received.swap:
            self.swap_in.add(bucket.tensors[0], flat)
            return
        views = True  # whether what is used views ``flat`` (pieces are copied into their tensors)
        if received.whole is not None:
            pieces = self._pieces
            named = loaded(received.whole, pieces) if self.streaming else staged(received.whole, self.swap_in, pieces)
        elif all(t.piece is None for t in bucket.tensors):
            named = tensor_views(flat, bucket.tensors)
        else:  # a sharded trainer's direct sends: whole tensors viewed, pieces copied into their tensors
            named = tensor_views(flat, [t for t in bucket.tensors if t.piece is None])
            views = bool(named)
            for t in bucket.tensors:
                if t.piece is not None and t.load:
                    whole = self._pieces.add(t, flat[t.offset : t.end].view(t.dtype).view(t.shape))
                    if whole is not None:
                        named.append(whole)
        if self.streaming:
            if named:
                self.wrote_served = True
                with self.target.weights_lock():
                    self.tensors_applied += self.target.load_weights(self.worker, named)
            self.pool.give(flat)
        else:
            self.staged.append(named)  # views of this bucket's own buffer (or whole tensors), kept until Complete
            if views:
                self._held.append(flat)
            else:  # every tensor was copied out (pieces): the buffer is free again
                self.pool.give(flat)

    def apply_swaps(self) -> int:
        """Staged apply: hand the tensors copied to swap in to the engine to serve (:meth:`SwapIn.apply
        <wsync_grpc.worker.swaps.SwapIn.apply>`); the tensors swapped. The caller holds the engine's weights lock."""
        return self.swap_in.apply(self.worker, self.pool)

    def release(self, reuse: bool) -> None:
        """Let go of the buffers received (after apply, or when the update is abandoned).

        Args:
            reuse: return them to the pool (nothing writes into them once the thread ended).
        """
        held = self._held + self.swap_in.clear() + [b for r in self._pending for b in r.buffers()]
        self._held, self.staged = [], []
        self._pending.clear()
        self._pieces.clear()
        if reuse:
            for buf in held:
                self.pool.give(buf)
        self.pool.trim(keep_earlier=self.delta)  # a delta: the last whole update's buffers stay


@dataclass
class _Received:
    """A bucket copied out of the ring, waiting for its digest before it is used.

    Attributes:
        bucket: the bucket.
        flat: its bytes (a buffer of the worker's pool); ``None`` when split (``parts``).
        swap: its one tensor is served from ``flat`` at Complete.
        digest: the digest of ``flat`` (of ``whole``, for a delta bucket), when the bucket is checked; ``None``
            otherwise.
        whole: a delta bucket's tensors made whole (:func:`~wsync_grpc.worker.delta.expand`); ``None`` otherwise.
        parts: a bucket split out of its slot (:meth:`SharedMemoryReceiver._split`): each tensor and where it was
            copied: an exact-size buffer of the pool, served from Complete on, or (``in_place``) the served tensor
            itself; ``None`` otherwise.
        in_place: ``parts`` are the served tensors (streaming), no buffers of the pool.
    """

    bucket: Bucket
    flat: torch.Tensor | None
    swap: bool
    digest: Digest | None = None
    whole: list[tuple[TensorSlot, torch.Tensor]] | None = None
    parts: list[tuple[TensorSlot, torch.Tensor]] | None = None
    in_place: bool = False

    def buffers(self) -> list[torch.Tensor]:
        """The pool's buffers it holds (to give back when it is not used)."""
        if self.parts is not None:
            return [] if self.in_place else [buf for _, buf in self.parts]
        return [self.flat] if self.flat is not None else []


class _Ring:
    """One trainer process's ring as a worker reads it (one per sending trainer rank).

    Attributes:
        rank: the trainer rank whose buckets come through it (``Bucket.src``).
        handle: its handle (``PrepareHeader.shared_memory``, or ``shared_memory_ranks[rank]``).
        sock: the connection to its trainer's socket, once connected.
        view: its memory, once handed over: a memfd mapped read-only
            (:class:`~wsync_grpc.transports.shared_memory.backing.MappedSegment`) or GPU memory opened by its IPC
            handle (:class:`~wsync_grpc.transports.cuda_ipc.memory.CudaIpcView`); only ever copied from.
        cuda_index: the device holding a ring in GPU memory, in this process, once located; ``None`` otherwise.
        storages: reads of the trainer's own storages (``handle.storages``); ``None``: none.
    """

    def __init__(self, rank: int, handle: SharedMemoryHandle) -> None:
        self.rank = rank
        self.handle = handle
        self.sock: socket.socket | None = None
        self.view: RingView | None = None
        self.cuda_index: int | None = None
        self.storages: StorageReader | None = None

    def copy(self, slot: int, flat: torch.Tensor, at: int = 0) -> None:
        """Copy ``flat.numel()`` bytes of slot ``slot``, from its byte ``at`` on, into ``flat``; once it returns
        they are there (a GPU copy synchronized), so the slot may be acknowledged."""
        assert self.view is not None
        self.view.copy(slot * self.handle.slot_bytes + at, flat)

    def close(self) -> bool:
        """Unmap the ring and close the socket (idempotent); whether the mapping is still viewed (it is then
        unmapped when that view goes).

        Raises:
            CudaError: CUDA refused to close a ring in GPU memory (the socket is closed all the same).
        """
        view, self.view = self.view, None
        storages, self.storages = self.storages, None
        sock, self.sock = self.sock, None
        try:
            return view.close() if view is not None else False
        finally:
            if storages is not None:
                storages.close()
            if sock is not None:
                sock.close()
