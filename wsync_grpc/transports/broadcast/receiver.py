"""The broadcast transport's receiving side: one thread per engine worker, receiving buckets in order.

Flattened layout: one broadcast per bucket into a ``uint8`` buffer of
``size_bytes``, then viewed as the bucket's tensors. Individual layout: one
broadcast per tensor into a tensor of its wire dtype and shape.

The receiver keeps two buckets posted at a time (double buffering): bucket
k+1 is on the wire while bucket k is handed to the engine. In the individual
layout it posts chunks of a bucket's tensors instead, a few chunks ahead. With
streaming apply the two flat buffers are reused, so the extra memory is about
two buckets; with staged apply every received bucket is kept until Complete.

A bucket holding one tensor (the trainer sends large tensors alone) needs no
unpacking. With streaming apply on an engine that offers
:class:`~wsync_grpc.core.engine.InPlaceReceive` it is received straight into the
served tensor (no buffer, no copy; such buckets are posted further ahead,
up to :data:`MAX_POSTED`). With staged apply on an engine that offers
:class:`~wsync_grpc.core.engine.StorageSwap` it is received into an exact-size
buffer that the engine serves from Complete on, and the memory it replaces
becomes a buffer of the next update.

A bucket comes from the trainer rank its spec names (``src``). Pieces of a tensor that a sharded
trainer's ranks send separately are copied into the whole tensor as they arrive
(:class:`~wsync_grpc.core.pieces.PieceAssembler`), which is loaded, or staged, once whole;
they are never received in place.

A bucket with a digest (its spec's, or one declared after it: :mod:`wsync_grpc.core.digests`)
is hashed once it arrived, while the next one is on the wire, and checked before any of it
is staged, loaded or assembled: a mismatch ends the receive with DATA_LOSS
(BUCKET_DIGEST_MISMATCH) and nothing of that bucket reaches the engine. Such a bucket is
therefore never received in place (the served tensor would be written before the check);
in the individual layout its chunks are held until its last one arrived and the whole
bucket checked. A bucket whose digest is declared later waits for it, at most the group
timeout. Buckets without a digest (a trainer that sends none) are used unverified.

Every wait is bounded by the group timeout and interrupted by the cancel
event; any error is recorded in :attr:`BroadcastReceiver.error` and reported
through the ``on_event`` callback.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from wsync_grpc.core.digests import BucketHasher, Digest, check_digest
from wsync_grpc.core.engine import InPlaceReceive
from wsync_grpc.core.errors import (
    Cancelled,
    GroupError,
    GroupTimeout,
    WsyncError,
)
from wsync_grpc.core.layout import Bucket, Layout, TensorSlot
from wsync_grpc.core.packing import NamedTensors, tensor_views
from wsync_grpc.core.pieces import PieceAssembler
from wsync_grpc.core.update import ReceivePlan
from wsync_grpc.group.waits import wait_all
from wsync_grpc.worker.delta import expand, loaded, staged
from wsync_grpc.worker.feed import digest_missing, digest_timeout
from wsync_grpc.worker.receiver import ReceiverThread, ReceiveSite
from wsync_grpc.worker.swaps import SwapIn, served_target

_T = TypeVar("_T")

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 2
"""Buckets posted ahead at a time per worker (double buffering)."""

MAX_POSTED = 8
"""Buckets posted ahead at most, counting those received in place (which take no buffer)."""

INDIVIDUAL_CHUNK = 256
"""Individual layout: receives are posted in chunks of at most this many tensors."""

INDIVIDUAL_DEPTH = 4
"""Individual layout: chunks posted ahead at a time per worker.

At most ``INDIVIDUAL_CHUNK * INDIVIDUAL_DEPTH`` receives are outstanding: enough to keep the
wire busy with tensors of a few kB, while a bucket of a large MoE (thousands of tensors) is
never posted, allocated and held all at once.
"""


@dataclass
class _Posted:
    bucket: Bucket
    works: list[torch.distributed.Work]
    buffers: list[torch.Tensor]  # flattened: [flat]; individual: one per tensor of the chunk
    start: int = 0  # individual: the chunk's tensors are bucket.tensors[start:end]
    end: int = 0
    direct: tuple[bool, ...] = ()  # per buffer: received straight into the served tensor
    swap: bool = False  # staged: a lone tensor in an exact-size buffer the engine will serve

    @property
    def holds_buffer(self) -> bool:
        """Whether this takes receive memory (not everything it posted is received in place)."""
        return not all(self.direct)

    posted_at: float = field(default_factory=time.monotonic)

    @property
    def last(self) -> bool:
        """Whether this completes its bucket."""
        return self.end == len(self.bucket.tensors)


class BroadcastReceiver(ReceiverThread):
    """Receives one update's buckets for one worker from the weight-sync group (a :class:`Receiver`).

    Args:
        site: where it runs (its ``group`` is required: the worker's membership of the weight-sync group).
        plan: the update (its layout and apply mode; its buckets come through ``site.feed``).
    """

    def __init__(self, site: ReceiveSite, plan: ReceivePlan) -> None:
        group = site.group
        assert group is not None, "a broadcast needs the group (TransportPart.needs_group)"
        super().__init__(f"wsync-receiver-{site.worker}", site, plan)
        self.group = group
        self.flattened = plan.layout is Layout.FLATTENED
        self.device = group.device
        self.pool = site.pool
        self._held: list[torch.Tensor] = []  # staged: flat buffers behind self.staged
        self.tensors_direct = 0
        """Tensors received straight into the served ones (counted in :attr:`tensors_applied` too)."""
        self._in_place = site.target if self.streaming and isinstance(site.target, InPlaceReceive) else None
        self.swap_in = SwapIn(site.target, self.device, self.streaming)
        """Staged apply on a :class:`StorageSwap` engine: lone tensors received into buffers it serves as they are."""
        self._pieces = PieceAssembler(self.device)
        self._digests_follow = plan.digests_follow
        self._hasher: BucketHasher | None = None  # individual: the bucket being hashed, chunk by chunk
        self._held_chunks: list[_Posted] = []  # individual: its chunks, held until it is checked

    @property
    def timeout_s(self) -> float:
        """The group's per-collective timeout, in seconds."""
        return self.group.timeout_s

    def run(self) -> None:
        try:
            self._receive_all()
        except BaseException as e:
            if isinstance(e, WsyncError):  # a digest that does not match or never came: the update says why
                log.warning("broadcast receiver of worker %d: %s %s", self.worker, e.reason, e.message)
            elif not isinstance(e, (GroupError, GroupTimeout, Cancelled)):  # reported as such, without a traceback
                log.exception("broadcast receiver of worker %d failed", self.worker)
            self.error = e
        finally:
            self.armed.set()
            self.done.set()
            self.on_event(self)

    def _receive_all(self) -> None:
        timeout = self.group.timeout_s
        pending: collections.deque[_Posted] = collections.deque()
        depth = PIPELINE_DEPTH if self.flattened else INDIVIDUAL_DEPTH
        i = 0
        partial: _Posted | None = None  # individual: the last chunk posted, when its bucket has more tensors
        closed = False
        while True:
            while sum(p.holds_buffer for p in pending) < depth and len(pending) < MAX_POSTED and not closed:
                if self.cancel.is_set():
                    raise Cancelled("the update was cancelled")
                if partial is not None:
                    bucket, start = partial.bucket, partial.end
                else:
                    try:
                        got = self.feed.get(i, 0)
                    except LookupError:
                        if pending:
                            break  # receive what is posted; look for more afterwards
                        self.armed.set()  # nothing declared yet: the receiver is waiting for Update
                        got = self._wait_for_bucket(i, timeout)
                    if got is None:
                        closed = True
                        break
                    bucket, start = got, 0
                    i += 1
                posted = self._post(bucket, start)
                pending.append(posted)
                partial = None if posted.last else posted
                self.armed.set()
            if not pending:
                return
            posted = pending.popleft()
            deadline = time.monotonic() + timeout
            wait_all(posted.works, deadline, self.cancel, sliced=self.group.sliced_waits)
            self.last_arrival_at = time.monotonic()
            self._handle(posted)
            if self.flattened:
                self.bytes_done += posted.bucket.size_bytes
            else:
                self.bytes_done += sum(t.nbytes for t in posted.bucket.tensors[posted.start : posted.end])
            if posted.last:
                self.buckets_done += 1
                self.on_event(self)

    def _wait_for_bucket(self, i: int, timeout: float) -> Bucket | None:
        return self._poll(
            lambda wait: self.feed.get(i, wait),
            timeout,
            lambda: GroupTimeout(f"no bucket {i} was declared within {timeout:g} s (Update or Complete)"),
        )

    def _poll(self, fetch: Callable[[float], _T], timeout: float, expired: Callable[[], Exception]) -> _T:
        """``fetch(wait)`` (which raises :class:`GroupTimeout` when nothing came within ``wait`` seconds) until it
        answers, looking for a cancel at least every 0.1 s.

        Raises:
            Cancelled: the update was cancelled meanwhile.
            Exception: ``expired()``, once ``timeout`` seconds passed without an answer.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.cancel.is_set():
                raise Cancelled("the update was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise expired()
            try:
                return fetch(min(left, 0.1))
            except GroupTimeout:
                continue

    def _served_target(self, t: TensorSlot) -> torch.Tensor | None:
        """The served tensor to receive ``t`` straight into, or None (:func:`~wsync_grpc.worker.swaps.served_target`;
        streaming apply only)."""
        return served_target(self._in_place, self.worker, self.device, t)

    def _post(self, bucket: Bucket, start: int) -> _Posted:
        """Post the receives of ``bucket`` (flattened: all of it; individual: a chunk from tensor ``start``)."""
        if self.first_post_at is None:
            self.first_post_at = time.monotonic()
        verified = self._verified(bucket)
        if self.flattened:
            lone = bucket.lone
            target = self._served_target(lone) if lone is not None and not verified else None
            if target is not None:
                self.wrote_served = True  # before posting: bytes may land at once
                flat = target.view(-1).view(torch.uint8)
                return _Posted(bucket, [self.group.broadcast(flat, bucket.src)], [flat], 0, 1, direct=(True,))
            if self.swap_in.swappable(lone):
                flat = self.pool.take_exact(bucket.size_bytes)
                return _Posted(
                    bucket, [self.group.broadcast(flat, bucket.src)], [flat], 0, 1, direct=(False,), swap=True
                )
            # Streaming reuses two buffers for every bucket: size them for the largest one.
            flat = self.pool.take(bucket.size_bytes, self.feed.max_size_bytes if self.streaming else 0)
            return _Posted(
                bucket, [self.group.broadcast(flat, bucket.src)], [flat], 0, len(bucket.tensors), direct=(False,)
            )
        end = min(start + INDIVIDUAL_CHUNK, len(bucket.tensors))
        bufs: list[torch.Tensor] = []
        direct: list[bool] = []
        for t in bucket.tensors[start:end]:
            target = None if verified else self._served_target(t)
            if target is None:
                bufs.append(torch.empty(t.shape, dtype=t.dtype, device=self.device))
            else:
                self.wrote_served = True
                bufs.append(target)
            direct.append(target is not None)
        works = [self.group.broadcast(b, bucket.src) for b in bufs]
        return _Posted(bucket, works, bufs, start, end, direct=tuple(direct))

    def _verified(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` is checked against a digest (its spec's, or one declared after it)."""
        return bucket.digest is not None or self._digests_follow

    def _handle(self, posted: _Posted) -> None:
        """Check what arrived against its bucket's digest (when it has one), then stage or load it.

        Individual layout: a verified bucket's chunks are hashed as they arrive and held until the
        last one; the bucket is used only once the whole of it matched.

        Raises:
            DataLoss: BUCKET_DIGEST_MISMATCH; nothing of the bucket was used.
            DeadlineExceeded, InvalidArgument: DIGEST_TIMEOUT, DIGEST_MISSING (see :meth:`_expected`).
        """
        bucket = posted.bucket
        if bucket.has_delta:  # flattened only (a delta's header says so): made whole, then checked as whole
            hasher = BucketHasher() if self._verified(bucket) else None
            flat = posted.buffers[0][: bucket.size_bytes]
            wholes = expand(flat, bucket, self.target, lambda t: self.swap_in.buffer_for(t, self.pool), hasher)
            if hasher is not None:
                check_digest(bucket.index, self._expected(bucket), hasher.digest())
                self.buckets_verified += 1
            whole = loaded(wholes, self._pieces) if self.streaming else staged(wholes, self.swap_in, self._pieces)
            self._use(posted, whole)
            return
        if not self._verified(bucket):
            self._use(posted)
            return
        if self.flattened:
            h = BucketHasher()
            h.update(posted.buffers[0][: bucket.size_bytes])
            self._check(bucket, h)
            self._use(posted)
            return
        if self._hasher is None:
            self._hasher = BucketHasher()
        for buf in posted.buffers:
            self._hasher.update(buf)
        self._held_chunks.append(posted)
        if not posted.last:
            return
        hasher, self._hasher = self._hasher, None
        held, self._held_chunks = self._held_chunks, []
        self._check(bucket, hasher)
        for p in held:
            self._use(p)

    def _check(self, bucket: Bucket, hasher: BucketHasher) -> None:
        """Compare the bytes ``hasher`` took in with ``bucket``'s digest; count the bucket verified.

        Raises:
            DataLoss: BUCKET_DIGEST_MISMATCH.
        """
        check_digest(bucket.index, self._expected(bucket), hasher.digest())
        self.buckets_verified += 1

    def _expected(self, bucket: Bucket) -> Digest:
        """``bucket``'s digest: its spec's, or the one declared after it (waited for, at most the group timeout).

        Raises:
            DeadlineExceeded: DIGEST_TIMEOUT, none was declared within the group timeout.
            InvalidArgument: DIGEST_MISSING, the declarations ended (Complete) without it.
            Cancelled: the update was cancelled meanwhile.
        """
        if bucket.digest is not None:
            return bucket.digest
        timeout = self.group.timeout_s
        digest = self._poll(
            lambda wait: self.feed.digest(bucket.index, wait),
            timeout,
            lambda: digest_timeout(bucket.index, timeout),
        )
        if digest is None:
            raise digest_missing(bucket.index)
        return digest

    def _use(self, posted: _Posted, made_whole: NamedTensors | None = None) -> None:
        """Stage or load what ``posted`` received (the whole bucket, or a chunk of it; ``whole``: a delta bucket's
        tensors made whole: ``made_whole``, see :func:`~wsync_grpc.worker.delta.expand`)."""
        bucket = posted.bucket
        views = True  # whether what is staged views the flat buffer
        if made_whole is not None:
            named = made_whole
        elif self.flattened:
            named = [] if posted.direct[0] else self._flat_named(posted.buffers[0], bucket)
            views = any(t.piece is None and t.load for t in bucket.tensors)
        else:
            tensors = bucket.tensors[posted.start : posted.end]
            named = []
            for t, buf, d in zip(tensors, posted.buffers, posted.direct, strict=True):
                if not t.load or d:
                    continue
                if t.piece is None:
                    named.append((t.canonical, buf))
                elif (whole := self._pieces.add(t, buf)) is not None:
                    named.append(whole)
        direct = sum(posted.direct)
        if self.streaming:
            if named:
                with self.target.weights_lock():
                    self.tensors_applied += self.target.load_weights(self.worker, named)
            self.tensors_applied += direct
            self.tensors_direct += direct
            if self.flattened and not direct:
                self.pool.give(posted.buffers[0])
        elif posted.swap:
            self.swap_in.add(bucket.tensors[0], posted.buffers[0])
        else:
            self.staged.append(named)
            if self.flattened and views:
                self._held.append(posted.buffers[0])
            elif self.flattened:  # every tensor was copied out (pieces): the buffer is free again
                self.pool.give(posted.buffers[0])

    def _flat_named(self, flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The tensors to load from a received flat bucket: its whole tensors viewed, pieces assembled."""
        if all(t.piece is None for t in bucket.tensors):
            return tensor_views(flat, bucket.tensors)
        named = tensor_views(flat, [t for t in bucket.tensors if t.piece is None])
        for t in bucket.tensors:
            if t.piece is not None and t.load:
                whole = self._pieces.add(t, flat[t.offset : t.end].view(t.dtype).view(t.shape))
                if whole is not None:
                    named.append(whole)
        return named

    def apply_swaps(self) -> int:
        """Staged apply: hand the tensors received to swap in to the engine to serve (:meth:`SwapIn.apply
        <wsync_grpc.worker.swaps.SwapIn.apply>`); the tensors swapped. The caller holds the engine's weights lock.
        """
        return self.swap_in.apply(self.worker, self.pool)

    def release(self, reuse: bool) -> None:
        """Let go of every received buffer (after apply, or when the update is abandoned).

        Args:
            reuse: return the flat buffers to the pool. Only when no collective
                can still write into them (the thread has ended).
        """
        held, self._held, self.staged = self._held + self.swap_in.clear(), [], []
        self._pieces.clear()
        if reuse:
            for buf in held:
                self.pool.give(buf)
        self.pool.trim(keep_earlier=self.delta)  # a delta: the last whole update's buffers stay
