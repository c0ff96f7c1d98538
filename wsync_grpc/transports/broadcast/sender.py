"""The broadcast transport's sending side: every bucket broadcast from the trainer's sending rank.

The tensors of a bucket are asked for (``tensors(bucket)``) only when that
bucket is packed or posted, so a source that materialises them (a sharded
trainer's gather) holds no more than the buckets in flight.

Two pipelines, one per bucket layout: :meth:`Broadcast.flattened` (one
broadcast per bucket, the next bucket packed while the current one is on the
wire, into one of the two reusable buffers of :class:`PackBuffers`) and
:meth:`Broadcast.individual` (one broadcast per tensor, up to two buckets in
flight). Both wait with the group's timeout and stop at the next wait, or
before the next bucket, when the client's cancel signal is set; both call the
``progress`` callback once a bucket is on every engine.

Digests (:mod:`wsync_grpc.core.digests`): given an ``on_digest`` callback, each bucket's bytes
are hashed once its broadcast is posted, while it is on the wire (the buffer is only read), and
the digest is handed over at once (the trainer declares it to the engines, which hold the
bucket until it came). :func:`bucket_digest` hashes a bucket without sending it, for a sender
that declares its digests before Prepare. :class:`Corruption` is a test hook that flips one
byte of one bucket after it was hashed, as a faulty wire would.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from wsync_grpc.core.digests import BucketHasher, Digest, digest_of
from wsync_grpc.core.errors import Cancelled
from wsync_grpc.core.layout import Bucket, Layout, TensorSlot
from wsync_grpc.core.packing import bucket_bytes_view, pack_bucket, wire_tensor
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.group.waits import wait_all, wait_work
from wsync_grpc.transports.sending import SENDING_RANK, SendJob, SendSite, TrainerPeers

__all__ = [
    "Broadcast",
    "BroadcastSender",
    "Corruption",
    "DirectSends",
    "PackBuffers",
    "SendJob",
    "bucket_digest",
]

FLAT_WINDOW = 4
"""Flattened layout: bucket broadcasts the trainer keeps in flight (at most two of them packed)."""

INDIVIDUAL_WINDOW = 512
"""Per-tensor broadcasts the individual layout keeps in flight."""


class PackBuffers:
    """The trainer's two flat bucket buffers (up to twice the largest bucket, in bytes), kept between syncs or not.

    Args:
        keep: keep the buffers between syncs; ``None`` keeps them when
            ``device`` is CPU, where freed memory returns to the OS and
            refilling fresh buffers costs page faults; not on CUDA, where
            torch's caching allocator already reuses freed blocks.
        device: the trainer's device.

    Attributes:
        device: the trainer's device.
    """

    def __init__(self, keep: bool | None, device: torch.device) -> None:
        self.device = device
        self._keep = device.type == "cpu" if keep is None else keep
        self._slots: list[torch.Tensor | None] = [None, None]

    def for_update(self) -> list[torch.Tensor | None]:
        """The two slots an update packs into: the kept ones, or two fresh (empty) ones."""
        return self._slots if self._keep else [None, None]

    def release(self) -> None:
        """Drop the kept buffers (a broadcast abandoned half-way may still read the old ones)."""
        self._slots = [None, None]


@dataclass(frozen=True)
class Corruption:
    """A test hook: flip byte ``byte`` of bucket ``bucket`` after its digest was computed (a faulty wire).

    The bytes sent are a corrupted copy; the trainer's tensors are untouched. In the individual
    layout the byte is counted in the bucket's first tensor that has bytes.

    Attributes:
        bucket: the bucket's index.
        byte: the byte's offset in the bucket's first buffer sent.
    """

    bucket: int
    byte: int = 0

    def corrupted(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``sent`` (a bucket's flat buffer, or its wire tensors) with the byte flipped in a copy."""
        out = list(sent)
        i = next(k for k, t in enumerate(out) if t.numel())
        copy = out[i].detach().clone()
        raw = copy.reshape(-1).view(torch.uint8)
        raw[self.byte] ^= 0xFF
        out[i] = copy
        return out


def bucket_digest(b: Bucket, by_name: Mapping[str, torch.Tensor], layout: Layout) -> Digest:
    """The digest of the bytes ``b`` would put on the wire in ``layout``, hashed without packing it.

    Each tensor is hashed in its wire dtype (a converted copy when the trainer's differs); in the
    flattened layout the zero padding between them too, as :func:`~wsync_grpc.core.packing.pack_bucket`
    (``zero_padding=True``) lays it out.

    Raises:
        KeyError: a tensor of ``b`` is missing from ``by_name``.
        ValueError: a tensor's shape differs from the plan.
    """
    h = BucketHasher()
    end = 0
    for t in b.tensors:
        if layout is Layout.FLATTENED and t.offset >= end:  # an empty entry may sit before the end
            h.zeros(t.offset - end)
            end = t.end
        h.update(wire_tensor(t, by_name[t.name]))
    if layout is Layout.FLATTENED:
        h.zeros(b.size_bytes - end)
    return h.digest()


@dataclass
class Broadcast:
    """One update's broadcasts from the sending rank (group rank ``src``), and the progress they report.

    Attributes:
        group: the sender's membership of the weight-sync group.
        buckets: the planned buckets, in index order.
        tensors: a bucket's whole tensors by slot name, asked for once per bucket in index order
            when it is packed or posted (e.g. a
            :meth:`WeightSource.bucket_tensors <wsync_grpc.trainer.source.WeightSource.bucket_tensors>`).
        on_sent: called from this thread once a bucket is on every engine, with the bucket and the
            bytes on every engine so far (bytes); ``None`` for none.
        cancel: set to stop at the next wait (the waits then raise
            :class:`~wsync_grpc.core.errors.Cancelled`).
        on_digest: called from this thread with each bucket and the digest of its bytes, hashed while
            it is on the wire; ``None``: nothing is hashed.
        corrupt: a test hook (:class:`Corruption`); ``None`` in production.
    """

    group: WeightSyncGroup
    buckets: Sequence[Bucket]
    tensors: Callable[[Bucket], Mapping[str, torch.Tensor]]
    on_sent: Callable[[Bucket, int], None] | None
    cancel: threading.Event
    src: int = 0
    """The sending group rank (the trainer's; wsync's trainers join first, from rank 0)."""
    materialises: bool = False
    """Whether ``tensors(bucket)`` builds the tensors (a sharded trainer's gather) rather than
    returning ones held anyway: then at most one bucket's built tensors live at a time, in hand
    or in flight (a lone one is broadcast from itself), besides the two pack buffers."""
    sent: int = 0
    """Bytes on every engine so far, in bytes."""
    on_digest: Callable[[Bucket, Digest], None] | None = None
    corrupt: Corruption | None = None

    @classmethod
    def of(cls, job: SendJob, src: int, *, materialises: bool = False, corrupt: Corruption | None = None) -> Broadcast:
        """The broadcasts of ``job``'s buckets from group rank ``src`` (see the attributes)."""
        return cls(
            job.joined(),
            job.buckets,
            job.tensors,
            job.on_sent,
            job.cancel,
            src=src,
            materialises=materialises,
            on_digest=job.on_digest,
            corrupt=corrupt,
        )

    def run(self, layout: Layout, buffers: PackBuffers) -> float:
        """Every bucket in ``layout``: :meth:`flattened` (packing into ``buffers``) or :meth:`individual`.

        Returns the time spent packing or preparing tensors, in seconds.
        """
        if layout is Layout.FLATTENED:
            return self.flattened(buffers.for_update())
        return self.individual()

    def _deadline(self) -> float:
        return time.monotonic() + self.group.timeout_s

    def _check_cancel(self) -> None:
        """Stop before the next bucket is asked for once ``cancel`` is set (a wire that keeps up never waits, so
        the waits alone would not see it before the last bucket).

        Raises:
            Cancelled: ``cancel`` is set.
        """
        if self.cancel.is_set():
            raise Cancelled("the update was cancelled")

    def _report(self, b: Bucket) -> None:
        if self.on_sent is not None:
            self.on_sent(b, self.sent)

    def flattened(self, slots: list[torch.Tensor | None]) -> float:
        """One broadcast per bucket, double-buffered: pack k+1 while k is on the wire.

        A bucket that is one tensor already laid out as its bytes is broadcast
        from the tensor itself (:func:`~wsync_grpc.core.packing.bucket_bytes_view`),
        without packing and without a buffer; other buckets are packed into
        one of two reused buffers (``slots``, filled as needed), a buffer being
        repacked only once the broadcast that read it has completed. Up to
        :data:`FLAT_WINDOW` broadcasts are in flight, so that the wire never
        waits for this thread between two buckets.

        The buffers are sized once for the largest bucket to pack, so that no buffer is replaced
        by a larger one during the update. Returns the time spent packing, in seconds.
        """
        group = self.group
        pack_s = 0.0
        window: collections.deque[tuple[torch.distributed.Work, Bucket, int]] = collections.deque()
        packed = 0  # buckets packed so far; bucket p uses slot p % 2
        largest = max((b.size_bytes for b in self.buckets if b.lone is None), default=0)

        def finish() -> None:
            work, b, _slot = window.popleft()
            wait_work(work, self._deadline(), self.cancel, sliced=group.sliced_waits)
            self.sent += b.size_bytes
            self._report(b)

        def free(slot_index: int) -> None:
            while any(s == slot_index for _w, _b, s in window):  # the slot is still on the wire
                finish()

        for b in self.buckets:
            self._check_cancel()
            t = time.monotonic()
            if self.materialises:  # the built tensors of a lone bucket in flight go before more are built
                free(-1)
                if b.lone is None:
                    free(packed % 2)
            by_name: Mapping[str, torch.Tensor] | None = self.tensors(b)
            assert by_name is not None
            buf = bucket_bytes_view(b, by_name, group.device)
            slot_index = -1
            if buf is None:
                slot_index = packed % 2
                packed += 1
                free(slot_index)
                t = time.monotonic()
                slot = slots[slot_index]
                if slot is None or slot.numel() < b.size_bytes or slot.device != group.device:
                    size = max(b.size_bytes, largest)
                    slot = slots[slot_index] = None  # the old one goes before the new one is allocated
                    slot = slots[slot_index] = torch.empty(size, dtype=torch.uint8, device=group.device)
                buf = slot[: b.size_bytes]
                # Padding zeroed: a reused or fresh buffer never puts stale trainer memory on the wire.
                pack_bucket(b, by_name, buf, zero_padding=True)
            by_name = None  # packed (or viewed by buf): the tensors need not live on
            pack_s += time.monotonic() - t
            digest = None
            if self.corrupt is not None and self.corrupt.bucket == b.index:
                digest = digest_of([buf])
                (buf,) = self.corrupt.corrupted([buf])
            while len(window) >= FLAT_WINDOW:
                finish()
            window.append((group.broadcast(buf, self.src), b, slot_index))
            if self.on_digest is not None:  # hashed while the bucket is on the wire (both only read it)
                self.on_digest(b, digest or digest_of([buf]))
            buf = None  # the posted work holds it until it completes, and no longer
        while window:
            finish()
        group.forget_completed()
        return pack_s

    def individual(self) -> float:
        """One broadcast per tensor, in order, up to two buckets in flight.

        Every tensor of bucket k+1 is prepared (made contiguous in its wire
        dtype) and posted before bucket k's broadcasts are waited for; the
        engines keep two buckets of receives posted. Waiting for each tensor
        before posting the next costs a round trip per tensor, which is what
        dominates for a model of many small tensors (a large MoE).
        Broadcasts are waited for half a window at a time
        (:func:`~wsync_grpc.group.waits.wait_all`).
        Converted copies (when a tensor is not already contiguous in its wire
        dtype) are held for at most two buckets.

        Returns the time spent preparing tensors, in seconds.
        """
        group = self.group
        pack_s = 0.0
        window: collections.deque[tuple[torch.distributed.Work, torch.Tensor, Bucket, TensorSlot]] = collections.deque()

        def finish(n: int) -> None:
            # The oldest n together: one completion callback for all of them (see wait_all).
            done = [window.popleft() for _ in range(min(n, len(window)))]
            wait_all([d[0] for d in done], self._deadline(), self.cancel, sliced=group.sliced_waits)
            for _work, _wire, b, pt in done:
                self.sent += pt.nbytes
                if pt is b.tensors[-1]:
                    self._report(b)

        for b in self.buckets:
            self._check_cancel()
            t = time.monotonic()
            by_name = self.tensors(b)
            wires = [wire_tensor(pt, by_name[pt.name], group.device) for pt in b.tensors]
            del by_name  # the wire tensors (views or converted copies) are all that stays in flight
            pack_s += time.monotonic() - t
            digest = None
            if self.corrupt is not None and self.corrupt.bucket == b.index:
                digest = digest_of(wires)
                wires = self.corrupt.corrupted(wires)
            for pt, wire in zip(b.tensors, wires, strict=True):
                if len(window) >= INDIVIDUAL_WINDOW:
                    finish(INDIVIDUAL_WINDOW // 2)
                window.append((group.broadcast(wire, self.src), wire, b, pt))
            if self.on_digest is not None:  # hashed while the bucket's tensors are on the wire
                self.on_digest(b, digest or digest_of(wires))
        finish(len(window))
        group.forget_completed()
        return pack_s


@runtime_checkable
class DirectSends(TrainerPeers, Protocol):
    """The trainer's ranks, when every one of them sends its own buckets (a sharded trainer's ``direct``
    topology): what the broadcast sender asks of them besides :class:`~wsync_grpc.transports.sending.TrainerPeers`.

    The ranks' coordination is the trainer's (the rank rounds of :mod:`wsync_grpc.trainer.sharded.rounds`).
    """

    def direct_digests(self, job: SendJob) -> Mapping[int, Digest]:
        """Every bucket's digest, each hashed by the rank that sends it, exchanged before Prepare.

        Raises:
            Exception: a rank failed to hash its buckets or is gone.
        """
        ...

    def direct_send(self, job: SendJob, buffers: PackBuffers) -> float:
        """Every rank broadcasts its own buckets of ``job`` (this one packing into ``buffers``); returns once
        every rank's sends ended. Returns this rank's packing time, in seconds.

        Raises:
            Exception: a rank's sends failed or it is gone (this rank's own sends stop at once).
        """
        ...


class BroadcastSender:
    """The broadcast transport's trainer half (a :class:`~wsync_grpc.transports.sending.TransportSender`).

    By the job's topology (:class:`~wsync_grpc.core.topology.SendTopology`):

    - ``single``: this process, group rank 0, broadcasts every bucket whole;
    - ``gather``: this rank broadcasts every bucket whole, its tensors gathered from every rank as the
      bucket is packed (``job.tensors`` builds them: at most one bucket's gathered tensors live at a time);
    - ``direct``: every rank broadcasts the buckets of its own pieces (``site.peers`` must be
      :class:`DirectSends`), their digests exchanged before Prepare.

    Args:
        site: the trainer's ranks and device (:class:`~wsync_grpc.transports.sending.SendSite`).
        buffers: the two flat pack buffers the flattened layout packs into; ``None``: built from ``site``.
        corrupt: a test hook: flip a byte of one bucket after hashing it (:class:`Corruption`); ``None``
            (always, outside tests).

    Attributes:
        corrupt: the test hook, read at every update (a test may set it between two).
    """

    def __init__(
        self, site: SendSite, buffers: PackBuffers | None = None, *, corrupt: Corruption | None = None
    ) -> None:
        self._peers = site.peers
        self._buffers = buffers if buffers is not None else PackBuffers(site.keep_buffers, site.device)
        self.corrupt = corrupt

    def _direct(self) -> DirectSends:
        """The peers, as ranks that each send their own buckets.

        Raises:
            ValueError: they are one process (or cannot).
        """
        peers = self._peers
        if not isinstance(peers, DirectSends):
            raise ValueError(f"a trainer of {peers.trainer_ranks} rank(s) without direct sends cannot send 'direct'")
        return peers

    def header_fields(self, job: SendJob) -> Mapping[str, Any]:
        """None: the engines joined the group at Init."""
        return {}

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """``direct``: every rank's digests (:meth:`DirectSends.direct_digests`); otherwise ``None`` (this rank
        hashes each bucket as it sends it).

        Raises:
            Exception: as :meth:`DirectSends.direct_digests`.
        """
        if job.topology.kind != "direct":
            return None
        return self._direct().direct_digests(job)

    def send(self, job: SendJob) -> float:
        """Every bucket of ``job`` from the ranks its topology names (see the class).

        Raises:
            ValueError: a topology of another number of ranks than the trainer's.
            Exception: as :meth:`TransportSender.send <wsync_grpc.transports.sending.TransportSender.send>`.
        """
        if job.topology.ranks != self._peers.trainer_ranks:
            raise ValueError(f"a trainer of {self._peers.trainer_ranks} rank(s) cannot send {job.topology}")
        if job.topology.kind == "direct":
            return self._direct().direct_send(job, self._buffers)
        gathered = job.topology.kind == "gather"
        src = self._peers.rank if gathered else SENDING_RANK
        return Broadcast.of(job, src, materialises=gathered, corrupt=self.corrupt).run(job.layout, self._buffers)

    def release(self) -> None:
        """Drop the pack buffers (see :class:`PackBuffers`)."""
        self._buffers.release()
