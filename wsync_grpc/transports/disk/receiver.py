"""The disk transport's receiving side: one thread per engine worker, loading a disk update's buckets from files.

It is a :class:`~wsync_grpc.worker.receiver.Receiver` as the broadcast's is, so that the update
session, Complete's two phases, Cancel, Watch, the checksums and the metrics
treat a disk update exactly as a broadcast one. Staged apply: every tensor is
copied out of the file (the file may be overwritten afterwards) and kept
until Complete applies it between two inference steps. Streaming apply: each
bucket is loaded into the served weights as it is read, the engine frozen.
The cancel event is checked between tensors.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from wsync_grpc.core.errors import Cancelled, Unavailable
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.core.update import ReceivePlan
from wsync_grpc.worker.receiver import ReceiverThread, ReceiveSite

log = logging.getLogger(__name__)


class DiskReceiver(ReceiverThread):
    """Reads one disk update's buckets for one worker (a :class:`~wsync_grpc.worker.receiver.Receiver`).

    Args:
        site: where it runs (no group needed); tensors are moved to ``site.device`` as they are read.
        plan: the update: its apply mode and ``files`` (tensor name -> the safetensors file holding it); its
            buckets come through ``site.feed``, closed (a disk update declares them all at Prepare).
    """

    def __init__(self, site: ReceiveSite, plan: ReceivePlan) -> None:
        super().__init__(f"wsync-disk-reader-{site.worker}", site, plan)
        self.device = site.device
        self.files = plan.files

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
            with self.target.weights_lock():
                self.tensors_applied += self.target.load_weights(self.worker, named)
        else:
            self.staged.append(named)
        self.last_arrival_at = time.monotonic()
        self.bytes_done += bucket.size_bytes
        self.buckets_done += 1
        self.on_event(self)

    def apply_swaps(self) -> int:
        """Nothing to swap: read tensors are copied into the served ones (:meth:`WeightTarget.load_weights`)."""
        return 0

    def release(self, reuse: bool) -> None:
        """Let go of the tensors read (after apply, or when the update is abandoned)."""
        self.staged = []
