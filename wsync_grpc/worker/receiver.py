"""The receiver contract: what every transport's receiver offers, wherever it runs, and where it runs.

A transport (:mod:`wsync_grpc.transports`) makes one :class:`Receiver` per
worker for an update (:meth:`~wsync_grpc.transports.TransportPart.receiver`): a
thread that takes the update's bytes off its transport (the group's broadcasts,
a checkpoint's files) and applies them (streaming) or keeps them for Complete
(staged). It runs wherever the weights live: in the servicer's process for the
tensor and reference engines, inside an engine's worker process for vLLM
(:class:`~wsync_grpc.engines.host.WorkerHost`), and the front then follows it
through a stand-in with the same attributes (:mod:`wsync_grpc.service.workers`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from wsync_grpc.core.engine import WeightTarget
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.update import ReceivePlan
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed


class Receiver(Protocol):
    """One worker's receive of one update, as the update's owner reads it.

    Attributes:
        worker: the worker index (the engine's ``worker_devices`` order).
        armed: set once its first receive is posted (or nothing is declared yet, or nothing needs posting).
        done: set when it ended: every bucket arrived, or it failed.
        error: why it failed (``GroupError``, ``GroupTimeout``, ``Cancelled``, ``Unavailable``...); ``None`` while
            it has not.
        buckets_done: buckets received.
        bytes_done: bytes received, in bytes.
        tensors_applied: tensors loaded into the served weights (streaming as they arrive; staged at apply).
        wrote_served: whether it began writing into the served weights (they may be half written).
        last_arrival_at: when the last bucket arrived, on the host's monotonic clock (seconds); ``None`` before.
        staged: staged apply: per received bucket (or chunk), its ``(canonical name, tensor)`` pairs.
        buckets_verified: buckets whose bytes matched their digest (:mod:`wsync_grpc.core.digests`).
    """

    worker: int
    armed: threading.Event
    done: threading.Event
    error: BaseException | None
    buckets_done: int
    bytes_done: int
    tensors_applied: int
    wrote_served: bool
    last_arrival_at: float | None
    staged: list[NamedTensors]
    buckets_verified: int

    @property
    def timeout_s(self) -> float:
        """The bound of one wait of this receiver (the group's per-collective timeout), in seconds."""
        ...

    def start(self) -> None:
        """Start receiving, on a thread of its own."""
        ...

    def apply_swaps(self) -> int:
        """Staged apply: hand buffers the engine serves as they are over to it; the tensors swapped.

        The caller holds the engine's weights lock (see
        :class:`~wsync_grpc.core.engine.StorageSwap`); 0 where nothing was received so.
        """
        ...

    def release(self, reuse: bool) -> None:
        """Let go of what it received (after apply, or when the update is abandoned).

        Args:
            reuse: return its buffers to the pool; only when nothing can still write into them.
        """
        ...


@dataclass
class ReceiveSite:
    """Where one worker's receiver runs, and what it may use there.

    Attributes:
        worker: the worker index (the engine's ``worker_devices`` order, or a vLLM worker's global rank).
        device: the worker's device; received tensors live there.
        target: the weights a streaming update loads into (the engine, or a worker's model).
        feed: the update's buckets, read in order.
        cancel: set when the update is abandoned; the receiver stops at its next wait.
        on_event: called from the receiver's thread after each bucket and when it ends.
        group: the worker's membership of the weight-sync group; ``None`` where it has none (a disk update
            needs none).
        pool: the worker's flat receive buffers (kept between updates or not).
    """

    worker: int
    device: torch.device
    target: WeightTarget
    feed: BucketFeed
    cancel: threading.Event
    on_event: Callable[[Receiver], None]
    group: WeightSyncGroup | None
    pool: BufferPool


class ReceiverState:
    """The attributes of a :class:`Receiver`, at their start values (a receiver's own, set by its thread).

    Args:
        worker: the worker index.
    """

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.armed = threading.Event()
        """Set once the first receive is posted (or nothing needs posting first)."""
        self.done = threading.Event()
        """Set when the receive ended (every bucket arrived, or it failed)."""
        self.error: BaseException | None = None
        self.buckets_done = 0
        self.bytes_done = 0
        self.tensors_applied = 0
        self.wrote_served = False
        """Whether it began writing into the served weights (they may be half written)."""
        self.first_post_at: float | None = None
        self.last_arrival_at: float | None = None
        self.staged: list[NamedTensors] = []
        """Staged apply: per received bucket (or chunk), the ``(canonical name, tensor)`` pairs."""
        self.buckets_verified = 0
        """Buckets whose bytes matched their digest."""


class ReceiverThread(threading.Thread, ReceiverState):
    """A receiver running on a thread of its own at ``site``, for the update ``plan`` describes.

    Subclasses implement ``run`` (receive, set the progress attributes, call ``on_event`` after each
    bucket and when it ends) and the rest of :class:`Receiver`.

    Args:
        name: the thread's name.
        site: where it runs.
        plan: the update.
    """

    def __init__(self, name: str, site: ReceiveSite, plan: ReceivePlan) -> None:
        threading.Thread.__init__(self, name=name, daemon=True)
        ReceiverState.__init__(self, site.worker)
        self.target = site.target
        self.feed = site.feed
        self.cancel = site.cancel
        self.on_event = site.on_event
        self.streaming = plan.streaming
        self.delta = any(b.has_delta for b in plan.buckets)
        """The update is a delta (a bucket of it has a delta entry)."""


class StagedApart:
    """The target of an update kept apart from the served model (a LoRA adapter, loaded whole at Complete).

    A :class:`~wsync_grpc.core.engine.WeightTarget` that takes no load: such an
    update is always staged, so its receivers only keep what they receive.
    """

    def weights_lock(self) -> contextlib.AbstractContextManager[object]:
        """No lock: nothing served changes."""
        return contextlib.nullcontext()

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Never called for a staged update.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("this update is kept apart from the served model; nothing loads into it")

    def get_weight(self, name: str) -> torch.Tensor:
        """No served tensor stands for it.

        Raises:
            KeyError: always.
        """
        raise KeyError(name)


STAGED_APART = StagedApart()
"""The one :class:`StagedApart` target."""
