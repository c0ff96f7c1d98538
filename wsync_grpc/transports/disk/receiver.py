"""The disk transport's receiving side: one thread per engine worker, loading a disk update's buckets from files.

It is a :class:`~wsync_grpc.worker.receiver.Receiver` as the broadcast's is, so that the update
session, Complete's two phases, Cancel, Watch, the checksums and the metrics
treat a disk update exactly as a broadcast one. Staged apply: every tensor is
copied out of the file (the file may be overwritten afterwards) and kept
until Complete applies it between two inference steps. Streaming apply: each
bucket is loaded into the served weights as it is read, the engine frozen.
The cancel event is checked between tensors.

Files are read only through the descriptors Prepare opened beneath a root
(:mod:`~wsync_grpc.transports.disk.confined`): a reader in the process that
planned the update takes its own reference to each shared open file when it
is made; a reader in another process (an engine's worker, the plan having
crossed as :func:`~wsync_grpc.core.messages.plan_to_msg`) opens each file
again beneath its root, never through a symlink, and refuses any file but
the one Prepare opened (same ``st_dev`` and ``st_ino``).
"""

from __future__ import annotations

import logging
import time

from wsync_grpc.core.errors import Cancelled, Unavailable, WsyncError
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.core.update import ReceivePlan, SourceFile
from wsync_grpc.transports.disk.confined import OpenFile, SharedFile, reopen, shown
from wsync_grpc.transports.disk.safetensors_file import SAFETENSORS_DTYPES, HeaderEntry, read_header, read_tensor
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
        self._open: dict[SourceFile, OpenFile] = {}
        self._shared: list[SharedFile] = []
        self._reopened: list[OpenFile] = []
        self._headers: dict[SourceFile, dict[str, HeaderEntry]] = {}
        # Now, while Prepare still holds the files it opened: this reader's own references to them.
        for src in set(plan.files.values()):
            if isinstance(src.handle, SharedFile) and (f := src.handle.acquire()) is not None:
                self._shared.append(src.handle)
                self._open[src] = f

    @property
    def timeout_s(self) -> float:
        """The bound reported for a stalled read, in seconds (no group: the default group timeout)."""
        return DEFAULT_GROUP_TIMEOUT_S

    def run(self) -> None:
        try:
            self.armed.set()
            self.first_post_at = time.monotonic()
            i = 0
            while (bucket := self.feed.get(i, 0)) is not None:
                try:
                    self._bucket(bucket)
                except (OSError, ValueError) as e:
                    raise Unavailable("CHECKPOINT_READ_FAILED", f"reading the checkpoint failed: {e}") from e
                i += 1
        except BaseException as e:
            if not isinstance(e, Cancelled | WsyncError):
                log.exception("disk reader of worker %d failed", self.worker)
            self.error = e
        finally:
            self._close()
            self.done.set()
            self.on_event(self)

    def _file(self, src: SourceFile) -> tuple[OpenFile, dict[str, HeaderEntry]]:
        """``src`` open (this process's shared descriptor, or opened again beneath its root) and its header."""
        f = self._open.get(src)
        if f is None:
            f = self._open[src] = reopen(src)
            self._reopened.append(f)
        header = self._headers.get(src)
        if header is None:
            header = self._headers[src] = {e.name: e for e in read_header(f).entries}
        return f, header

    def _bucket(self, bucket: Bucket) -> None:
        named: NamedTensors = []
        for t in bucket.tensors:
            if self.cancel.is_set():
                raise Cancelled("the update was cancelled")
            src = self.files[t.name]
            f, header = self._file(src)
            if not t.load:
                continue
            entry = header.get(t.name)
            if entry is None or SAFETENSORS_DTYPES.get(entry.dtype) != t.dtype or entry.shape != t.shape:
                raise ValueError(f"tensor {t.name[:200]!r} in {shown(src.name)} changed since it was validated")
            # Read into memory of its own: the trainer may overwrite the file once Prepare replied.
            named.append((t.canonical, read_tensor(f, entry).to(self.device)))
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

    def _close(self) -> None:
        """Let go of every file this reader opened or shared."""
        for shared in self._shared:
            shared.release()
        for f in self._reopened:
            f.close()
        self._shared, self._reopened, self._open = [], [], {}

    def apply_swaps(self) -> int:
        """Nothing to swap: read tensors are copied into the served ones (:meth:`WeightTarget.load_weights`)."""
        return 0

    def release(self, reuse: bool) -> None:
        """Let go of the tensors read (after apply, or when the update is abandoned)."""
        self.staged = []
