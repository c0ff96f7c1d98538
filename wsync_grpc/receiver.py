"""The background receiver: one thread per engine worker, receiving buckets in order.

Flattened layout: one broadcast per bucket into a ``uint8`` buffer of
``size_bytes``, then viewed as the bucket's tensors. Individual layout: one
broadcast per tensor into a tensor of its wire dtype and shape.

The receiver keeps two buckets posted at a time (double buffering): bucket
k+1 is on the wire while bucket k is handed to the engine. With streaming
apply the two flat buffers are reused, so the extra memory is about two
buckets; with staged apply every received bucket is kept until Complete.

Every wait is bounded by the group timeout and interrupted by the cancel
event; any error is recorded in :attr:`WorkerReceiver.error` and reported
through the ``on_event`` callback.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wsync_grpc.engine import EngineAdapter
from wsync_grpc.group import GroupError, GroupTimeout, WeightSyncGroup, wait_work
from wsync_grpc.metadata import Bucket

PIPELINE_DEPTH = 2
"""Buckets posted ahead at a time per worker (double buffering)."""

NamedTensors = list[tuple[str, torch.Tensor]]


class BucketFeed:
    """The buckets of one update, appended by Prepare/Update and read by every worker.

    Thread-safe. :meth:`close` says no more buckets will come (Complete, or a
    failure).
    """

    def __init__(self) -> None:
        self._buckets: list[Bucket] = []
        self._closed = False
        self._cond = threading.Condition()

    def extend(self, buckets: list[Bucket]) -> None:
        """Append validated buckets."""
        with self._cond:
            self._buckets.extend(buckets)
            self._cond.notify_all()

    def close(self) -> None:
        """No more buckets will be appended. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._buckets)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def get(self, i: int, timeout: float | None) -> Bucket | None:
        """Return bucket ``i``; ``None`` when the feed is closed before it.

        ``timeout`` (seconds) bounds the wait for bucket ``i`` to be declared;
        ``0`` does not wait.

        Raises:
            LookupError: ``timeout`` was 0 and bucket ``i`` is not declared yet.
            GroupTimeout: bucket ``i`` was not declared within ``timeout``.
        """
        with self._cond:
            if timeout == 0:
                if i < len(self._buckets):
                    return self._buckets[i]
                if self._closed:
                    return None
                raise LookupError(i)
            ok = self._cond.wait_for(lambda: i < len(self._buckets) or self._closed, timeout)
            if not ok:
                raise GroupTimeout(f"no bucket {i} was declared within {timeout:g} s (Update or Complete)")
            return self._buckets[i] if i < len(self._buckets) else None


class BufferPool:
    """Flat ``uint8`` receive buffers of one worker, reused across buckets and updates.

    On CPU a fresh multi-MB buffer is fresh memory from the OS: the first
    write into it page-faults every 4 KiB, which measured 3-5x slower than
    receiving into memory already touched. The pool hands out the smallest
    free buffer that is large enough and takes buffers back after they were
    applied (streaming) or after Complete (staged).

    Args:
        device: where buffers live.
        keep: keep free buffers between updates (True), or drop them when
            :meth:`trim` is called at the end of each update (False). Keeping
            costs memory between syncs: about two buckets with streaming
            apply, the update's size with staged apply.
    """

    def __init__(self, device: torch.device, keep: bool) -> None:
        self.device = device
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (its first ``nbytes`` are returned as a view)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda i: self._free[i].numel())
                return self._free.pop(best)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer (or a view of one) for reuse."""
        base = buf if buf._base is None else buf._base
        with self._lock:
            if all(b.data_ptr() != base.data_ptr() for b in self._free):
                self._free.append(base)

    def trim(self) -> None:
        """End of an update: drop the free buffers unless the pool keeps them."""
        if not self.keep:
            with self._lock:
                self._free = []

    @property
    def free_bytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(b.numel() for b in self._free)


@dataclass
class _Posted:
    bucket: Bucket
    works: list[torch.distributed.Work]
    buffers: list[torch.Tensor]  # flattened: [flat]; individual: one per tensor
    posted_at: float = field(default_factory=time.monotonic)


class WorkerReceiver(threading.Thread):
    """Receives one update's buckets for one worker.

    Args:
        worker: the worker index (adapter's :meth:`~EngineAdapter.worker_devices` order).
        group: the worker's weight-sync group membership.
        adapter: the engine, for streaming apply.
        feed: the update's buckets.
        flattened: layout (True: one broadcast per bucket).
        streaming: apply each bucket as it arrives (True) or keep it for Complete.
        cancel: set to stop at the next wait.
        pool: the worker's flat receive buffers.
        on_event: called from this thread after each received bucket and when
            the thread ends (successfully or not).
    """

    def __init__(
        self,
        *,
        worker: int,
        group: WeightSyncGroup,
        adapter: EngineAdapter,
        feed: BucketFeed,
        flattened: bool,
        streaming: bool,
        cancel: threading.Event,
        pool: BufferPool,
        on_event: Callable[[WorkerReceiver], None],
    ) -> None:
        super().__init__(name=f"wsync-receiver-{worker}", daemon=True)
        self.worker = worker
        self.group = group
        self.adapter = adapter
        self.feed = feed
        self.flattened = flattened
        self.streaming = streaming
        self.cancel = cancel
        self.on_event = on_event
        self.device = group.device
        self.armed = threading.Event()
        """Set once the first receive is posted (or nothing is declared yet)."""
        self.done = threading.Event()
        """Set when the thread ends."""
        self.error: BaseException | None = None
        self.buckets_done = 0
        self.bytes_done = 0
        self.tensors_applied = 0
        self.first_post_at: float | None = None
        self.last_arrival_at: float | None = None
        self.staged: list[NamedTensors] = []
        """Staged apply: per received bucket, the (canonical name, tensor) pairs to load."""
        self.pool = pool
        self._held: list[torch.Tensor] = []  # staged: flat buffers behind self.staged

    def run(self) -> None:
        try:
            self._receive_all()
        except BaseException as e:
            self.error = e
        finally:
            self.armed.set()
            self.done.set()
            self.on_event(self)

    def _receive_all(self) -> None:
        timeout = self.group.timeout_s
        pending: collections.deque[_Posted] = collections.deque()
        i = 0
        closed = False
        while True:
            while len(pending) < PIPELINE_DEPTH and not closed:
                if self.cancel.is_set():
                    raise GroupError("cancelled")
                try:
                    bucket = self.feed.get(i, 0)
                except LookupError:
                    if pending:
                        break  # receive what is posted; look for more afterwards
                    self.armed.set()  # nothing declared yet: the receiver is waiting for Update
                    bucket = self._wait_for_bucket(i, timeout)
                if bucket is None:
                    closed = True
                    break
                pending.append(self._post(bucket))
                i += 1
                self.armed.set()
            if not pending:
                return
            posted = pending.popleft()
            deadline = time.monotonic() + timeout
            for work in posted.works:
                wait_work(work, deadline, self.cancel)
            self.last_arrival_at = time.monotonic()
            self._handle(posted)
            self.buckets_done += 1
            self.bytes_done += posted.bucket.size_bytes
            self.on_event(self)

    def _wait_for_bucket(self, i: int, timeout: float) -> Bucket | None:
        deadline = time.monotonic() + timeout
        while True:
            if self.cancel.is_set():
                raise GroupError("cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupTimeout(f"no bucket {i} was declared within {timeout:g} s (Update or Complete)")
            try:
                return self.feed.get(i, min(left, 0.1))
            except GroupTimeout:
                continue

    def _post(self, bucket: Bucket) -> _Posted:
        if self.first_post_at is None:
            self.first_post_at = time.monotonic()
        if self.flattened:
            flat = self.pool.take(bucket.size_bytes)
            return _Posted(bucket, [self.group.broadcast(flat)], [flat])
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in bucket.tensors]
        return _Posted(bucket, [self.group.broadcast(b) for b in bufs], bufs)

    def _handle(self, posted: _Posted) -> None:
        bucket = posted.bucket
        if self.flattened:
            flat = posted.buffers[0]
            named = [
                (t.canonical, flat[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape))
                for t in bucket.tensors
                if t.load
            ]
        else:
            named = [(t.canonical, buf) for t, buf in zip(bucket.tensors, posted.buffers, strict=True) if t.load]
        if self.streaming:
            with self.adapter.weights_lock():
                self.tensors_applied += self.adapter.load_weights(self.worker, named)
            if self.flattened:
                self.pool.give(posted.buffers[0])
        else:
            self.staged.append(named)
            if self.flattened:
                self._held.append(posted.buffers[0])

    def release(self, reuse: bool) -> None:
        """Let go of every received buffer (after apply, or when the update is abandoned).

        Args:
            reuse: return the flat buffers to the pool. Only when no collective
                can still write into them (the thread has ended).
        """
        held, self._held, self.staged = self._held, [], []
        if reuse:
            for buf in held:
                self.pool.give(buf)
        self.pool.trim()
