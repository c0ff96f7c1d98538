"""What wsync's front process calls in every vLLM worker (``--worker-extension-cls``).

vLLM mixes a worker extension class into its worker class
(``ParallelConfig.worker_extension_cls``, the mechanism its RLHF examples
use), and the engine client's ``collective_rpc(name)`` runs the method of
that name on every worker, between two inference steps, and returns each
worker's result. Every call of the front's
:class:`~wsync_grpc.engines.rpc.RpcWorkers` arrives at one of them,
:meth:`WsyncWorkerExtension.wsync_call`, which hands it to the engine-agnostic
table (:func:`wsync_grpc.engines.worker_calls.dispatch`) with this worker as a
:class:`VllmWorker`: the :class:`~wsync_grpc.engines.host.WorkerHost` held by
the :class:`~wsync_grpc.engines.vllm.transfer.WsyncTransferEngine`, its join
and leave, and vLLM's served tensors. The other methods are vLLM's own: what
the front asks before the engine exists (:meth:`~WsyncWorkerExtension.wsync_describe`)
and the transport's ceiling for the benchmarks
(:meth:`~WsyncWorkerExtension.wsync_receive_raw`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import glob
import hashlib
import os
import socket
import threading
import time
from typing import Any

import torch

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.engines.host import WorkerHost
from wsync_grpc.engines.rpc import RPC_ENTRY
from wsync_grpc.engines.vllm.readback import gather_shards, served_tensors, tensor_parallel_group
from wsync_grpc.engines.vllm.transfer import WsyncInitInfo, WsyncTransferEngine
from wsync_grpc.engines.worker_calls import dispatch
from wsync_grpc.group.waits import wait_work


class VllmWorker:
    """One vLLM worker as the table reaches it (:class:`~wsync_grpc.engines.worker_calls.HostedWorker`).

    Args:
        engine: the worker's ``wsync`` weight-transfer backend.
    """

    def __init__(self, engine: WsyncTransferEngine) -> None:
        self.engine = engine

    @property
    def host(self) -> WorkerHost:
        """The worker host the backend holds."""
        return self.engine.host

    def begin_join(self, params: GroupParams) -> None:
        """Start joining the group on a thread of its own (:meth:`WsyncTransferEngine.begin_join`).

        Raises:
            RuntimeError: an earlier join of this worker has not ended yet.
        """
        self.engine.begin_join(WsyncInitInfo(**dataclasses.asdict(params)))

    def join_outcome(self) -> dict[str, Any] | None:
        """``None`` while the join runs, then ``{"rank": int, "error": str}`` (``error`` empty: joined)."""
        return self.engine.join_outcome()

    def leave(self) -> None:
        """Abandon any update in flight and leave the group (:meth:`WsyncTransferEngine.shutdown`)."""
        self.engine.shutdown()

    def served(self, names: list[str], want_data: bool) -> list[dict[str, Any]]:
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
        model = self.engine.model
        tp = None if want_data else tensor_parallel_group()
        wanted = set(names)
        out: list[dict[str, Any]] = []
        for t in served_tensors(model, wanted):
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


def unlink_cpu_communicator_segments() -> list[str]:
    """Unlink the ``/dev/shm`` names of vLLM's CPU communicator segments of this worker's engine; returns them.

    vLLM's CPU tensor-parallel workers exchange activations through one POSIX shared-memory segment per rank
    (``{VLLM_DIST_IDENT}-{group}-cpushm_{rank}``, created by its ``init_shm_manager``; every rank opens all of them
    as the group forms) and unlink the names only in a destructor that a worker ended by its engine never runs: each
    engine that stops would leave its workers' segments in ``/dev/shm``. Once every rank has opened them (the front
    asks :meth:`WsyncWorkerExtension.wsync_describe` after vLLM's warm-up, its collectives done) the names serve no
    one: unlinked, the segments stay mapped in the workers and the kernel frees them with the last worker, however
    it ends (the same rule as a shared-memory ring's segment: unlinked once opened). Every worker calls it; the
    first unlinks, the others find nothing.

    Returns:
        The names this call unlinked (empty where vLLM runs no CPU tensor-parallel group, or another worker's call
        came first).
    """
    ident = os.environ.get("VLLM_DIST_IDENT")  # set by vLLM's CPU worker before its groups form
    if not ident:
        return []
    done = []
    for path in glob.glob(f"/dev/shm/{glob.escape(ident)}-*-cpushm_*"):
        with contextlib.suppress(FileNotFoundError):  # another worker unlinked it first
            os.unlink(path)
            done.append(os.path.basename(path))
    return done


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

    def wsync_call(self, method: str, *args: Any) -> Any:
        """Run the front's call ``method`` (a :class:`~wsync_grpc.engines.rpc.WorkerCall` value) on this worker.

        The one entry of :data:`~wsync_grpc.engines.rpc.RPC_ENTRY`: arguments and result are msgpack-native,
        as each handler of :data:`~wsync_grpc.engines.worker_calls.WORKER_CALLS` documents.

        Raises:
            RuntimeError: the engine was not started with the wsync weight-transfer backend.
            NotImplementedError: no such call.
            Exception: what the call raised.
        """
        return dispatch(VllmWorker(self._wsync()), method, args)

    def wsync_describe(self) -> dict[str, Any]:
        """This worker's global rank, device, model's fused layers and CPUs; its start-up heap frozen, and vLLM's
        CPU communicator segments unlinked (:func:`unlink_cpu_communicator_segments`).

        The front asks once, after vLLM's warm-up. The objects alive then (the model, vLLM's own) are moved
        out of the garbage collector's reach (``gc.freeze``, as vLLM's GPU worker does after its warm-up and
        its CPU worker does not): a full collection of the oldest generation, which otherwise walks them all
        and holds the interpreter lock all the while the forward waits, then walks only
        what was made since.

        Returns:
            ``{"global_rank": int, "device": str, "packed": {fused module: [parts]}, "host": str,
            "cpus": [int], "host_cpus": [int]}`` (``packed`` is the model's ``packed_modules_mapping``;
            ``cpus`` those this worker's main thread may run on, where vLLM binds its forward on a CPU
            backend; ``host_cpus`` those its engine process may run on; both empty where unknown).
        """
        e = self._wsync()
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
        unlink_cpu_communicator_segments()
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


if not callable(getattr(WsyncWorkerExtension, RPC_ENTRY, None)):  # the name the front's collective_rpc calls
    raise ImportError(f"WsyncWorkerExtension has no {RPC_ENTRY} method")
