"""The methods wsync's front process calls in every vLLM worker (``--worker-extension-cls``).

vLLM mixes a worker extension class into its worker class
(``ParallelConfig.worker_extension_cls``, the mechanism its RLHF examples
use), and the engine client's ``collective_rpc("wsync_...")`` runs a method
on every worker, between two inference steps, and returns each worker's
result. These methods are thin: they decode their msgpack-native arguments
(:mod:`wsync_grpc.core.messages`), delegate to the worker's
:class:`~wsync_grpc.engines.host.WorkerHost` (held by the
:class:`~wsync_grpc.engines.vllm.transfer.WsyncTransferEngine`) and encode the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from typing import Any

import torch

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.messages import (
    buckets_from_msg,
    digests_from_msg,
    plan_from_msg,
    progress_to_msg,
    tensor_to_msg,
)
from wsync_grpc.engines.vllm.readback import gather_shards, served_tensors, tensor_parallel_group
from wsync_grpc.engines.vllm.transfer import WsyncInitInfo, WsyncTransferEngine
from wsync_grpc.group.waits import wait_work


class WsyncWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.weight_transfer_engine``, ``self.device``)."""

    def _wsync(self) -> WsyncTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WsyncTransferEngine):
            raise RuntimeError(
                "the vLLM engine was not started with the wsync weight-transfer backend "
                '(--weight-transfer-config \'{"backend": "wsync"}\')'
            )
        return engine

    def wsync_describe(self) -> dict[str, Any]:
        """This worker's global rank, device, model's fused layers and CPUs.

        Returns:
            ``{"global_rank": int, "device": str, "packed": {fused module: [parts]}, "host": str,
            "cpus": [int], "host_cpus": [int]}`` (``packed`` is the model's ``packed_modules_mapping``;
            ``cpus`` those this worker's main thread may run on, where vLLM binds its forward on a CPU
            backend; ``host_cpus`` those its engine process may run on; both empty where unknown).
        """
        e = self._wsync()
        packed = getattr(e.model, "packed_modules_mapping", {}) or {}
        cpus: set[int] = set()
        host_cpus: set[int] = set()
        if hasattr(os, "sched_getaffinity"):
            cpus = os.sched_getaffinity(0)
            with contextlib.suppress(OSError):  # the engine process ended
                host_cpus = os.sched_getaffinity(os.getppid())
        return {
            "global_rank": e.global_rank,
            "device": str(e.device),
            "packed": {str(k): [str(p) for p in v] for k, v in packed.items()},
            "host": socket.gethostname(),
            "cpus": sorted(cpus),
            "host_cpus": sorted(host_cpus),
        }

    def wsync_set_background_cpus(self, by_rank: dict[str, list[int]]) -> None:
        """Run this worker's weight-sync threads on ``by_rank[str(global rank)]`` (absent or empty: where its
        main thread runs); see :func:`~wsync_grpc.engines.host.threads_started_on`."""
        e = self._wsync()
        e.host.background_cpus = frozenset(by_rank.get(str(e.global_rank), []))

    def wsync_join_begin(self, params: dict[str, Any]) -> None:
        """Start joining the weight-sync group (:class:`~wsync_grpc.engines.vllm.transfer.WsyncInitInfo` fields)
        on a thread of its own; steps keep running. Poll :meth:`wsync_join_outcome`."""
        self._wsync().begin_join(WsyncInitInfo(**params))

    def wsync_join_outcome(self) -> dict[str, Any] | None:
        """``None`` while the join runs, then ``{"rank": int, "error": str}`` (``error`` empty: joined)."""
        return self._wsync().join_outcome()

    def wsync_leave(self) -> None:
        """Abandon any update in flight and leave the group."""
        self._wsync().shutdown()

    def wsync_arm(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Start receiving an update (a :func:`~wsync_grpc.core.messages.plan_to_msg` plan); this worker's progress."""
        host = self._wsync().host
        host.arm(plan_from_msg(plan))
        return progress_to_msg(host.progress())

    def wsync_take_adapter(self, timeout_s: float) -> list[dict[str, Any]]:
        """An adapter update's received tensors (:func:`~wsync_grpc.core.messages.tensor_to_msg`) from
        global rank 0, empty from the others; the update ends on every worker, the model untouched."""
        host = self._wsync().host
        return [tensor_to_msg(n, t) for n, t in host.take(timeout_s, keep=host.global_rank == 0)]

    def wsync_declare(
        self, buckets: list[dict[str, Any]], closed: bool, digests: list[list[Any]] | None = None
    ) -> None:
        """Feed further buckets of an incremental update, and digests declared after their buckets."""
        self._wsync().host.declare(buckets_from_msg(buckets), closed, digests_from_msg(digests or []))

    def wsync_progress(self) -> dict[str, Any]:
        """This worker's receive progress."""
        return progress_to_msg(self._wsync().host.progress())

    def wsync_apply(self, timeout_s: float) -> int:
        """Apply the received update between two steps; the number of tensors loaded."""
        return self._wsync().host.apply(timeout_s)

    def wsync_receive_raw(self, sizes: list[int], timeout_s: float, background: bool = False) -> float:
        """Receive plain broadcasts of ``sizes`` bytes from rank 0 and drop them; the seconds it took.

        The transport's ceiling for an update of those buckets into this
        worker process: no metadata, no staging, no apply. Every receive is
        posted up front into buffers kept between calls.

        Args:
            background: post the receives and return at once (0.0), waiting
                for them on a thread while the worker keeps running steps, as
                a staged update's receive does; the sender times the transfer.

        Raises:
            RuntimeError: not a member of a group.
            GroupTimeout, GroupError: a broadcast did not complete within ``timeout_s`` seconds.
        """
        e = self._wsync()
        group = e.group
        if group is None:
            raise RuntimeError("this worker is not a member of a weight-sync group")
        if [b.numel() for b in e.raw_buffers] != sizes:  # allocated and touched once, outside the timing
            e.raw_buffers = [torch.zeros(n, dtype=torch.uint8, device=e.device) for n in sizes]
        t0 = time.monotonic()
        works = [group.broadcast(b) for b in e.raw_buffers]

        def wait() -> None:
            for w in works:
                wait_work(w, t0 + timeout_s, sliced=group.sliced_waits)

        if background:
            threading.Thread(target=wait, name="wsync-raw-receive", daemon=True).start()
            return 0.0
        wait()
        return time.monotonic() - t0

    def wsync_served(self, names: list[str], want_data: bool = False) -> list[dict[str, Any]]:
        """Served tensors in checkpoint coordinates: a digest where this rank holds all of one, else its slice.

        A tensor sharded across the tensor-parallel ranks is gathered onto the group's first rank over
        vLLM's own CPU process group (one tensor at a time) and hashed there, so that no shard's bytes
        travel to the front process: every rank must be asked for the same ``names`` (a
        ``collective_rpc`` does). With ``want_data`` the slices are sent instead, for the front to join.

        Args:
            names: checkpoint names to report; empty for all.
            want_data: send the bytes of whole tensors too (``data``), and each rank's slices.

        Returns:
            One dict per tensor: ``name``, ``dtype``, ``shape`` (of what this
            rank holds), ``shard`` (``[dim, rank, count]`` or ``None``), and
            ``sha256`` (whole tensors) or ``data`` (the slice's bytes, C order).
        """
        model = self._wsync().model
        tp = None if want_data else tensor_parallel_group()
        wanted = set(names)
        out: list[dict[str, Any]] = []
        for t in served_tensors(model):
            if wanted and t.name not in wanted:
                continue
            data = t.tensor.detach().cpu().contiguous()
            shard = None if t.shard is None else [t.shard.dim, t.shard.rank, t.shard.count]
            if t.shard is not None and tp is not None:
                whole = gather_shards(tp, data, t.shard)
                if whole is None:  # another rank reports it
                    continue
                data, shard = whole, None
            raw = data.reshape(-1).view(torch.uint8).numpy().data
            entry: dict[str, Any] = {
                "name": t.name,
                "dtype": dtype_name(data.dtype),
                "shape": list(data.shape),
                "shard": shard,
            }
            if shard is None:
                entry["sha256"] = hashlib.sha256(raw).hexdigest()
            if shard is not None or want_data:
                entry["data"] = raw.tobytes()
            out.append(entry)
        return out
