"""The worker host: wsync's side of an engine whose weights live in worker processes (vLLM's; SGLang's next).

One :class:`WorkerHost` per worker process. It joins the weight-sync group at
``rank_offset`` plus the worker's global rank, arms the update's receiver (made
by the update's transport, :func:`~wsync_grpc.transports.transport_for`, from
the :class:`~wsync_grpc.core.update.ReceivePlan` the front sent), reports its
progress, applies what it received between two of the engine's steps, hands a
LoRA adapter's tensors back to the front, and abandons an update or leaves the
group on request. Nothing here knows the engine: what loads weights into the
worker's model is the engine's glue, a :class:`ModelGlue` (vLLM's:
:mod:`wsync_grpc.engines.vllm.transfer`). The engine's front drives the host
through its own IPC (vLLM's ``collective_rpc``, :mod:`wsync_grpc.engines.vllm.worker`)
with the msgpack-native messages of :mod:`wsync_grpc.core.messages`.

Not thread-safe: every method runs on the worker's main thread, between two
of its steps; only the receiver (and a staged update's preparation) run beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.engine import ReceiverProgress
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.timeouts import Deadline
from wsync_grpc.core.update import Payload, ReceivePlan
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME, WeightSyncGroup, join_group
from wsync_grpc.transports import transport_for
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed
from wsync_grpc.worker.receiver import STAGED_APART, Receiver, ReceiveSite

log = logging.getLogger(__name__)

Swap = Callable[[], None]
"""Puts weights prepared beside the live model into service (between two steps)."""

PREPARE_POLL_S = 0.05
"""Longest a staged update's preparation sleeps between looks at the receive, in seconds."""


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int]) -> Iterator[None]:
    """Threads started inside run on ``cpus`` (every thread they start too); empty: where the caller runs.

    Linux gives a new thread its creator's CPU affinity, so the calling
    thread takes ``cpus`` while they start and gets its own back after
    (``os.sched_setaffinity``, as vLLM's NIXL connector moves its KV
    transfers off the cores of the forward). Where the platform has no
    affinity, or refuses ``cpus``, threads start where the caller runs.
    """
    setter = getattr(os, "sched_setaffinity", None)
    if not cpus or setter is None:
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        setter(0, cpus)
    except OSError as e:
        log.warning("cannot run background threads on CPUs %s: %s", sorted(cpus), e)
        yield
        return
    try:
        yield
    finally:
        setter(0, own)


class ModelGlue(Protocol):
    """What a worker host needs of the engine's model in one worker process (the engine's glue)."""

    def begin_reload(self) -> None:
        """Start loading checkpoint-format tensors into the live model (between two steps, or frozen)."""
        ...

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format ``(name, tensor)`` pairs (a reload is in progress)."""
        ...

    def end_reload(self) -> None:
        """Finish the reload: the model serves what was loaded (processed as at load time)."""
        ...

    def preparation(self) -> Preparation | None:
        """Staged: start building the served form of an update beside the live model, off the step loop.

        Returns:
            The preparation the host feeds each received bucket to; ``None`` when this
            engine prepares nothing beside the model (the apply then reloads).

        Raises:
            Exception: it could not start; the apply then reloads (not the update's failure).
        """
        ...


class Preparation(Protocol):
    """A staged update's served form, built beside the live model while its buckets arrive (off the step loop)."""

    def add(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Take one received bucket's checkpoint-format ``(name, tensor)`` pairs (read, not kept past the swap)."""
        ...

    def finish(self) -> None:
        """Complete what the buckets given to :meth:`add` left to do, once the last one arrived."""
        ...

    def swap(self) -> None:
        """Put the prepared weights into service (between two steps)."""
        ...


class _ModelTarget:
    """The worker's model as a receiver's target (:class:`~wsync_grpc.core.engine.WeightTarget`).

    Loads (streaming) go through the glue inside the reload the update began; the tensors
    are copied first, because an engine may keep a layer's loads until all of
    its tensors arrived, and the receiver reuses its buffers at once. The served tensors cannot be read
    back (fused, sliced, prepacked): a delta's base is the copy the worker kept of the update that wrote
    them (``base``, by canonical name, in the wire dtype), and what this update loads is kept for the next
    in ``kept`` when the update asks (:attr:`~wsync_grpc.core.update.ReceivePlan.keep_base`).
    """

    def __init__(self, glue: ModelGlue, base: Mapping[str, torch.Tensor], kept: dict[str, torch.Tensor] | None) -> None:
        self._glue = glue
        self._base = base
        self._kept = kept
        self.base_writable = kept is not None
        """A delta may be applied into the kept copy itself (:func:`~wsync_grpc.worker.delta.expand`): the update
        keeps what it results in, and a failed one drops the copy (:meth:`WorkerHost.abandon`)."""
        self._lock = threading.Lock()

    def weights_lock(self) -> contextlib.AbstractContextManager[object]:
        return self._lock

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        owned = [(n, t.clone()) for n, t in tensors]
        self._glue.load(owned)
        if self._kept is not None:
            self._kept.update(owned)
        return len(owned)

    def get_weight(self, name: str) -> torch.Tensor:
        """The kept copy of what the worker serves as ``name``, in the wire dtype of the update that wrote it.

        Raises:
            KeyError: the worker kept none.
        """
        return self._base[name]


class WorkerHost:
    """One worker process's member of the weight-sync group and host of the update in flight.

    Args:
        glue: how the engine loads weights into this worker's model.
        device: the worker's device.
        global_rank: the worker's rank among all the engine's workers (data-parallel replicas included).
    """

    def __init__(self, glue: ModelGlue, device: torch.device, global_rank: int) -> None:
        self.glue = glue
        self.device = device
        self.global_rank = global_rank
        self.group: WeightSyncGroup | None = None
        self.rank = -1
        self.receiver: Receiver | None = None
        self.plan: ReceivePlan | None = None
        self.feed = BucketFeed()
        self.cancel = threading.Event()
        self.pool = BufferPool(device, keep=True)
        self._reloading = False
        self._swap: Swap | None = None
        self._preparer: threading.Thread | None = None
        self._arrived = threading.Event()  # set by the receiver after each bucket and at its end
        self.base: dict[str, torch.Tensor] = {}
        """The tensors the worker serves, as the updates that wrote them sent them (canonical name -> tensor in the
        wire dtype), kept where those updates asked (``ReceivePlan.keep_base``): the base of a delta."""
        self._kept: dict[str, torch.Tensor] | None = None  # what the update in flight keeps, once applied
        self.background_cpus: frozenset[int] = frozenset()
        """CPUs the update's threads (receiver, preparation) run on; empty: where the worker's main thread runs."""

    # --------------------------------------------------------------- group

    def join(self, params: GroupParams) -> int:
        """Join the weight-sync group at ``params.rank_offset`` + this worker's global rank; return that rank.

        Blocks until the group formed, at most ``params.timeout_s`` seconds. The group's own threads (gloo's
        send and receive loops) run on :attr:`background_cpus`.

        Raises:
            GroupTimeout, GroupError, ValueError: see :func:`~wsync_grpc.group.process_group.join_group`.
        """
        self.leave()
        rank = params.rank_offset + self.global_rank
        with threads_started_on(self.background_cpus):
            self.group = join_group(
                master_address=params.master_address,
                master_port=params.master_port,
                rank=rank,
                world_size=params.world_size,
                group_name=params.group_name or DEFAULT_GROUP_NAME,
                backend=params.backend,
                device=self.device,
                timeout_s=params.timeout_s,
                trainer_ranks=params.trainer_ranks,
            )
        self.rank = rank
        log.info("worker %d joined weight-sync group at rank %d of %d", self.global_rank, rank, params.world_size)
        return rank

    def leave(self) -> None:
        """Abandon any update in flight and leave the group. Idempotent."""
        self.abandon()
        if self.group is not None:
            self.group.destroy()
            self.group = None

    # -------------------------------------------------------------- update

    def arm(self, plan: ReceivePlan) -> None:
        """Start receiving ``plan`` in the background; return once the first receive is posted.

        Streaming: a reload begins (the front has frozen the engine). Staged base
        weights: each bucket is prepared beside the model as it arrives
        (:meth:`ModelGlue.preparation`). A LoRA adapter is kept apart until :meth:`take`.
        The receiver and the preparation run on :attr:`background_cpus`.

        An update still held here is one the front has ended without telling this worker (it arms an update
        only once the last one ended; it tells the workers of a failed one by their leaving the group, which
        an update through a transport without a group, e.g. shared memory or a disk read, never formed): it
        is abandoned first (:meth:`abandon`), as the next Init's join would abandon a failed broadcast.

        Raises:
            RuntimeError: the transport needs the group and this worker is not a member.
            TimeoutError: not armed within ``plan.timeout_s`` seconds.
            Unimplemented: a transport not built.
        """
        transport = transport_for(plan.transport)
        if self.group is None and transport.needs_group:
            raise RuntimeError("this worker is not a member of a weight-sync group")
        if self.receiver is not None:
            stale = self.plan.update_id if self.plan is not None else "?"
            log.warning("worker %d: abandoning update %s, ended by the front, before the next", self.global_rank, stale)
            self.abandon()
        self.plan = plan
        self.feed = BucketFeed()
        self.feed.extend(list(plan.buckets))
        if plan.closed:
            self.feed.close()
        self.cancel = threading.Event()
        self._kept = {} if plan.keep_base else None
        if plan.streaming:
            self._begin_reload()
        target = _ModelTarget(self.glue, self.base, self._kept) if plan.payload is Payload.WEIGHTS else STAGED_APART
        site = ReceiveSite(
            self.global_rank,
            self.device,
            target,
            self.feed,
            self.cancel,
            lambda r: self._arrived.set(),
            self.group if transport.needs_group else None,
            self.pool,
        )
        self.receiver = transport.receiver(site, plan)
        self._swap = None
        self._preparer = None
        with threads_started_on(self.background_cpus):
            self.receiver.start()
            if not plan.streaming and plan.payload is Payload.WEIGHTS:
                self._preparer = threading.Thread(target=self._prepare, name="wsync-prepare", daemon=True)
                self._preparer.start()
        if not self.receiver.armed.wait(Deadline(plan.timeout_s).left()):
            raise TimeoutError(f"the receiver was not armed within {plan.timeout_s:g} s")

    def declare(self, buckets: Sequence[Bucket], closed: bool, digests: Mapping[int, Digest] | None = None) -> None:
        """Feed further buckets of an incremental update and digests declared after their buckets (bucket
        index -> digest); ``closed``: the declarations ended (Complete), none will follow."""
        self.feed.extend(list(buckets))
        if digests:
            self.feed.add_digests(digests)
        if closed:
            self.feed.close_digests()

    def _prepare(self) -> None:
        """Staged: build the served form beside the model as the buckets arrive (its own thread).

        Each received bucket is handed to the engine's :class:`Preparation` as
        soon as it arrived, so that after the last byte only that bucket's
        share is left. A failure here is not the update's: :meth:`apply` then
        reloads between two steps.
        """
        r = self.receiver
        assert r is not None
        t0 = time.monotonic()
        try:
            prep = self.glue.preparation()
            if prep is None:
                return
            fed = 0
            while True:
                self._arrived.clear()
                ended = r.done.is_set()  # read first: a bucket appended after it is drained below
                while fed < len(r.staged):
                    prep.add(r.staged[fed])
                    fed += 1
                if ended or self.cancel.is_set():
                    break
                self._arrived.wait(PREPARE_POLL_S)
            if r.error is not None or self.cancel.is_set():
                return
            prep.finish()
        except Exception:
            log.exception("preparing the update beside the model failed; it is applied by a reload")
            return
        self._swap = prep.swap
        last = r.last_arrival_at
        log.debug(
            "update prepared beside the model in %.3f s, %.3f s after the last bucket arrived",
            time.monotonic() - t0,
            time.monotonic() - last if last is not None else 0.0,
        )

    def progress(self) -> ReceiverProgress:
        """Where this worker's receive stands (all zero with no update in flight).

        Staged: ``done`` once the received weights are also prepared beside the
        model, so that the apply at Complete is only the swap.
        """
        r = self.receiver
        if r is None:
            return ReceiverProgress(self.rank, False, False, 0, 0, None, None)
        prepared = self._preparer is None or not self._preparer.is_alive()
        return ReceiverProgress(
            rank=self.rank,
            armed=r.armed.is_set(),
            done=r.done.is_set() and prepared,
            buckets_done=r.buckets_done,
            bytes_done=r.bytes_done,
            last_arrival_at=r.last_arrival_at,
            error=r.error,
            buckets_verified=r.buckets_verified,
        )

    def apply(self, timeout_s: float) -> int:
        """Apply the received update (between two steps); return the tensors loaded.

        Staged: the prepared weights swapped in, or one reload of every received
        tensor. Streaming: the reload begun at :meth:`arm` is finished.

        Raises:
            RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
        """
        r = self._received(timeout_s)
        assert self.plan is not None
        try:
            if self._preparer is not None:
                self._preparer.join(Deadline(timeout_s).left())
            kept = self._kept
            if kept is not None and not self.plan.streaming:  # copied out before the buffers go back to the pool
                # (a delta's tensors were rebuilt in the kept copy itself: kept as they are)
                kept.update(
                    (n, t if self.base.get(n) is t else t.detach().clone()) for named in r.staged for n, t in named
                )
            if self._swap is not None:
                self._swap()
                r.tensors_applied = sum(len(named) for named in r.staged)
            elif not self.plan.streaming:
                self._begin_reload()
                for named in r.staged:
                    self.glue.load(named)
                    r.tensors_applied += len(named)
            if self._reloading:
                self._end_reload()
            if kept is not None:
                self.base = {**self.base, **kept}  # the tensors it did not carry still serve as kept before
            elif self.plan.payload is Payload.WEIGHTS:
                self.base = {}  # base weights written with no copy kept: the copies stand for nothing any more
        finally:
            self._kept = None
            self._swap = None
            r.release(reuse=True)
            self.receiver = None
        return r.tensors_applied

    def take(self, timeout_s: float, keep: bool = True) -> list[tuple[str, torch.Tensor]]:
        """An adapter update's received tensors, copied to the CPU (none unless ``keep``); the update ends.

        The model is untouched.

        Raises:
            RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
        """
        r = self._received(timeout_s)
        try:
            return [(n, t.detach().to("cpu", copy=True)) for named in r.staged for n, t in named] if keep else []
        finally:
            r.release(reuse=True)
            self.receiver = None

    def _received(self, timeout_s: float) -> Receiver:
        """The receiver of the update in flight, once every bucket arrived.

        Raises:
            RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
        """
        r = self.receiver
        if r is None:
            raise RuntimeError("no update in flight on this worker")
        if not r.done.wait(Deadline(timeout_s).left()) or r.error is not None:
            raise RuntimeError(f"the receive has not completed: {r.error or 'still receiving'}")
        return r

    def abandon(self) -> None:
        """Stop the update in flight, if any: cancel its receive and end a streaming reload. Idempotent."""
        r = self.receiver
        if r is None:
            return
        self.cancel.set()
        self.feed.close()
        ended = r.done.wait(5.0)
        if self._preparer is not None:
            self._preparer.join(timeout=60.0)  # it reads the received buffers
        self._swap = None
        if self._kept is not None:
            self.base = {}  # a delta may have been applied into the copy: it stands for nothing any more
        self._kept = None
        # A receive may still be posted into these buffers unless the thread ended.
        r.release(reuse=ended and r.error is None)
        self.receiver = None
        if self._reloading:
            self.base = {}  # a reload cut short: what is served is no longer what any copy says
            self._end_reload()

    def _begin_reload(self) -> None:
        self.glue.begin_reload()
        self._reloading = True

    def _end_reload(self) -> None:
        self._reloading = False
        self.glue.end_reload()
