"""wsync's receiver inside a vLLM worker process: the ``wsync`` weight-transfer backend.

vLLM creates one weight-transfer engine per worker process after the model
is loaded (``vllm.distributed.weight_transfer``, selected by
``--weight-transfer-config '{"backend": "wsync"}'``). wsync's is
:class:`WsyncTransferEngine`: it joins the weight-sync group at
``rank_offset`` plus the worker's global rank, receives an update's buckets on
a background thread (:class:`~wsync_grpc.transports.broadcast.receiver.WorkerReceiver`,
the same receiver the reference engine runs) while the worker keeps running
inference steps, and applies them between two steps through vLLM's
layerwise reload (``initialize_layerwise_reload`` -> ``model.load_weights``
with checkpoint-format names -> ``finalize_layerwise_reload``), which
re-runs each layer's weight processing (fused ``qkv_proj``/``gate_up_proj``,
the CPU backend's prepacked linears).

The engine's front process drives it through the methods of
:class:`~wsync_grpc.engines.vllm.worker.WsyncWorkerExtension` (vLLM's
``collective_rpc``), never through vLLM's own ``update_weights`` flow, whose
receive runs inside the step loop. Every method here runs on the worker's
main thread, between two inference steps, except the receiver.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from wsync_grpc.core.engine import WorkerProgress
from wsync_grpc.core.layout import ApplyMode, Layout
from wsync_grpc.core.messages import bucket_from_msg
from wsync_grpc.core.packing import tensor_views
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, Deadline
from wsync_grpc.engines.vllm.shadow import ShadowUpdate
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME, WeightSyncGroup, join_group
from wsync_grpc.group.waits import wait_work
from wsync_grpc.transports.broadcast.receiver import WorkerReceiver
from wsync_grpc.transports.disk.receiver import DiskReceiver
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed

log = logging.getLogger(__name__)


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):
    """The group a worker joins (vLLM's ``init_weight_transfer_engine`` ``init_info``).

    Attributes:
        master_address: host of the trainer's rendezvous store.
        master_port: its TCP port.
        rank_offset: the group rank of the engine's global worker rank 0.
        world_size: ranks in the group, trainer included.
        group_name: the group's name (its store prefix); empty for the default.
        backend: ``"gloo"`` or ``"nccl"``; empty to choose by device.
        timeout_s: join deadline and per-collective timeout, in seconds.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = ""
    backend: str = ""
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of vLLM's own update flow (``update_weights``) on the wsync backend.

    Not how wsync updates travel (those are driven by the ``wsync.v1``
    servicer and received in the background): vLLM's flow receives inside its
    step loop, between ``start_weight_update`` and ``finish_weight_update``.
    It is offered so that vLLM's RL API works on the same group and
    transport, e.g. to compare the two flows side by side.

    Attributes:
        buckets: the chunk's buckets (:func:`~wsync_grpc.core.messages.bucket_to_msg`),
            each broadcast by rank 0 as one flat ``uint8`` buffer of its ``size_bytes``.
    """

    buckets: list[dict[str, Any]] = field(default_factory=list)


class _ModelTarget:
    """The worker's model as the receiver's streaming target (``core.adapter.WeightTarget``).

    Loads go through the model's own ``load_weights`` (checkpoint-format
    names) inside a layerwise reload that the update started; the tensors are
    copied first, because a layer keeps its loads until all of its tensors
    have arrived and the receiver reuses its buffers at once.
    """

    def __init__(self, engine: WsyncTransferEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()

    def weights_lock(self) -> contextlib.AbstractContextManager[object]:
        return self._lock

    def load_weights(self, worker: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        owned = [(n, t.clone()) for n, t in tensors]
        self._engine.load(owned)
        return len(owned)

    def get_weight(self, name: str) -> torch.Tensor:
        raise KeyError(name)


class WsyncTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    """One vLLM worker's member of the weight-sync group and its receiver of the update in flight.

    Constructed by vLLM's ``WeightTransferEngineFactory`` (see
    :func:`wsync_grpc.engines.vllm.register`). Not thread-safe: every method
    runs on the worker's main thread (a ``collective_rpc``); only the
    receiver runs beside it.
    """

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: WeightSyncGroup | None = None
        self.rank = -1
        self.receiver: WorkerReceiver | DiskReceiver | None = None
        self.feed = BucketFeed()
        self.cancel = threading.Event()
        self.pool = BufferPool(self.device, keep=True)
        self.streaming = False
        self._reloading = False
        self.shadow: ShadowUpdate | None = None
        """A staged update's processed weights, once prepared beside the live model (:meth:`_prepare`)."""
        self._preparer: threading.Thread | None = None
        self.raw_buffers: list[torch.Tensor] = []
        """The buffers of ``wsync_receive_raw`` (the transport's ceiling), kept between calls."""

    # --------------------------------------------------------------- group

    @property
    def global_rank(self) -> int:
        """This worker's rank among all the engine's workers (data parallel replicas included)."""
        pc = self.parallel_config
        return int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        """Join the weight-sync group at ``rank_offset`` + this worker's global rank (blocks until it formed).

        Raises:
            GroupTimeout, GroupError, ValueError: see :func:`~wsync_grpc.group.process_group.join_group`.
        """
        self.shutdown()
        rank = init_info.rank_offset + self.global_rank
        self.group = join_group(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            group_name=init_info.group_name or DEFAULT_GROUP_NAME,
            backend=init_info.backend,
            device=self.device,
            timeout_s=init_info.timeout_s,
        )
        self.rank = rank
        log.info("worker %d joined weight-sync group at rank %d of %d", self.global_rank, rank, init_info.world_size)

    def shutdown(self) -> None:
        """Abandon any update in flight and leave the group. Idempotent."""
        self.abandon()
        if self.group is not None:
            self.group.destroy()
            self.group = None

    # -------------------------------------------------------------- update

    def arm(
        self,
        layout: str,
        apply_mode: str,
        buckets: list[dict[str, Any]],
        closed: bool,
        timeout_s: float,
        files: Mapping[str, str] | None = None,
        adapter: bool = False,
    ) -> None:
        """Start receiving an update in the background; return once the first receive is posted.

        A disk update (``files``: tensor name -> safetensors file) is read by a
        :class:`~wsync_grpc.transports.disk.receiver.DiskReceiver` instead, no group needed.
        An adapter update (``adapter``, staged) is kept apart from the model until :meth:`take`.

        Args:
            layout, apply_mode: :class:`~wsync_grpc.core.layout.Layout` and
                :class:`~wsync_grpc.core.layout.ApplyMode` values.
            buckets: the declared buckets (:func:`~wsync_grpc.core.messages.bucket_to_msg`).
            closed: no further bucket will be declared.
            timeout_s: bound for the arming, in seconds.

        Raises:
            RuntimeError: not a member of a group, or an update is in flight.
            TimeoutError: not armed within ``timeout_s``.
        """
        if self.group is None and files is None:
            raise RuntimeError("this worker is not a member of a weight-sync group")
        if self.receiver is not None:
            raise RuntimeError("an update is already in flight on this worker")
        self.streaming = ApplyMode(apply_mode) is ApplyMode.STREAMING
        self.feed = BucketFeed()
        self.feed.extend([bucket_from_msg(b) for b in buckets])
        if closed:
            self.feed.close()
        self.cancel = threading.Event()
        if self.streaming:
            self._begin_reload()
        self.receiver = self._receiver(layout, ApplyMode(apply_mode), files)
        self.receiver.start()
        self.shadow = None
        self._preparer = None
        if not self.streaming and not adapter:
            self._preparer = threading.Thread(target=self._prepare, name="wsync-prepare", daemon=True)
            self._preparer.start()
        if not self.receiver.armed.wait(Deadline(timeout_s).left()):
            raise TimeoutError(f"the receiver was not armed within {timeout_s:g} s")

    def _receiver(self, layout: str, mode: ApplyMode, files: Mapping[str, str] | None) -> WorkerReceiver | DiskReceiver:
        """The update's receiver: from the group, or from the checkpoint's files."""
        target, cancel = _ModelTarget(self), self.cancel
        if files is not None:
            paths = {n: Path(f) for n, f in files.items()}
            return DiskReceiver(
                worker=self.global_rank, device=self.device, adapter=target, feed=self.feed, files=paths,
                apply_mode=mode, cancel=cancel, on_event=lambda r: None,
            )  # fmt: skip
        assert self.group is not None
        return WorkerReceiver(
            worker=self.global_rank, group=self.group, adapter=target, feed=self.feed, layout=Layout(layout),
            apply_mode=mode, cancel=cancel, pool=self.pool, on_event=lambda r: None,
        )  # fmt: skip

    def declare(self, buckets: list[dict[str, Any]], closed: bool) -> None:
        """Feed further buckets of an incremental update (and close the feed when ``closed``)."""
        self.feed.extend([bucket_from_msg(b) for b in buckets])
        if closed:
            self.feed.close()

    def _prepare(self) -> None:
        """Staged: once every bucket arrived, build the processed weights beside the live model.

        Runs on a thread of its own while the worker keeps running steps. A
        failure here is not the update's: :meth:`apply` then falls back to
        a layerwise reload between two steps.
        """
        r = self.receiver
        assert r is not None
        r.done.wait()
        if r.error is not None or self.cancel.is_set():
            return
        shadow = ShadowUpdate(self.model, self.vllm_config)
        t0 = time.monotonic()
        try:
            shadow.prepare([pair for named in r.staged for pair in named])
        except Exception:
            log.exception("preparing the update beside the model failed; it is applied by a layerwise reload")
            return
        self.shadow = shadow
        log.debug("update prepared beside the model in %.3f s", time.monotonic() - t0)

    def progress(self) -> WorkerProgress:
        """Where this worker's receive stands (all zero with no update in flight).

        Staged: ``done`` once the received weights are also prepared beside
        the model, so that the apply at Complete is only the swap.
        """
        r = self.receiver
        if r is None:
            return WorkerProgress(self.rank, False, False, 0, 0, None, None)
        prepared = self._preparer is None or not self._preparer.is_alive()
        return WorkerProgress(
            rank=self.rank,
            armed=r.armed.is_set(),
            done=r.done.is_set() and prepared,
            buckets_done=r.buckets_done,
            bytes_done=r.bytes_done,
            last_arrival_at=r.last_arrival_at,
            error=r.error,
        )

    def apply(self, timeout_s: float) -> int:
        """Apply the received update (between two steps); return the tensors loaded.

        Staged: one layerwise reload of every received tensor. Streaming: the
        reload the update began at :meth:`arm` is finalized.

        Raises:
            RuntimeError: no update, or its receive failed or has not ended within ``timeout_s`` seconds.
        """
        r = self._received(timeout_s)
        try:
            if self._preparer is not None:
                self._preparer.join(Deadline(timeout_s).left())
            if self.shadow is not None:
                self.shadow.swap()
                r.tensors_applied = sum(len(named) for named in r.staged)
            elif not self.streaming:
                self._begin_reload()
                for named in r.staged:
                    self.load(named)
                    r.tensors_applied += len(named)
            if self._reloading:
                self._end_reload()
        finally:
            self.shadow = None
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

    def _received(self, timeout_s: float) -> WorkerReceiver | DiskReceiver:
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
        r.join(timeout=5.0)
        if self._preparer is not None:
            self._preparer.join(timeout=60.0)  # it reads the received buffers
        self.shadow = None
        # A receive may still be posted into these buffers unless the thread ended.
        r.release(reuse=not r.is_alive() and r.error is None)
        self.receiver = None
        if self._reloading:
            self._end_reload()

    # -------------------------------------------------------------- reload

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format ``(name, tensor)`` pairs into the model; a layerwise reload is in progress."""
        with set_current_vllm_config(self.vllm_config):
            self.model.load_weights(iter(tensors))

    def _begin_reload(self) -> None:
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        self._reloading = True

    def _end_reload(self) -> None:
        self._reloading = False
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model, self.model_config)

    # ------------------------------------------------ vLLM's own update flow

    def start_weight_update(self) -> None:
        """vLLM's flow: begin a layerwise reload (the engine must be paused by then)."""
        self._begin_reload()

    def finish_weight_update(self) -> None:
        """vLLM's flow: finalize the layerwise reload."""
        if self._reloading:
            self._end_reload()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's flow: receive and load one chunk, inside the step loop (the base class's, minus its CPU-only sync)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        """vLLM's flow: receive each bucket of ``update_info`` and load its tensors (blocks until the last byte).

        Raises:
            RuntimeError: not a member of a group.
            GroupTimeout, GroupError: a broadcast did not complete within the group's timeout.
        """
        if self.group is None:
            raise RuntimeError("this worker is not a member of a weight-sync group")
        deadline = time.monotonic() + self.group.timeout_s
        for m in update_info.buckets:
            b = bucket_from_msg(m)
            flat = torch.empty(b.size_bytes, dtype=torch.uint8, device=self.device)
            wait_work(self.group.broadcast(flat), deadline, sliced=self.group.sliced_waits)
            self.load([(n, t) for n, t in tensor_views(flat, b.tensors)])
