"""The disk reader: one thread per engine worker, loading a disk update's buckets from safetensors files.

It stands where a :class:`~wsync_grpc.transports.broadcast.receiver.WorkerReceiver` stands
for a broadcast, with the same progress attributes, so that the update
session, Complete's two phases, Cancel, Watch, the checksums and the metrics
treat a disk update exactly as a broadcast one. Staged apply: every tensor is
copied out of the file (the file may be overwritten afterwards) and kept
until Complete applies it between two inference steps. Streaming apply: each
bucket is loaded into the served weights as it is read, the engine frozen.
The cancel event is checked between tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from wsync_grpc.core.engine import WeightTarget
from wsync_grpc.core.errors import Cancelled, Unavailable
from wsync_grpc.core.layout import ApplyMode, Bucket
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.worker.feed import BucketFeed

log = logging.getLogger(__name__)


class DiskReceiver(threading.Thread):
    """Reads one disk update's buckets for one worker.

    Args:
        worker: the worker index (the engine adapter's ``worker_devices`` order).
        device: the worker's device; tensors are moved there as they are read.
        adapter: the engine, for streaming apply.
        feed: the update's buckets (closed: a disk update declares them all at Prepare).
        files: tensor name -> the safetensors file holding it.
        apply_mode: streaming (load each bucket as it is read) or staged (keep it for Complete).
        cancel: set to stop before the next tensor.
        on_event: called from this thread after each bucket and when the thread ends.
    """

    def __init__(
        self,
        *,
        worker: int,
        device: torch.device,
        adapter: WeightTarget,
        feed: BucketFeed,
        files: Mapping[str, Path],
        apply_mode: ApplyMode,
        cancel: threading.Event,
        on_event: Callable[[DiskReceiver], None],
    ) -> None:
        super().__init__(name=f"wsync-disk-reader-{worker}", daemon=True)
        self.worker = worker
        self.device = device
        self.adapter = adapter
        self.feed = feed
        self.files = files
        self.streaming = apply_mode is ApplyMode.STREAMING
        self.cancel = cancel
        self.on_event = on_event
        self.armed = threading.Event()
        """Set when the thread starts (a disk read needs nothing posted first)."""
        self.done = threading.Event()
        """Set when the thread ends."""
        self.error: BaseException | None = None
        self.buckets_done = 0
        self.bytes_done = 0
        self.tensors_applied = 0
        self.first_post_at: float | None = None
        self.last_arrival_at: float | None = None
        self.staged: list[NamedTensors] = []
        """Staged apply: per bucket, the (canonical name, tensor) pairs read."""
        self.wrote_served = False
        """Whether a streaming load into the served weights began (they may be half written)."""

    @property
    def timeout_s(self) -> float:
        """The bound reported for a stalled read, in seconds (no group: the default group timeout)."""
        return DEFAULT_GROUP_TIMEOUT_S

    def run(self) -> None:
        try:
            self.armed.set()
            self.first_post_at = time.monotonic()
            with ExitStack() as stack:
                opened: dict[Path, Any] = {}
                i = 0
                while (bucket := self.feed.get(i, 0)) is not None:
                    try:
                        self._bucket(bucket, opened, stack)
                    except (OSError, SafetensorError, ValueError) as e:
                        raise Unavailable("CHECKPOINT_READ_FAILED", f"reading the checkpoint failed: {e}") from e
                    i += 1
        except BaseException as e:
            if not isinstance(e, Cancelled | Unavailable):
                log.exception("disk reader of worker %d failed", self.worker)
            self.error = e
        finally:
            self.done.set()
            self.on_event(self)

    def _bucket(self, bucket: Bucket, opened: dict[Path, Any], stack: ExitStack) -> None:
        named: NamedTensors = []
        for t in bucket.tensors:
            if self.cancel.is_set():
                raise Cancelled("the update was cancelled")
            f = self.files[t.name]
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            if not t.load:
                continue
            # A copy, never a view of the mapped file: the trainer may overwrite it once Prepare replied.
            tensor = opened[f].get_tensor(t.name).to(self.device, copy=True)
            if tensor.dtype != t.dtype or tuple(tensor.shape) != t.shape:  # the file changed since Prepare
                raise ValueError(f"tensor {t.name!r} in {f.name} changed since the checkpoint was validated")
            named.append((t.canonical, tensor))
        if self.streaming:
            self.wrote_served = True
            with self.adapter.weights_lock():
                self.tensors_applied += self.adapter.load_weights(self.worker, named)
        else:
            self.staged.append(named)
        self.last_arrival_at = time.monotonic()
        self.bytes_done += bucket.size_bytes
        self.buckets_done += 1
        self.on_event(self)

    def apply_swaps(self) -> int:
        """Nothing to swap: read tensors are copied into the served ones (:meth:`Engine.load_weights`)."""
        return 0

    def release(self, reuse: bool) -> None:
        """Let go of the tensors read (after apply, or when the update is abandoned)."""
        self.staged = []
