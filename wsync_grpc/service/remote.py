"""The receivers of an update whose workers are other processes (:class:`~wsync_grpc.core.engine.RemoteWorkers`).

With the reference engine the servicer runs one
:class:`~wsync_grpc.transports.broadcast.receiver.WorkerReceiver` thread per worker. With
vLLM the receivers run inside vLLM's worker processes; here each one is
stood for by a :class:`RemoteReceiver` with the same progress attributes,
kept current by :class:`RemoteReceivers`: one thread that arms every worker
and then polls their progress until all have ended or the update is
abandoned, and calls the session back on every change, as a local receiver
does after each bucket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from wsync_grpc.core.engine import Engine, RemoteWorkers, WorkerProgress
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Bucket
from wsync_grpc.core.lora import LoraAdapters
from wsync_grpc.worker.feed import BucketFeed

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
"""How often the workers' progress is polled while an update is received, in seconds.

Each poll is one ``collective_rpc`` that runs between two inference steps.
"""


class ReceiverView(Protocol):
    """What the update session reads of a receiver, local or remote."""

    worker: int
    armed: threading.Event
    done: threading.Event
    error: BaseException | None
    buckets_done: int
    bytes_done: int
    tensors_applied: int
    wrote_served: bool
    last_arrival_at: float | None

    @property
    def timeout_s(self) -> float:
        """The group's per-collective timeout, in seconds."""
        ...

    def release(self, reuse: bool) -> None:
        """Let go of the received buffers."""
        ...


class RemoteReceiver:
    """One remote worker's receive, as the session sees it (the attributes of a local receiver).

    Args:
        worker: the worker index.
        timeout_s: the group's per-collective timeout, in seconds.
    """

    def __init__(self, worker: int, timeout_s: float) -> None:
        self.worker = worker
        self._timeout_s = timeout_s
        self.armed = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.buckets_done = 0
        self.bytes_done = 0
        self.tensors_applied = 0
        self.wrote_served = False
        self.last_arrival_at: float | None = None

    @property
    def timeout_s(self) -> float:
        """The group's per-collective timeout, in seconds."""
        return self._timeout_s

    def release(self, reuse: bool) -> None:
        """Nothing to release here: the worker holds its buffers (released at apply or abandon)."""

    def update(self, p: WorkerProgress, streaming: bool) -> bool:
        """Take a polled progress; return whether anything changed."""
        changed = (p.buckets_done, p.done, p.error is not None) != (
            self.buckets_done,
            self.done.is_set(),
            self.error is not None,
        )
        self.buckets_done, self.bytes_done = p.buckets_done, p.bytes_done
        self.last_arrival_at = p.last_arrival_at
        if streaming and p.buckets_done:
            self.wrote_served = True  # a streaming receive loads into the model as it goes
        if p.error is not None and self.error is None:
            self.error = p.error
        if p.armed:
            self.armed.set()
        if p.done:
            self.done.set()
        return changed


class RemoteReceivers:
    """Arms an update on every remote worker, then keeps their :class:`RemoteReceiver` current.

    Args:
        workers: the engine.
        count: how many workers it has.
        feed: the update's buckets (those declared when armed go with the arming).
        header: the update (how it travels and applies; whether it carries an adapter).
        timeout_s: the group's per-collective timeout, in seconds (also bounds the arming).
        cancel: set when the update is abandoned; polling stops.
        on_event: called with a receiver after each change (from the polling thread).
        files: a disk update's tensor name -> file (the workers read them); ``None`` for a broadcast.
    """

    def __init__(
        self,
        workers: RemoteWorkers,
        count: int,
        feed: BucketFeed,
        header: UpdateHeader,
        timeout_s: float,
        cancel: threading.Event,
        on_event: Callable[[RemoteReceiver], None],
        files: Mapping[str, Path] | None = None,
    ) -> None:
        self.workers = workers
        self._files = files
        self.receivers = [RemoteReceiver(i, timeout_s) for i in range(count)]
        self._feed = feed
        self._header = header
        self._streaming = header.apply_mode is ApplyMode.STREAMING
        self._timeout_s = timeout_s
        self._cancel = cancel
        self._on_event = on_event
        self._thread = threading.Thread(target=self._run, name="wsync-remote-receivers", daemon=True)

    def start(self) -> None:
        """Arm the workers and poll them, on a thread of its own."""
        self._thread.start()

    def declare(self, buckets: Sequence[Bucket], closed: bool) -> None:
        """Send further buckets of an incremental update to every worker (``closed``: the last ones)."""
        self.workers.declare_to_workers(buckets, closed)

    def apply(self, engine: Engine, timeout_s: float) -> None:
        """The workers load what they received and publish the weight version; an adapter is loaded by ``engine``.

        An adapter update's tensors come back from the first worker
        (:meth:`~wsync_grpc.core.engine.RemoteWorkers.adapter_from_workers`)
        and go to :meth:`~wsync_grpc.core.lora.LoraAdapters.load_adapter`, as
        a reference engine's do. Weights lock held.

        Raises:
            Exception: from the workers or the engine (see those methods).
        """
        h = self._header
        if h.adapter is None:
            applied = self.workers.apply_on_workers(timeout_s, h.weight_version)
        else:
            assert isinstance(engine, LoraAdapters), "validated at Prepare"
            applied = engine.load_adapter(h.adapter, h.weight_version, self.workers.adapter_from_workers(timeout_s))
        for r in self.receivers:
            r.tensors_applied = applied

    def _run(self) -> None:
        declared = [b for b in (self._feed.get(i, 0) for i in range(len(self._feed))) if b is not None]
        try:
            h = self._header
            self.workers.arm_workers(
                h.layout, h.apply_mode, declared, self._feed.closed, self._timeout_s, self._files, h.adapter is not None
            )
        except BaseException as e:
            log.warning("arming the workers failed: %s", e)
            self._end_all(e)
            return
        for r in self.receivers:
            r.armed.set()
        while not self._cancel.is_set() and not all(r.done.is_set() for r in self.receivers):
            try:
                progress = self.workers.worker_progress()
            except BaseException as e:
                self._end_all(e)
                return
            for r, p in zip(self.receivers, progress, strict=False):
                if r.update(p, self._streaming):
                    self._on_event(r)
            time.sleep(POLL_INTERVAL_S)

    def _end_all(self, e: BaseException) -> None:
        for r in self.receivers:
            r.error = r.error or e
            r.armed.set()
            r.done.set()
            self._on_event(r)
