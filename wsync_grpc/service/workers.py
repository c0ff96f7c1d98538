"""Where an update's receivers run: threads of the servicer's process, or an engine's worker processes.

:func:`update_workers` picks one of two :class:`UpdateWorkers` for an update:

- :class:`LocalWorkers`: the engine's weights live in this process (the tensor
  and reference engines, a :class:`~wsync_grpc.core.engine.WeightTarget`); one
  receiver per worker, made by the update's transport
  (:meth:`~wsync_grpc.transports.TransportPart.receiver`), runs as a thread here;
- :class:`RemoteWorkerSet`: the engine's workers are other processes (vLLM's, a
  :class:`~wsync_grpc.core.engine.RemoteWorkers`); each runs its receiver in
  its own :class:`~wsync_grpc.engines.host.WorkerHost`, armed with the update's
  :class:`~wsync_grpc.core.update.ReceivePlan`; here one
  :class:`RemoteReceiver` per worker stands for it, kept current by a polling thread.

Either way the session reads the same :class:`~wsync_grpc.worker.receiver.Receiver`
attributes, and applies through the same two calls: :meth:`UpdateWorkers.apply_weights`
for base weights and :meth:`UpdateWorkers.adapter_tensors` for a LoRA adapter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.engine import Engine, ReceiverProgress, RemoteWorkers, WeightTarget
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.packing import NamedTensors
from wsync_grpc.core.update import Payload, ReceivePlan
from wsync_grpc.service.membership import Membership
from wsync_grpc.transports import TransportPart
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed
from wsync_grpc.worker.receiver import STAGED_APART, Receiver, ReceiverState, ReceiveSite

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
"""How often remote workers' progress is polled while an update is received, in seconds.

Each poll is one call to every worker (vLLM: one ``collective_rpc``, run between two inference steps);
the next is asked this long after the last was, or at once when the answer took longer.
"""


class UpdateWorkers(Protocol):
    """The receivers of one update, wherever they run, and how what they received is applied."""

    @property
    def receivers(self) -> Sequence[Receiver]:
        """One per worker, in worker order."""
        ...

    def start(self) -> None:
        """Start every receiver (remote: arm every worker, on a thread of its own)."""
        ...

    def declare(self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None) -> None:
        """Further buckets of an incremental update and digests declared after their buckets (bucket index ->
        digest); ``closed``: the declarations ended (Complete). The session's feed already has them."""
        ...

    def apply_weights(self, timeout_s: float, weight_version: str) -> int:
        """Base weights: load what every worker staged (a streaming update is loaded already), publish the version.

        Weights lock held. The engine serves ``weight_version`` from its next step on.

        Returns:
            The tensors the first worker loaded.

        Raises:
            Exception: from the engine or its workers (the weights may be half applied).
        """
        ...

    def adapter_tensors(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """A LoRA adapter: the first worker's received tensors (PEFT names); every worker lets its copy go.

        Raises:
            Exception: a worker's receive failed or did not end within ``timeout_s`` seconds.
        """
        ...


def update_workers(
    engine: Engine,
    membership: Membership,
    pools: Sequence[BufferPool],
    transport: TransportPart,
    plan: ReceivePlan,
    feed: BucketFeed,
    cancel: threading.Event,
    on_event: Callable[[Receiver], None],
) -> UpdateWorkers:
    """The receivers of the update ``plan`` describes (not started), where the engine's weights live.

    An adapter that needs no group (a PEFT directory on disk) is read in this
    process whatever the engine's workers (:func:`read_once_here`).
    """
    if isinstance(engine, RemoteWorkers) and not read_once_here(plan, transport):
        return RemoteWorkerSet(engine, len(membership.devices), plan, membership.group_timeout_s, cancel, on_event)
    target: WeightTarget = STAGED_APART  # an adapter is kept apart from the model until Complete loads it
    if plan.payload is Payload.WEIGHTS:
        assert isinstance(engine, WeightTarget), "an engine's weights live in this process or in RemoteWorkers"
        target = engine
    return LocalWorkers(engine, target, membership, pools, transport, plan, feed, cancel, on_event)


def read_once_here(plan: ReceivePlan, transport: TransportPart) -> bool:
    """Whether the update is read once, by the first worker of this process: an adapter that needs no group.

    The engine loads adapters in this process (:class:`~wsync_grpc.core.lora.LoraAdapters`), and
    without a collective no other worker has to take part.
    """
    return plan.payload is Payload.ADAPTER and not transport.needs_group


class LocalWorkers:
    """Receivers running as threads of this process (an :class:`UpdateWorkers`).

    ``target`` is what a streaming update loads into and a staged one is applied to (the engine for
    base weights; :data:`~wsync_grpc.worker.receiver.STAGED_APART` for an adapter). Every worker
    receives, except an update :func:`read_once_here` reads with the first worker only.
    """

    def __init__(
        self,
        engine: Engine,
        target: WeightTarget,
        membership: Membership,
        pools: Sequence[BufferPool],
        transport: TransportPart,
        plan: ReceivePlan,
        feed: BucketFeed,
        cancel: threading.Event,
        on_event: Callable[[Receiver], None],
    ) -> None:
        self._engine = engine
        self._target = target
        self._plan = plan
        devices = membership.devices[:1] if read_once_here(plan, transport) else membership.devices
        groups = membership.groups if transport.needs_group else [None] * len(devices)
        self.receivers: list[Receiver] = [
            transport.receiver(ReceiveSite(i, d, target, feed, cancel, on_event, g, pools[i]), plan)
            for i, (d, g) in enumerate(zip(devices, groups, strict=False))
        ]

    def start(self) -> None:
        """Start every receiver thread."""
        for r in self.receivers:
            r.start()

    def declare(self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None) -> None:
        """Nothing to send: the receivers read the feed."""

    def apply_weights(self, timeout_s: float, weight_version: str) -> int:
        """Copy (or swap in) what every worker staged; publish ``weight_version`` to the engine."""
        if not self._plan.streaming:
            for r in self.receivers:
                for named in r.staged:
                    r.tensors_applied += self._target.load_weights(r.worker, named)
                r.tensors_applied += r.apply_swaps()
        self._engine.set_weight_version(weight_version)
        return self.receivers[0].tensors_applied

    def adapter_tensors(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """The first worker's staged tensors (every receiver ended: Complete waited for them)."""
        staged: list[NamedTensors] = self.receivers[0].staged
        return [pair for named in staged for pair in named]


class RemoteReceiver(ReceiverState):
    """One remote worker's receive, as the session sees it (a :class:`~wsync_grpc.worker.receiver.Receiver`).

    Args:
        worker: the worker index.
        timeout_s: the group's per-collective timeout, in seconds.
    """

    def __init__(self, worker: int, timeout_s: float) -> None:
        super().__init__(worker)  # staged stays empty: the worker holds what it staged
        self._timeout_s = timeout_s

    @property
    def timeout_s(self) -> float:
        """The group's per-collective timeout, in seconds."""
        return self._timeout_s

    def start(self) -> None:
        """Nothing to start: :class:`RemoteWorkerSet` arms the workers."""

    def apply_swaps(self) -> int:
        """Nothing to swap here: the worker applies what it holds."""
        return 0

    def release(self, reuse: bool) -> None:
        """Nothing to release here: the worker holds its buffers (released at apply or abandon)."""

    def update(self, p: ReceiverProgress, streaming: bool) -> bool:
        """Take a polled progress; return whether anything changed."""
        changed = (p.buckets_done, p.done, p.error is not None) != (
            self.buckets_done,
            self.done.is_set(),
            self.error is not None,
        )
        self.buckets_done, self.bytes_done = p.buckets_done, p.bytes_done
        self.buckets_verified = p.buckets_verified
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


class RemoteWorkerSet:
    """Arms an update on every remote worker, then keeps their :class:`RemoteReceiver` current.

    An :class:`UpdateWorkers`.

    Args:
        workers: the engine.
        count: how many workers it has.
        plan: the update as every worker receives it (the buckets declared so far go with the arming).
        timeout_s: the group's per-collective timeout, in seconds.
        cancel: set when the update is abandoned; polling stops.
        on_event: called with a receiver after each change (from the polling thread).
    """

    def __init__(
        self,
        workers: RemoteWorkers,
        count: int,
        plan: ReceivePlan,
        timeout_s: float,
        cancel: threading.Event,
        on_event: Callable[[Receiver], None],
    ) -> None:
        self.workers = workers
        self._plan = plan
        self.receivers: list[RemoteReceiver] = [RemoteReceiver(i, timeout_s) for i in range(count)]
        self._cancel = cancel
        self._on_event = on_event
        self._thread = threading.Thread(target=self._run, name="wsync-remote-receivers", daemon=True)

    def start(self) -> None:
        """Arm the workers and poll them, on a thread of its own."""
        self._thread.start()

    def declare(self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None) -> None:
        """Send further buckets and late digests to every worker (``closed``: the declarations ended)."""
        self.workers.declare_to_workers(buckets, closed, digests)

    def apply_weights(self, timeout_s: float, weight_version: str) -> int:
        """The workers load what they received; the engine publishes ``weight_version`` with that apply."""
        applied = self.workers.apply_on_workers(timeout_s, weight_version)
        for r in self.receivers:
            r.tensors_applied = applied
        return applied

    def adapter_tensors(self, timeout_s: float) -> list[tuple[str, torch.Tensor]]:
        """The first worker's tensors (:meth:`~wsync_grpc.core.engine.RemoteWorkers.adapter_from_workers`)."""
        return self.workers.adapter_from_workers(timeout_s)

    def _run(self) -> None:
        try:
            self.workers.arm_workers(self._plan)
        except BaseException as e:
            log.warning("arming the workers failed: %s", e)
            self._end_all(e)
            return
        for r in self.receivers:
            r.armed.set()
        while not self._cancel.is_set() and not all(r.done.is_set() for r in self.receivers):
            asked = time.monotonic()
            try:
                progress = self.workers.worker_progress()
            except BaseException as e:
                self._end_all(e)
                return
            for r, p in zip(self.receivers, progress, strict=False):
                if r.update(p, self._plan.streaming):
                    self._on_event(r)
            time.sleep(max(0.0, asked + POLL_INTERVAL_S - time.monotonic()))  # a poll waits for a step already

    def _end_all(self, e: BaseException) -> None:
        for r in self.receivers:
            r.error = r.error or e
            r.armed.set()
            r.done.set()
            self._on_event(r)
