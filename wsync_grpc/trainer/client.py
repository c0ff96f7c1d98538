"""The trainer side of wsync: :class:`TrainerClient`.

The generated stub (``wsync.v1.weight_sync_pb2_grpc.WeightSyncServiceStub``)
is enough to drive the protocol; :class:`TrainerClient` adds what every
trainer would otherwise rewrite on top of it:

- the group: ask every engine for its worker count, compute rank offsets
  (trainer = rank 0, engine *i* from ``1 + sum(workers[:i])``), send Init to
  every engine concurrently *while* the trainer creates its side of the group
  (asking the engines only after the trainer blocked in group creation is the
  classic deadlock);
- one update (:meth:`TrainerClient.sync`): bucket planning
  (:mod:`wsync_grpc.core.buckets`), the streaming Prepare to every engine at once,
  the broadcast of every bucket (the next bucket is packed while the current
  one is on the wire), Complete everywhere, per-engine results and timings;
- the failure protocol: when any engine fails (or the trainer's broadcast
  does), the update is cancelled on every engine, the trainer leaves the
  group, and the next :meth:`~TrainerClient.sync` re-initializes it; one
  :class:`SyncError` names every failed engine with its gRPC code, its
  ``google.rpc.ErrorInfo`` reason and its message;
- fan-out helpers (pause, resume, status, cancel, leave, checksums) that
  return one reply per engine.

Units: sizes in bytes, times in seconds, throughputs in GB/s (10^9 bytes per
second).
"""

from __future__ import annotations

import collections
import datetime
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import grpc
import torch
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.buckets import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_RAMP_BYTES,
    DEFAULT_SOLO_BYTES,
    Bucket,
    PlannedTensor,
    batch_bucket_specs,
    bucket_bytes_view,
    pack_bucket,
    plan_buckets,
    total_wire_bytes,
    wire_tensor,
)
from wsync_grpc.group.process_group import (
    DEFAULT_GROUP_NAME,
    DEFAULT_TIMEOUT_S,
    WeightSyncGroup,
    join_group,
    resolve_backend,
    wait_all,
    wait_work,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "TRAINER",
    "ApplyMode",
    "BackendName",
    "ClientError",
    "EngineCallError",
    "EngineFailure",
    "EngineSyncResult",
    "InitError",
    "Layout",
    "PauseModeName",
    "SyncError",
    "SyncProgress",
    "SyncResult",
    "TrainerClient",
    "free_port",
]

DEFAULT_RPC_TIMEOUT_S = 60.0
"""Deadline of the control RPCs (GetStatus, Prepare, Cancel, Leave, Pause, ...), in seconds."""

DEFAULT_GROUP_TIMEOUT_S = DEFAULT_TIMEOUT_S
"""Group join and per-collective timeout, in seconds (120, the engines' own default).

Init and Complete get this plus :data:`DEFAULT_RPC_TIMEOUT_S` as their RPC
deadline, since they legitimately wait that long on the group.
"""

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest reply the client accepts, in bytes (checksums of 100k tensors exceed gRPC's 4 MiB default)."""

Layout = Literal["flattened", "individual"]
"""Bucket layout: one broadcast per bucket, or one per tensor (``wsync.v1.BucketLayout``)."""

ApplyMode = Literal["staged", "streaming"]
"""When the engines apply: all at Complete, or bucket by bucket (``wsync.v1.ApplyMode``)."""

PauseModeName = Literal["abort", "wait", "keep"]
"""What Pause does with requests in flight (vLLM's ``/pause?mode=``; ``wsync.v1.PauseMode``)."""

BackendName = Literal["gloo", "nccl", ""]
"""Collective backend; ``""`` lets each side choose by device (NCCL on CUDA, gloo on CPU)."""

_LAYOUTS: dict[str, pb.BucketLayout.ValueType] = {
    "flattened": pb.BUCKET_LAYOUT_FLATTENED,
    "individual": pb.BUCKET_LAYOUT_INDIVIDUAL,
}
_APPLY_MODES: dict[str, pb.ApplyMode.ValueType] = {
    "staged": pb.APPLY_MODE_STAGED,
    "streaming": pb.APPLY_MODE_STREAMING,
}
_PAUSE_MODES: dict[str, pb.PauseMode.ValueType] = {
    "abort": pb.PAUSE_MODE_ABORT,
    "wait": pb.PAUSE_MODE_WAIT,
    "keep": pb.PAUSE_MODE_KEEP,
}
_BACKENDS: dict[str, pb.Backend.ValueType] = {
    "": pb.BACKEND_UNSPECIFIED,
    "gloo": pb.BACKEND_GLOO,
    "nccl": pb.BACKEND_NCCL,
}

FLAT_WINDOW = 4
"""Flattened layout: bucket broadcasts the trainer keeps in flight (at most two of them packed)."""

INDIVIDUAL_WINDOW = 512
"""Per-tensor broadcasts the individual layout keeps in flight."""

TRAINER = "trainer"
"""The key under which the trainer's own failure (rank 0) appears in :attr:`EngineCallError.failures`."""

R = TypeVar("R")


# ----------------------------------------------------------------------------- results and errors


@dataclass(frozen=True)
class EngineFailure:
    """Why one engine (or the trainer, target :data:`TRAINER`) failed one call.

    Attributes:
        target: the engine's ``host:port``, or :data:`TRAINER`.
        rpc: the RPC (``"Prepare"``, ``"Complete"``...) or trainer step (``"broadcast"``).
        code: the gRPC status code; ``None`` for a failure that is not an RPC's.
        reason: the ``google.rpc.ErrorInfo`` reason (UPPER_SNAKE_CASE); ``""`` when none came.
        message: the status message (or exception text).
        metadata: the ``ErrorInfo`` metadata (e.g. ``{"tensor": ..., "bucket": ...}``).
    """

    target: str
    rpc: str
    code: grpc.StatusCode | None
    reason: str
    message: str
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.code is None:
            reason = f" ({self.reason})" if self.reason else ""
            return f"{self.target}: {self.rpc} failed{reason}: {self.message}"
        reason = f" {self.reason}" if self.reason else ""
        return f"{self.target}: {self.rpc} failed with {self.code.name}{reason}: {self.message}"

    @classmethod
    def from_exception(cls, target: str, rpc: str, exc: BaseException) -> EngineFailure:
        """Describe ``exc``, reading code, ErrorInfo reason and metadata from a failed gRPC call.

        The rich status is parsed with ``grpc_status.rpc_status.from_call``
        (the grpc-status-details-bin trailer), as the engines send it.
        """
        if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
            call = cast(grpc.Call, exc)
            reason, metadata = "", {}
            try:
                status = rpc_status.from_call(call)
            except ValueError:  # details disagree with the call's code/message
                status = None
            if status is not None:
                for detail in status.details:
                    if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                        info = error_details_pb2.ErrorInfo()
                        detail.Unpack(info)
                        reason, metadata = str(info.reason), dict(info.metadata)
                        break
            return cls(target, rpc, call.code(), reason, call.details() or "", metadata)
        if isinstance(exc, grpc.FutureCancelledError):
            return cls(target, rpc, grpc.StatusCode.CANCELLED, "", "the call was cancelled by the client")
        if isinstance(exc, grpc.FutureTimeoutError):
            return cls(target, rpc, grpc.StatusCode.DEADLINE_EXCEEDED, "", "no reply before the deadline")
        return cls(target, rpc, None, type(exc).__name__, str(exc) or type(exc).__name__)


class ClientError(RuntimeError):
    """Base class of the errors :class:`TrainerClient` raises."""


class EngineCallError(ClientError):
    """A fan-out call failed on at least one engine.

    Attributes:
        rpc: the RPC fanned out.
        failures: target -> :class:`EngineFailure`, for every engine that failed.
        results: target -> reply, for every engine that succeeded.
    """

    def __init__(
        self, message: str, *, rpc: str, failures: Mapping[str, EngineFailure], results: Mapping[str, Any]
    ) -> None:
        super().__init__(message)
        self.rpc = rpc
        self.failures = dict(failures)
        self.results = dict(results)


class InitError(EngineCallError):
    """Forming the weight-sync group failed (an engine's Init, or the trainer's own join).

    The trainer's own failure appears under :data:`TRAINER` in :attr:`failures`.
    """


class SyncError(EngineCallError):
    """One :meth:`TrainerClient.sync` failed; the message names every engine that failed.

    By the time it is raised the update was cancelled on every engine, the
    trainer left the group, and the client is marked for re-initialization
    (the next ``sync`` re-inits automatically).

    Attributes:
        stage: where it failed: ``"init"``, ``"prepare"``, ``"broadcast"`` or ``"complete"``.
        update_id: the update's id.
        weight_version: the version that was being installed.
        failures: target (or :data:`TRAINER`) -> :class:`EngineFailure`.
        results: target -> :class:`EngineSyncResult` for engines whose
            Complete succeeded (they serve ``weight_version`` now).
        cancelled: target -> whether Cancel abandoned an update in flight there.
        broadcast_started: whether any byte was broadcast.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        update_id: str,
        weight_version: str,
        failures: Mapping[str, EngineFailure],
        results: Mapping[str, EngineSyncResult],
        cancelled: Mapping[str, bool],
        broadcast_started: bool,
    ) -> None:
        super().__init__(message, rpc=stage, failures=failures, results=results)
        self.stage = stage
        self.update_id = update_id
        self.weight_version = weight_version
        self.cancelled = dict(cancelled)
        self.broadcast_started = broadcast_started
        self.results: dict[str, EngineSyncResult] = dict(results)


@dataclass(frozen=True)
class EngineSyncResult:
    """What one engine reported for a completed update (``wsync.v1.CompleteResponse``).

    Attributes:
        target: the engine's ``host:port``.
        update_id: the update's id.
        weight_version: the version the engine serves now.
        bucket_count: buckets received.
        tensor_count: tensors applied.
        bytes_received: bytes received per worker, in bytes.
        ready_seconds: Prepare's first message to armed receivers, in seconds.
        receive_seconds: Prepare's reply to the last bucket's arrival, in seconds.
        apply_seconds: apply time at Complete, in seconds.
        total_seconds: first Prepare message to the end of Complete, in seconds.
        cache_flushed: whether the engine flushed its cache.
    """

    target: str
    update_id: str
    weight_version: str
    bucket_count: int
    tensor_count: int
    bytes_received: int
    ready_seconds: float
    receive_seconds: float
    apply_seconds: float
    total_seconds: float
    cache_flushed: bool

    @property
    def gb_per_s(self) -> float:
        """``bytes_received`` over ``total_seconds``, in GB/s (10^9 bytes/s); 0 when unmeasurable."""
        return self.bytes_received / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0


@dataclass(frozen=True)
class SyncResult:
    """The outcome of one successful :meth:`TrainerClient.sync`.

    Attributes:
        update_id: the update's id.
        weight_version: the version every engine serves now.
        layout: ``"flattened"`` or ``"individual"``.
        apply_mode: ``"staged"`` or ``"streaming"``.
        bucket_count: buckets sent.
        tensor_count: tensors sent (tied duplicates counted once).
        payload_bytes: sum of the tensors' sizes on the wire, in bytes.
        wire_bytes: bytes broadcast (flattened: padding included), in bytes.
        init_seconds: time spent (re-)initializing the group in this call, in seconds.
        plan_seconds: bucket planning, in seconds.
        prepare_seconds: first Prepare sent to the last engine's reply, in seconds.
        broadcast_seconds: first broadcast posted to the last one finished, in seconds.
        pack_seconds: time spent packing (overlapped with the broadcast), in seconds.
        complete_seconds: Complete sent to the last engine's reply, in seconds.
        total_seconds: first Prepare sent to the last Complete reply, in seconds.
        engines: target -> :class:`EngineSyncResult`, in target order.
    """

    update_id: str
    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    bucket_count: int
    tensor_count: int
    payload_bytes: int
    wire_bytes: int
    init_seconds: float
    plan_seconds: float
    prepare_seconds: float
    broadcast_seconds: float
    pack_seconds: float
    complete_seconds: float
    total_seconds: float
    engines: dict[str, EngineSyncResult]

    @property
    def gb_per_s(self) -> float:
        """End-to-end throughput: ``payload_bytes`` over ``total_seconds`` (Prepare to Complete), GB/s."""
        return self.payload_bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0

    @property
    def broadcast_gb_per_s(self) -> float:
        """``wire_bytes`` over ``broadcast_seconds``, in GB/s."""
        return self.wire_bytes / self.broadcast_seconds / 1e9 if self.broadcast_seconds > 0 else 0.0


@dataclass(frozen=True)
class SyncProgress:
    """Passed to ``sync``'s ``progress`` callback after each bucket is on every engine.

    Attributes:
        update_id: the update's id.
        buckets_sent: buckets broadcast so far.
        bucket_count: buckets in the update.
        bytes_sent: bytes broadcast so far, in bytes.
        total_bytes: bytes the update broadcasts, in bytes.
        elapsed_seconds: since the first broadcast was posted, in seconds.
    """

    update_id: str
    buckets_sent: int
    bucket_count: int
    bytes_sent: int
    total_bytes: int
    elapsed_seconds: float


# ----------------------------------------------------------------------------- helpers


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(datetime.timedelta(seconds=seconds))
    return d


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on ``host`` (all interfaces by default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _failure_lines(failures: Mapping[str, EngineFailure]) -> str:
    return "; ".join(str(f) for f in failures.values())


@dataclass
class _Engine:
    target: str
    channel: grpc.Channel
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    workers: int = 0
    rank_offset: int = 0


# ----------------------------------------------------------------------------- the client


class TrainerClient:
    """Drives one or more engines from the trainer, which is rank 0 of the weight-sync group.

    Nothing touches the network in the constructor; the group is formed by
    :meth:`init`, or lazily by the first :meth:`sync`. Use it as a context
    manager so that the group is left and the channels closed at the end::

        with TrainerClient(["10.0.0.2:50051", "10.0.0.3:50051"], master_address="10.0.0.1") as c:
            for step in range(steps):
                train_step()
                c.sync(model.named_parameters(), f"step-{step}")

    Thread-safety: :meth:`init`, :meth:`sync` and :meth:`leave` run one at a
    time (a second concurrent ``sync`` raises :class:`RuntimeError`);
    :meth:`cancel`, :meth:`status`, :meth:`pause`, :meth:`resume` and
    :meth:`checksums` may be called from other threads at any time, and
    :meth:`cancel` interrupts a ``sync`` in flight.

    Args:
        targets: the engines' control addresses, ``"host:port"``; the order
            fixes their rank offsets.
        master_address: the address engines reach the trainer's TCP store at
            (rank 0 serves it). Default ``127.0.0.1`` (engines on this host).
        master_port: the store's TCP port; ``None`` (default) picks a free
            port at every (re-)initialization.
        group_name: the group's name (store prefix), as in SGLang's
            ``InitWeightsUpdateGroupReqInput.group_name``. Default
            ``"weight_sync_group"``.
        backend: ``"gloo"``, ``"nccl"`` or ``""`` (default: NCCL when
            ``device`` is CUDA, gloo otherwise; engines choose by their
            devices the same way).
        device: where the trainer's collectives run; default CPU, or the
            current CUDA device for ``backend="nccl"``.
        workers: workers per engine, in target order; ``None`` (default) asks
            every engine (``GetStatus().engine.workers``).
        rpc_timeout_s: deadline of the control RPCs, in seconds (default 60).
        group_timeout_s: group join and per-collective timeout, in seconds
            (default 120); a broadcast blocked on a dead engine fails after it.
        bucket_bytes: default bucket capacity of :meth:`sync`, in bytes
            (default :data:`~wsync_grpc.core.buckets.DEFAULT_BUCKET_BYTES`).
        alignment: byte alignment of tensors inside flat buckets (default 256).
        ramp_bytes: size of the first and last buckets, in bytes; buckets
            double from it up to ``bucket_bytes`` and halve back down to it at
            the end, so that the first pack and the last apply, which overlap
            nothing, are short (default
            :data:`~wsync_grpc.core.buckets.DEFAULT_RAMP_BYTES`, 32 MiB; 0 fills
            every bucket up to ``bucket_bytes``).
        solo_bytes: flattened layout: a tensor of at least this many bytes
            travels in a bucket of its own, broadcast from the tensor itself
            (no packing) and, with streaming apply on an engine that allows
            it, received straight into the served tensor (no unpacking)
            (default :data:`~wsync_grpc.core.buckets.DEFAULT_SOLO_BYTES`; 0 packs
            every tensor).
        token: shared secret sent as ``authorization: Bearer <token>`` with
            every call (the engines' ``--token``); ``None`` sends none.
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``);
            ``None`` (default) uses plaintext channels.
        channel_options: extra gRPC channel options.
        keep_buffers: keep the two flat bucket buffers (up to twice the
            largest bucket, in bytes) between syncs. ``None`` (default) keeps
            them when the trainer's device is CPU, where freed memory returns
            to the OS and refilling fresh buffers costs page faults (packing
            measured 3-5x slower); not on CUDA, where torch's caching
            allocator already reuses freed blocks and the training step can
            use them between syncs. Released by :meth:`close`.

    Raises:
        ValueError: no targets, duplicate targets, a ``workers`` list of the
            wrong length or with a count below 1, non-positive timeouts, a
            negative ``ramp_bytes`` or ``solo_bytes``.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: BackendName = "",
        device: torch.device | str | None = None,
        workers: Sequence[int] | None = None,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        alignment: int = DEFAULT_ALIGNMENT,
        ramp_bytes: int = DEFAULT_RAMP_BYTES,
        solo_bytes: int = DEFAULT_SOLO_BYTES,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        keep_buffers: bool | None = None,
    ) -> None:
        targets = list(targets)
        if not targets:
            raise ValueError("at least one engine target is needed")
        if len(set(targets)) != len(targets):
            raise ValueError(f"duplicate engine targets in {targets}")
        if workers is not None and (len(workers) != len(targets) or any(w < 1 for w in workers)):
            raise ValueError(f"workers must give a count >= 1 for each of the {len(targets)} targets")
        if rpc_timeout_s <= 0 or group_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if ramp_bytes < 0:
            raise ValueError(f"ramp_bytes must not be negative, got {ramp_bytes}")
        if solo_bytes < 0:
            raise ValueError(f"solo_bytes must not be negative, got {solo_bytes}")
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; use 'gloo', 'nccl' or ''")
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or DEFAULT_GROUP_NAME
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.backend = cast(BackendName, resolve_backend(backend, self.device))
        """The backend in use, resolved from ``device`` (sent explicitly to every engine)."""
        self.rpc_timeout_s = rpc_timeout_s
        self.group_timeout_s = group_timeout_s
        self.bucket_bytes = bucket_bytes
        self.alignment = alignment
        self.ramp_bytes = ramp_bytes
        self.solo_bytes = solo_bytes
        self._fixed_workers = list(workers) if workers is not None else None
        self._metadata: tuple[tuple[str, str | bytes], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            *channel_options,
        ]
        self._engines: list[_Engine] = []
        for t in targets:
            ch = (
                grpc.secure_channel(t, credentials, options=options)
                if credentials is not None
                else grpc.insecure_channel(t, options=options)
            )
            self._engines.append(_Engine(t, ch, weight_sync_pb2_grpc.WeightSyncServiceStub(ch)))
        self._group: WeightSyncGroup | None = None
        self._needs_init = True
        self._init_replies: dict[str, pb.InitResponse] = {}
        self._port_in_use: int | None = None
        self._op_lock = threading.Lock()
        self._cancel_event = threading.Event()
        self._closed = False
        self._init_attempted = False
        self._keep_buffers = self.device.type == "cpu" if keep_buffers is None else keep_buffers
        self._slots: list[torch.Tensor | None] = [None, None]
        self._plan_cache: tuple[tuple[object, ...] | None, list[Bucket], list[pb.PrepareRequest]] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def targets(self) -> list[str]:
        """The engines' addresses, in rank order."""
        return [e.target for e in self._engines]

    @property
    def stubs(self) -> dict[str, weight_sync_pb2_grpc.WeightSyncServiceStub]:
        """target -> the generated stub on the client's channel, for calls the client does not wrap."""
        return {e.target: e.stub for e in self._engines}

    @property
    def call_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The metadata (token) to pass along with calls made on :attr:`stubs`."""
        return self._metadata

    @property
    def needs_init(self) -> bool:
        """Whether the next :meth:`sync` (re-)initializes the group first."""
        return self._needs_init or self._group is None

    @property
    def group(self) -> WeightSyncGroup | None:
        """The trainer's membership of the weight-sync group (rank 0), ``None`` before :meth:`init`."""
        return self._group

    @property
    def workers(self) -> dict[str, int]:
        """target -> workers, as of the last :meth:`init` (0 before it)."""
        return {e.target: e.workers for e in self._engines}

    @property
    def rank_offsets(self) -> dict[str, int]:
        """target -> group rank of the engine's first worker, as of the last :meth:`init` (0 before it)."""
        return {e.target: e.rank_offset for e in self._engines}

    @property
    def world_size(self) -> int:
        """1 + every engine's workers, as of the last :meth:`init` (1 before it)."""
        return 1 + sum(e.workers for e in self._engines)

    @property
    def port(self) -> int | None:
        """The TCP port of the trainer's store in the current group; ``None`` when not joined."""
        return self._port_in_use if self._group is not None else None

    # ------------------------------------------------------------------ fan-out plumbing

    def _gather(
        self, rpc: str, start: Callable[[_Engine], grpc.Future[R]], engines: Sequence[_Engine] | None = None
    ) -> tuple[dict[str, R], dict[str, EngineFailure]]:
        """Start one call per engine (concurrently), then collect every reply or failure.

        Every call carries its own deadline, so collecting is bounded.
        """
        engines = self._engines if engines is None else engines
        futures: dict[str, grpc.Future[R]] = {}
        failures: dict[str, EngineFailure] = {}
        for e in engines:
            try:
                futures[e.target] = start(e)
            except Exception as exc:
                failures[e.target] = EngineFailure.from_exception(e.target, rpc, exc)
        results: dict[str, R] = {}
        for target, fut in futures.items():
            try:
                results[target] = fut.result()
            except Exception as exc:
                failures[target] = EngineFailure.from_exception(target, rpc, exc)
        return results, failures

    def _fan_out(
        self, rpc: str, start: Callable[[_Engine], grpc.Future[R]], engines: Sequence[_Engine] | None = None
    ) -> dict[str, R]:
        results, failures = self._gather(rpc, start, engines)
        if failures:
            raise EngineCallError(
                f"{rpc} failed on {len(failures)} of {len(results) + len(failures)} engine(s): "
                f"{_failure_lines(failures)}",
                rpc=rpc,
                failures=failures,
                results=results,
            )
        return results

    # ------------------------------------------------------------------ fan-out helpers

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """``GetStatus`` on every engine: target -> reply.

        Raises:
            EngineCallError: some engine did not answer; ``results`` has the others.
        """
        return self._fan_out(
            "GetStatus",
            lambda e: e.stub.GetStatus.future(
                pb.GetStatusRequest(), timeout=self.rpc_timeout_s, metadata=self._metadata
            ),
        )

    def pause(self, mode: PauseModeName = "abort", timeout: float | None = None) -> dict[str, pb.PauseResponse]:
        """``Pause`` every engine: target -> reply (how many requests were aborted/drained/frozen).

        Args:
            mode: ``"abort"`` (end requests in flight), ``"wait"`` (drain them)
                or ``"keep"`` (freeze them until resume), as vLLM's ``/pause?mode=``.
            timeout: drain bound of ``"wait"``, in seconds; ``None`` = the
                engine's default (60 s).

        Raises:
            ValueError: unknown mode.
            EngineCallError: some engine failed (e.g. DEADLINE_EXCEEDED when the drain timed out).
        """
        if mode not in _PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; use 'abort', 'wait' or 'keep'")
        req = pb.PauseRequest(mode=_PAUSE_MODES[mode])
        if timeout is not None:
            req.timeout.CopyFrom(_duration(timeout))
        deadline = self.rpc_timeout_s + (timeout if timeout is not None else 60.0)
        return self._fan_out("Pause", lambda e: e.stub.Pause.future(req, timeout=deadline, metadata=self._metadata))

    def resume(self, force: bool = False) -> dict[str, pb.ResumeResponse]:
        """``Resume`` every engine: target -> reply.

        Args:
            force: resume even an engine whose weights a failed streaming
                update left dirty (half-updated).

        Raises:
            EngineCallError: some engine refused (e.g. FAILED_PRECONDITION ENGINE_DIRTY).
        """
        req = pb.ResumeRequest(force=force)
        return self._fan_out(
            "Resume", lambda e: e.stub.Resume.future(req, timeout=self.rpc_timeout_s, metadata=self._metadata)
        )

    def checksums(self, names: Iterable[str] = ()) -> dict[str, pb.GetWeightChecksumsResponse]:
        """``GetWeightChecksums`` on every engine: target -> SHA-256 of each served tensor.

        Args:
            names: tensors to digest; empty (default) = every tensor.

        Raises:
            EngineCallError: some engine failed (e.g. INVALID_ARGUMENT UNKNOWN_TENSOR).
        """
        req = pb.GetWeightChecksumsRequest(names=list(names))
        return self._fan_out(
            "GetWeightChecksums",
            lambda e: e.stub.GetWeightChecksums.future(req, timeout=self.rpc_timeout_s, metadata=self._metadata),
        )

    def cancel(self, reason: str = "cancelled by the trainer") -> dict[str, pb.CancelResponse]:
        """Cancel whatever update is in flight on every engine, and interrupt a :meth:`sync` in flight.

        Engines that had an update in flight abandon it, go to FAILED and
        leave the group, so the client is then marked for re-initialization.
        Safe to call from another thread while ``sync`` runs: its broadcast
        stops at the next wait and it raises :class:`SyncError`.

        Args:
            reason: recorded in the engines' ``last_error``.

        Returns:
            target -> reply (``cancelled`` is False where nothing was in flight).

        Raises:
            EngineCallError: some engine failed (e.g. FAILED_PRECONDITION while applying).
        """
        self._cancel_event.set()
        results, failures = self._gather("Cancel", lambda e: self._cancel_call(e, "", reason))
        if any(r.cancelled for r in results.values()) or failures:
            self._needs_init = True
        if failures:
            raise EngineCallError(
                f"Cancel failed on {len(failures)} engine(s): {_failure_lines(failures)}",
                rpc="Cancel",
                failures=failures,
                results=results,
            )
        return results

    def _cancel_call(self, e: _Engine, update_id: str, reason: str) -> grpc.Future[pb.CancelResponse]:
        return e.stub.Cancel.future(
            pb.CancelRequest(update_id=update_id, reason=reason),
            timeout=self.rpc_timeout_s,
            metadata=self._metadata,
        )

    def leave(self) -> dict[str, pb.LeaveResponse]:
        """Every engine leaves the group, and so does the trainer; the next :meth:`sync` re-inits.

        Returns:
            target -> reply (``was_member`` is False where it was not a member).

        Raises:
            EngineCallError: some engine failed (FAILED_PRECONDITION when an
                update is in flight there: :meth:`cancel` first).
        """
        with self._op_lock:
            return self._leave_locked()

    def _leave_locked(self) -> dict[str, pb.LeaveResponse]:
        try:
            return self._fan_out(
                "Leave",
                lambda e: e.stub.Leave.future(pb.LeaveRequest(), timeout=self.rpc_timeout_s, metadata=self._metadata),
            )
        finally:
            self._drop_group()

    def _drop_group(self) -> None:
        """Destroy the trainer's side of the group and mark the client for re-init."""
        self._needs_init = True
        self._init_replies = {}
        group, self._group = self._group, None
        if group is not None:
            group.destroy()

    # ------------------------------------------------------------------ context manager

    def close(self) -> None:
        """Leave the group (engines and trainer, best effort) and close the channels. Idempotent.

        Errors from engines are logged, not raised: ``close`` runs on the way
        out, often after another error.
        """
        if self._closed:
            return
        self._closed = True
        with self._op_lock:
            if self._init_attempted:
                try:
                    self._fan_out(
                        "Leave",
                        lambda e: e.stub.Leave.future(
                            pb.LeaveRequest(), timeout=min(self.rpc_timeout_s, 10.0), metadata=self._metadata
                        ),
                    )
                except EngineCallError as err:
                    log.warning("leaving the weight-sync group on close: %s", err)
            self._drop_group()
            self._slots = [None, None]
        for e in self._engines:
            e.channel.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ init

    def init(self, *, force: bool = False) -> dict[str, pb.InitResponse]:
        """Form the weight-sync group: every engine's workers plus the trainer as rank 0.

        Steps: ``GetStatus`` on every engine (worker counts, state); engines
        still holding an old membership are made ready for a new one (an
        update in flight is cancelled, a READY engine leaves its old group,
        JOINING or APPLYING ones are waited for, at most the group timeout);
        rank offsets ``1, 1 + w0, 1 + w0 + w1, ...`` are assigned in target
        order; ``Init`` is sent to every engine concurrently and, while those
        calls are in flight, the trainer creates its side of the group
        (``join_group`` as rank 0, serving the TCP store). If an engine's Init
        fails before the group forms, ``init`` fails at once instead of waiting
        for the join timeout.

        Without ``force``, a client that is already initialized and healthy
        returns its current membership without any call.

        Returns:
            target -> ``InitResponse`` (the group as each engine joined it).

        Raises:
            InitError: an engine failed (status, cleanup or Init), the
                trainer's join failed (under :data:`TRAINER`), or an engine
                reports other ranks than assigned. The client stays marked for
                re-initialization.
            ClientError: the client was closed.
        """
        with self._op_lock:
            if self._group is not None and not self._needs_init and not force:
                return dict(self._init_replies)
            return self._init_locked()

    def _init_locked(self) -> dict[str, pb.InitResponse]:
        if self._closed:
            raise ClientError("the client is closed")
        self._drop_group()
        self._cancel_event.clear()
        self._init_attempted = True
        statuses, failures = self._gather(
            "GetStatus",
            lambda e: e.stub.GetStatus.future(
                pb.GetStatusRequest(), timeout=self.rpc_timeout_s, metadata=self._metadata
            ),
        )
        if failures:
            raise InitError(f"cannot initialize: {_failure_lines(failures)}", rpc="Init", failures=failures, results={})
        # Worker counts and rank offsets, in target order.
        offset = 1
        for i, e in enumerate(self._engines):
            e.workers = self._fixed_workers[i] if self._fixed_workers else int(statuses[e.target].engine.workers)
            if e.workers < 1:
                raise InitError(
                    f"{e.target} reports {e.workers} workers",
                    rpc="Init",
                    failures={
                        e.target: EngineFailure(e.target, "GetStatus", None, "NO_WORKERS", "engine.workers is 0")
                    },
                    results={},
                )
            e.rank_offset = offset
            offset += e.workers
        world_size = offset
        # Engines still in an old group (or busy) must be free to join a new one.
        failures = {}
        for e in self._engines:
            try:
                self._free_engine(e, statuses[e.target])
            except EngineCallError as exc:
                failures.update(exc.failures)
        if failures:
            raise InitError(f"cannot initialize: {_failure_lines(failures)}", rpc="Init", failures=failures, results={})
        port = self.master_port or free_port()
        replies = self._join_all(port, world_size)
        self._port_in_use = port
        self._init_replies = replies
        self._needs_init = False
        log.info(
            "weight-sync group %r formed: world size %d, %d engine(s), store %s:%d",
            self.group_name,
            world_size,
            len(self._engines),
            self.master_address,
            port,
        )
        return dict(replies)

    def _free_engine(self, e: _Engine, status: pb.GetStatusResponse) -> None:
        """Bring ``e`` to UNINITIALIZED or FAILED, the states in which Init joins a new group.

        Raises:
            EngineCallError: a Leave, Cancel or GetStatus call failed, or the
                engine stayed JOINING/APPLYING past the group timeout.
        """
        deadline = time.monotonic() + self.group_timeout_s + self.rpc_timeout_s
        kw: dict[str, Any] = {"timeout": self.rpc_timeout_s, "metadata": self._metadata}
        rpc = "GetStatus"
        try:
            while True:
                state = status.state
                if state in (pb.LIFECYCLE_STATE_UNINITIALIZED, pb.LIFECYCLE_STATE_FAILED):
                    return
                if state == pb.LIFECYCLE_STATE_READY:
                    rpc = "Leave"
                    e.stub.Leave(pb.LeaveRequest(), **kw)
                    log.info("%s left its previous weight-sync group", e.target)
                elif state in (
                    pb.LIFECYCLE_STATE_PREPARING,
                    pb.LIFECYCLE_STATE_RECEIVING,
                    pb.LIFECYCLE_STATE_RECEIVED,
                ):
                    rpc = "Cancel"
                    e.stub.Cancel(pb.CancelRequest(reason="the trainer re-initializes the group"), **kw)
                    log.info("%s: cancelled the update in flight", e.target)
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the engine stayed in {pb.LifecycleState.Name(state)} for more than "
                        f"{self.group_timeout_s + self.rpc_timeout_s:g} s"
                    )
                else:  # JOINING or APPLYING: both end by the engine's own deadlines
                    time.sleep(0.1)
                rpc = "GetStatus"
                status = e.stub.GetStatus(pb.GetStatusRequest(), **kw)
        except Exception as exc:
            failure = EngineFailure.from_exception(e.target, rpc, exc)
            raise EngineCallError(str(failure), rpc=rpc, failures={e.target: failure}, results={}) from exc

    def _join_all(self, port: int, world_size: int) -> dict[str, pb.InitResponse]:
        """Send Init to every engine, join as rank 0 meanwhile, then collect the Init replies."""
        rpc_deadline = self.group_timeout_s + self.rpc_timeout_s
        events = threading.Event()  # set whenever a future or the join finishes
        futures: dict[str, grpc.Future[pb.InitResponse]] = {}
        failures: dict[str, EngineFailure] = {}
        for e in self._engines:
            req = pb.InitRequest(
                master_address=self.master_address,
                master_port=port,
                rank_offset=e.rank_offset,
                world_size=world_size,
                group_name=self.group_name,
                backend=_BACKENDS[self.backend],
                timeout=_duration(self.group_timeout_s),
            )
            try:
                call = e.stub.Init.future(req, timeout=rpc_deadline, metadata=self._metadata)
            except Exception as exc:
                failures[e.target] = EngineFailure.from_exception(e.target, "Init", exc)
                continue
            call.add_done_callback(lambda _f: events.set())
            futures[e.target] = call

        # The trainer joins in a helper thread so that a fast Init failure is noticed at once.
        joined: list[WeightSyncGroup] = []
        join_error: list[BaseException] = []
        abandoned = threading.Event()

        def join() -> None:
            try:
                g = join_group(
                    master_address=self.master_address,
                    master_port=port,
                    rank=0,
                    world_size=world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                    device=self.device,
                    timeout_s=self.group_timeout_s,
                )
            except BaseException as exc:
                join_error.append(exc)
            else:
                if abandoned.is_set():
                    g.destroy()
                else:
                    joined.append(g)
            finally:
                events.set()

        thread = threading.Thread(target=join, name="wsync-trainer-join", daemon=True)
        if not failures:
            thread.start()
            while True:
                events.wait(0.5)
                events.clear()
                if not thread.is_alive():
                    break
                failed_early = [t for t, f in futures.items() if f.done() and f.exception() is not None]
                if failed_early:
                    break
            thread.join(0)
        if thread.is_alive() or failures:
            # An engine's Init failed while the trainer was still joining: give up now.
            abandoned.set()
        for fut in futures.values():
            if not joined and not fut.done():
                fut.cancel()
        replies: dict[str, pb.InitResponse] = {}
        for target, fut in futures.items():
            try:
                replies[target] = fut.result()
            except Exception as exc:
                failures[target] = EngineFailure.from_exception(target, "Init", exc)
        if join_error:
            failures[TRAINER] = EngineFailure.from_exception(TRAINER, "join", join_error[0])
        elif not joined and not failures:
            failures[TRAINER] = EngineFailure(
                TRAINER,
                "join",
                None,
                "ABANDONED",
                "the trainer stopped joining after an engine's Init failed",
            )
        for e in self._engines:
            r = replies.get(e.target)
            expected = list(range(e.rank_offset, e.rank_offset + e.workers))
            if r is not None and list(r.group.ranks) != expected:
                failures[e.target] = EngineFailure(
                    e.target,
                    "Init",
                    None,
                    "RANK_MISMATCH",
                    f"joined at ranks {list(r.group.ranks)}, expected {expected}",
                )
        if failures:
            if joined:
                joined[0].destroy()
            # Engines that did join are members of a group that will never be used.
            self._needs_init = True
            raise InitError(
                f"the weight-sync group did not form (store {self.master_address}:{port}, "
                f"world size {world_size}): {_failure_lines(failures)}",
                rpc="Init",
                failures=failures,
                results=replies,
            )
        self._group = joined[0]
        return replies

    # ------------------------------------------------------------------ sync

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str,
        *,
        layout: Layout = "flattened",
        apply_mode: ApplyMode = "staged",
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        flush_cache: bool = False,
        progress: Callable[[SyncProgress], None] | None = None,
        update_id: str | None = None,
    ) -> SyncResult:
        """Push ``named_tensors`` to every engine as ``weight_version``.

        Sequence: (re-)init if needed; plan buckets; a streaming ``Prepare``
        (header, then one message per bucket) to every engine concurrently,
        waiting for every reply (an engine replies once its receives are
        posted); broadcast every bucket (flattened: packed into a ``uint8``
        buffer, the next bucket packed while the current one is on the wire;
        individual: each tensor contiguous in its wire dtype); ``Complete``
        on every engine concurrently.

        On any failure (an engine rejects the metadata, dies, times out, or
        the trainer's broadcast fails): no further byte is broadcast, the
        update is cancelled on every engine (engines whose Prepare was
        rejected keep their state and weights), the trainer leaves the group,
        the client is marked for re-init (the next ``sync`` re-initializes
        automatically), and one :class:`SyncError` is raised.

        Args:
            named_tensors: ``(name, tensor)`` pairs, e.g.
                ``model.named_parameters()`` or ``model.state_dict().items()``;
                tied tensors are sent once, under their first name.
            weight_version: the version the engines report once the update
                succeeded (SGLang's ``weight_version``), e.g. ``"step-42"``.
            layout: ``"flattened"`` (one broadcast per bucket, default) or
                ``"individual"`` (one per tensor).
            apply_mode: ``"staged"`` (apply everything at Complete; the
                engine needs memory for the whole update) or ``"streaming"``
                (apply bucket by bucket, about two buckets of extra memory; the
                engine is frozen until Complete).
            bucket_bytes: bucket capacity, in bytes; ``None`` = the client's.
            dtype: send floating tensors in this dtype (e.g. ``torch.bfloat16``).
            flush_cache: have the engines flush their prefix/KV cache (SGLang's
                ``flush_cache``).
            progress: called from this thread after every bucket.
            update_id: the update's id; ``None`` = a fresh UUID.

        Returns:
            A :class:`SyncResult` with per-engine results and trainer-side timings.

        Raises:
            ValueError: empty ``weight_version``, nothing to send, a bad
                ``layout``/``apply_mode``, or a planning error.
            SyncError: the update failed (see above); the message names every
                failed engine with its code, reason and message.
            RuntimeError: another ``sync`` is running in this client.
            ClientError: the client was closed.
        """
        if not weight_version:
            raise ValueError("weight_version is required")
        if layout not in _LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; use 'flattened' or 'individual'")
        if apply_mode not in _APPLY_MODES:
            raise ValueError(f"unknown apply_mode {apply_mode!r}; use 'staged' or 'streaming'")
        if not self._op_lock.acquire(blocking=False):
            raise RuntimeError("another sync (or init/leave) is running on this client")
        try:
            return self._sync_locked(
                named_tensors,
                weight_version,
                layout=layout,
                apply_mode=apply_mode,
                bucket_bytes=bucket_bytes or self.bucket_bytes,
                dtype=dtype,
                flush_cache=flush_cache,
                progress=progress,
                update_id=update_id or uuid.uuid4().hex,
            )
        finally:
            self._op_lock.release()

    def _sync_locked(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str,
        *,
        layout: Layout,
        apply_mode: ApplyMode,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        flush_cache: bool,
        progress: Callable[[SyncProgress], None] | None,
        update_id: str,
    ) -> SyncResult:
        if self._closed:
            raise ClientError("the client is closed")
        t_plan = time.monotonic()
        pairs = list(named_tensors)
        layout_enum = _LAYOUTS[layout]
        buckets, messages = self._plan(pairs, bucket_bytes, dtype, layout_enum)
        if not buckets:
            raise ValueError("nothing to sync: no tensors given")
        by_name = dict(pairs)
        wire_bytes = total_wire_bytes(buckets, layout_enum)
        plan_s = time.monotonic() - t_plan

        def fail(
            stage: str,
            failures: Mapping[str, EngineFailure],
            results: Mapping[str, EngineSyncResult] | None = None,
            broadcast_started: bool = False,
        ) -> SyncError:
            return self._abandon(
                stage=stage,
                update_id=update_id,
                weight_version=weight_version,
                failures=failures,
                results=results or {},
                broadcast_started=broadcast_started,
            )

        t_init = time.monotonic()
        if self.needs_init:
            try:
                self._init_locked()
            except InitError as e:
                raise fail("init", e.failures) from e
        init_s = time.monotonic() - t_init
        self._cancel_event.clear()
        group = self._group
        assert group is not None

        # Prepare everywhere; every engine replies once its receivers are armed.
        header = pb.PrepareHeader(
            update_id=update_id,
            weight_version=weight_version,
            transport=pb.TRANSPORT_BROADCAST,
            layout=layout_enum,
            apply_mode=_APPLY_MODES[apply_mode],
            bucket_count=len(buckets),
            total_bytes=wire_bytes,
        )

        def stream() -> Iterator[pb.PrepareRequest]:
            yield pb.PrepareRequest(header=header)
            yield from messages

        t0 = time.monotonic()
        prepared, failures = self._gather(
            "Prepare",
            lambda e: e.stub.Prepare.future(stream(), timeout=self.rpc_timeout_s, metadata=self._metadata),
        )
        prepare_s = time.monotonic() - t0
        if not failures and self._cancel_event.is_set():
            failures[TRAINER] = EngineFailure(TRAINER, "Prepare", None, "CANCELLED", "cancel() was called")
        if failures:
            raise fail("prepare", failures)

        # Broadcast every bucket.
        t_bcast = time.monotonic()
        try:
            if layout == "flattened":
                pack_s = self._broadcast_flattened(group, buckets, by_name, update_id, wire_bytes, progress)
            else:
                pack_s = self._broadcast_individual(group, buckets, by_name, update_id, wire_bytes, progress)
        except Exception as exc:
            trainer = EngineFailure.from_exception(TRAINER, "broadcast", exc)
            raise fail("broadcast", {TRAINER: trainer}, broadcast_started=True) from exc
        except BaseException:  # KeyboardInterrupt and the like: clean up, then let it go
            fail("broadcast", {}, broadcast_started=True)
            raise
        broadcast_s = time.monotonic() - t_bcast

        # Complete everywhere.
        t_complete = time.monotonic()
        req = pb.CompleteRequest(update_id=update_id, flush_cache=flush_cache, timeout=_duration(self.group_timeout_s))
        completed, failures = self._gather(
            "Complete",
            lambda e: e.stub.Complete.future(
                req, timeout=self.group_timeout_s + self.rpc_timeout_s, metadata=self._metadata
            ),
        )
        done = time.monotonic()
        results = {
            t: EngineSyncResult(
                target=t,
                update_id=r.update_id,
                weight_version=r.weight_version,
                bucket_count=r.bucket_count,
                tensor_count=r.tensor_count,
                bytes_received=r.bytes_received,
                ready_seconds=prepared[t].ready_seconds,
                receive_seconds=r.receive_seconds,
                apply_seconds=r.apply_seconds,
                total_seconds=r.total_seconds,
                cache_flushed=r.cache_flushed,
            )
            for t, r in completed.items()
        }
        if failures:
            raise fail("complete", failures, results, broadcast_started=True)
        return SyncResult(
            update_id=update_id,
            weight_version=weight_version,
            layout=layout,
            apply_mode=apply_mode,
            bucket_count=len(buckets),
            tensor_count=sum(len(b.tensors) for b in buckets),
            payload_bytes=sum(b.payload_bytes for b in buckets),
            wire_bytes=wire_bytes,
            init_seconds=init_s,
            plan_seconds=plan_s,
            prepare_seconds=prepare_s,
            broadcast_seconds=broadcast_s,
            pack_seconds=pack_s,
            complete_seconds=done - t_complete,
            total_seconds=done - t0,
            engines={e.target: results[e.target] for e in self._engines},
        )

    def _plan(
        self,
        pairs: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        dtype: torch.dtype | None,
        layout: pb.BucketLayout.ValueType,
    ) -> tuple[list[Bucket], list[pb.PrepareRequest]]:
        """Plan the buckets and their Prepare messages, reusing the last plan when nothing it depends on changed.

        A trainer syncs the same parameters every step, and planning a large
        MoE (tens of thousands of tensors) costs more than checking that each
        tensor still has its name, dtype, shape, strides, address and device
        (the address and strides decide which tensors are tied).
        """
        try:
            signature: tuple[object, ...] | None = (
                bucket_bytes,
                self.alignment,
                dtype,
                self.ramp_bytes,
                self.solo_bytes,
                layout,
                [(n, t.dtype, t.shape, t.stride(), t.data_ptr(), t.get_device()) for n, t in pairs],
            )
        except (RuntimeError, NotImplementedError):  # tensor subclasses without plain storage
            signature = None
        cached = self._plan_cache
        if signature is not None and cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        solo = self.solo_bytes if layout == pb.BUCKET_LAYOUT_FLATTENED else 0  # individual: every tensor is alone
        buckets = plan_buckets(pairs, bucket_bytes, self.alignment, dtype, ramp_bytes=self.ramp_bytes, solo_bytes=solo)
        messages = batch_bucket_specs([b.spec(layout) for b in buckets])
        self._plan_cache = (signature, buckets, messages) if signature is not None else None
        return buckets, messages

    def _abandon(
        self,
        *,
        stage: str,
        update_id: str,
        weight_version: str,
        failures: Mapping[str, EngineFailure],
        results: Mapping[str, EngineSyncResult],
        broadcast_started: bool,
    ) -> SyncError:
        """The failure protocol: Cancel everywhere, leave the group, build the one error to raise."""
        cancelled: dict[str, bool] = {}
        cancel_failures: dict[str, EngineFailure] = {}
        if stage != "init":
            # Cancel is idempotent: engines that rejected Prepare (or completed)
            # answer cancelled = false and keep their state.
            pending = [e for e in self._engines if e.target not in results]
            replies, cancel_failures = self._gather(
                "Cancel",
                lambda e: self._cancel_call(e, update_id, f"the trainer abandoned the update ({stage} failed)"),
                pending,
            )
            cancelled = {t: r.cancelled for t, r in replies.items()}
        self._drop_group()
        self._slots = [None, None]  # a broadcast abandoned half-way may still read them
        all_failures = dict(failures)
        for t, f in cancel_failures.items():
            all_failures.setdefault(t, f)
        engine_failures = len([t for t in all_failures if t != TRAINER])
        where = [f"{engine_failures} of {len(self._engines)} engine(s)"] if engine_failures else []
        where += ["the trainer"] if TRAINER in all_failures else []
        parts = [
            f"sync of weight version {weight_version!r} (update {update_id}) failed at {stage} on "
            f"{' and '.join(where) or 'no engine'}: {_failure_lines(all_failures)}"
        ]
        if not broadcast_started and stage != "init":
            parts.append("no byte was broadcast")
        if any(cancelled.values()):
            parts.append("cancelled on " + ", ".join(t for t, c in cancelled.items() if c))
        if results:
            parts.append(f"applied on {', '.join(results)} (they serve {weight_version!r} now)")
        parts.append("the trainer left the group; the next sync re-initializes it")
        log.warning("%s", "; ".join(parts))
        return SyncError(
            "; ".join(parts),
            stage=stage,
            update_id=update_id,
            weight_version=weight_version,
            failures=all_failures,
            results=results,
            cancelled=cancelled,
            broadcast_started=broadcast_started,
        )

    def _wait(self, group: WeightSyncGroup, work: torch.distributed.Work) -> None:
        wait_work(work, time.monotonic() + group.timeout_s, self._cancel_event, sliced=group.sliced_waits)

    def _broadcast_flattened(
        self,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        by_name: Mapping[str, torch.Tensor],
        update_id: str,
        total: int,
        progress: Callable[[SyncProgress], None] | None,
    ) -> float:
        """One broadcast per bucket, double-buffered: pack k+1 while k is on the wire.

        A bucket that is one tensor already laid out as its bytes is broadcast
        from the tensor itself (:func:`~wsync_grpc.core.buckets.bucket_bytes_view`),
        without packing and without a buffer; other buckets are packed into
        one of two reused buffers, a buffer being repacked only once the
        broadcast that read it has completed. Up to :data:`FLAT_WINDOW`
        broadcasts are in flight, so that the wire never waits for this
        thread between two buckets.

        Returns the time spent packing, in seconds.
        """
        slots: list[torch.Tensor | None] = self._slots if self._keep_buffers else [None, None]
        pack_s = 0.0
        sent = 0
        start = time.monotonic()
        window: collections.deque[tuple[torch.distributed.Work, Bucket, int]] = collections.deque()
        packed = 0  # buckets packed so far; bucket p uses slot p % 2

        def finish() -> None:
            nonlocal sent
            work, b, _slot = window.popleft()
            self._wait(group, work)
            sent += b.size_bytes
            self._report(progress, update_id, b.index + 1, len(buckets), sent, total, start)

        for b in buckets:
            t = time.monotonic()
            buf = bucket_bytes_view(b, by_name, group.device)
            slot_index = -1
            if buf is None:
                slot_index = packed % 2
                packed += 1
                while any(s == slot_index for _w, _b, s in window):  # the slot is still on the wire
                    finish()
                t = time.monotonic()
                slot = slots[slot_index]
                if slot is None or slot.numel() < b.size_bytes or slot.device != group.device:
                    slot = slots[slot_index] = torch.empty(b.size_bytes, dtype=torch.uint8, device=group.device)
                buf = slot[: b.size_bytes]
                # Padding zeroed: a reused or fresh buffer never puts stale trainer memory on the wire.
                pack_bucket(b, by_name, buf, zero_padding=True)
            pack_s += time.monotonic() - t
            while len(window) >= FLAT_WINDOW:
                finish()
            window.append((group.broadcast(buf), b, slot_index))
        while window:
            finish()
        return pack_s

    def _broadcast_individual(
        self,
        group: WeightSyncGroup,
        buckets: Sequence[Bucket],
        by_name: Mapping[str, torch.Tensor],
        update_id: str,
        total: int,
        progress: Callable[[SyncProgress], None] | None,
    ) -> float:
        """One broadcast per tensor, in order, up to two buckets in flight.

        Every tensor of bucket k+1 is prepared (made contiguous in its wire
        dtype) and posted before bucket k's broadcasts are waited for; the
        engines keep two buckets of receives posted. Waiting for each tensor
        before posting the next costs a round trip per tensor, which is what
        dominates for a model of many small tensors (a large MoE): it measured
        about 2x slower than the naive per-tensor way on a 20k-tensor model.
        Broadcasts are waited for half a window at a time
        (:func:`~wsync_grpc.group.process_group.wait_all`).
        Converted copies (when a tensor is not already contiguous in its wire
        dtype) are held for at most two buckets.

        Returns the time spent preparing tensors, in seconds.
        """
        pack_s = 0.0
        sent = 0
        start = time.monotonic()
        window: collections.deque[tuple[torch.distributed.Work, torch.Tensor, Bucket, PlannedTensor]] = (
            collections.deque()
        )

        def finish(n: int) -> None:
            # The oldest n together: one completion callback for all of them (see wait_all).
            nonlocal sent
            done = [window.popleft() for _ in range(min(n, len(window)))]
            wait_all(
                [d[0] for d in done],
                time.monotonic() + group.timeout_s,
                self._cancel_event,
                sliced=group.sliced_waits,
            )
            for _work, _wire, b, pt in done:
                sent += pt.nbytes
                if pt is b.tensors[-1]:
                    self._report(progress, update_id, b.index + 1, len(buckets), sent, total, start)

        for b in buckets:
            t = time.monotonic()
            wires = [wire_tensor(pt, by_name[pt.name], group.device) for pt in b.tensors]
            pack_s += time.monotonic() - t
            for pt, wire in zip(b.tensors, wires, strict=True):
                if len(window) >= INDIVIDUAL_WINDOW:
                    finish(INDIVIDUAL_WINDOW // 2)
                window.append((group.broadcast(wire), wire, b, pt))
        finish(len(window))
        return pack_s

    @staticmethod
    def _report(
        progress: Callable[[SyncProgress], None] | None,
        update_id: str,
        buckets_sent: int,
        bucket_count: int,
        bytes_sent: int,
        total: int,
        start: float,
    ) -> None:
        if progress is not None:
            progress(SyncProgress(update_id, buckets_sent, bucket_count, bytes_sent, total, time.monotonic() - start))
