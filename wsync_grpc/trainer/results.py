"""What :class:`~wsync_grpc.trainer.client.TrainerClient` returns and raises.

- :class:`SyncResult` (one update, trainer-side timings) and
  :class:`EngineSyncResult` (one engine's ``wsync.v1.CompleteResponse``);
- :class:`SyncProgress`, passed to ``sync``'s progress callback;
- the errors: :class:`ClientError` and below it :class:`EngineCallError`
  (a fan-out call failed), :class:`InitError` (the group did not form) and
  :class:`SyncError` (an update failed), each naming every failed engine by
  an :class:`EngineFailure` (gRPC code, ``google.rpc.ErrorInfo`` reason and
  metadata, message).

Units: sizes in bytes, times in seconds, throughputs in GB/s (10^9 bytes per
second).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import grpc.aio
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.options import ApplyMode, Layout
from wsync_grpc.wire.status import error_info

TRAINER = "trainer"
"""The key under which the trainer's own failure (its sending rank's) appears in :attr:`EngineCallError.failures`."""


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

        The rich status is parsed by :func:`wsync_grpc.wire.status.error_info`
        (the grpc-status-details-bin trailer), as the engines send it, from a
        synchronous call's error or a ``grpc.aio.AioRpcError`` alike.
        """
        if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
            call = cast(grpc.Call, exc)
            reason, metadata = error_info(exc)
            return cls(target, rpc, call.code(), reason, call.details() or "", metadata)
        if isinstance(exc, grpc.aio.AioRpcError):  # a failed call of the client's streams (grpc.aio)
            reason, metadata = error_info(exc)
            return cls(target, rpc, exc.code(), reason, exc.details() or "", metadata)
        if isinstance(exc, grpc.FutureCancelledError | concurrent.futures.CancelledError | asyncio.CancelledError):
            return cls(target, rpc, grpc.StatusCode.CANCELLED, "", "the call was cancelled by the client")
        if isinstance(exc, grpc.FutureTimeoutError):
            return cls(target, rpc, grpc.StatusCode.DEADLINE_EXCEEDED, "", "no reply before the deadline")
        return cls(target, rpc, None, type(exc).__name__, str(exc) or type(exc).__name__)


class ClientError(RuntimeError):
    """Base class of the errors :class:`~wsync_grpc.trainer.client.TrainerClient` raises."""


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
    """One :meth:`~wsync_grpc.trainer.client.TrainerClient.sync` failed; the message names every engine that failed.

    By the time it is raised the update was cancelled on every engine, the
    trainer left the group, and the client is marked for re-initialization
    (the next ``sync`` re-inits automatically).

    Attributes:
        stage: where it failed: ``"init"``, ``"prepare"``, ``"broadcast"``, ``"verify"`` (a staged
            update's first commit phase), ``"apply"`` (its second, once every engine verified) or
            ``"complete"`` (a streaming update's Complete).
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

    @property
    def published(self) -> str:
        """Which engines serve ``weight_version`` now: ``"none"``, or ``"partial"`` (those in :attr:`results`).

        A staged update is published everywhere or nowhere, except when an
        engine fails during its own apply (stage ``"apply"``): the others,
        which had all verified it, then serve it.
        """
        return "partial" if self.results else "none"


def _gb_per_s(nbytes: int, seconds: float) -> float:
    """``nbytes`` over ``seconds`` in GB/s (10^9 bytes per second); 0 when ``seconds`` is not positive."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


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
        verify_seconds: the engine's wait for the last buckets in the verifying Complete, in seconds
            (0 for a streaming update).
        buckets_verified: buckets whose bytes matched their digest on every worker of the engine
            (``bucket_count`` when every bucket was checked; 0 when the trainer sent no digests).
        weight_identity: the engine's identity of the weights it serves now (``wsync.v1.CompleteResponse``):
            the base a delta to it names (:mod:`wsync_grpc.trainer.delta`); ``""`` for an adapter.
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
    verify_seconds: float = 0.0
    buckets_verified: int = 0
    weight_identity: str = ""

    @property
    def gb_per_s(self) -> float:
        """``bytes_received`` over ``total_seconds``, in GB/s (10^9 bytes/s); 0 when unmeasurable."""
        return _gb_per_s(self.bytes_received, self.total_seconds)


@dataclass(frozen=True)
class DeltaSummary:
    """What a sync with deltas on sent (``SyncResult.delta``).

    Attributes:
        base_version: the version the delta was taken against; ``""``: the sync was whole (the first, an anchor,
            or an engine was not at the base).
        tensors: tensors in the update.
        delta_tensors: tensors sent as delta entries (the others whole).
        changed_elements: elements whose value in the wire dtype changed, over every tensor diffed.
        total_elements: elements of every tensor.
        diff_seconds: copying to the wire dtype and diffing against the base, in seconds.
        whole_bytes: what the same update sent whole would carry (its tensors' bytes), in bytes.
        values_bytes: the delta entries' values, in bytes (0 for a whole update).
        positions_bytes: the delta entries' positions, in bytes (0 for a whole update).
        whole_targets: the engines that took the same weights whole in the same commit, not being at the base
            (a mixed fleet: :class:`~wsync_grpc.trainer.delta.DeltaSync`); empty: every engine took the delta.
        fell_back: the sync went whole without a diff though its engines were at the base: deltas were taking
            longer than whole syncs on this fleet, or a whole sync was timed again
            (:class:`~wsync_grpc.trainer.delta.DeltaCosts`; ``diff_seconds`` is then 0 or the copy kept).
    """

    base_version: str
    tensors: int
    delta_tensors: int
    changed_elements: int
    total_elements: int
    diff_seconds: float
    whole_bytes: int
    values_bytes: int = 0
    positions_bytes: int = 0
    whole_targets: tuple[str, ...] = ()
    fell_back: bool = False

    def as_whole(self) -> DeltaSummary:
        """The same update sent whole (no base: every element counted as changed)."""
        return dataclasses.replace(
            self,
            base_version="",
            delta_tensors=0,
            changed_elements=self.total_elements,
            values_bytes=0,
            positions_bytes=0,
            whole_targets=(),
        )

    @property
    def changed_share(self) -> float:
        """``changed_elements / total_elements`` (0 for an update without elements)."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


@dataclass(frozen=True)
class SyncResult:
    """The outcome of one successful :meth:`~wsync_grpc.trainer.client.TrainerClient.sync`.

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
        complete_seconds: the first Complete sent to the last engine's reply to the applying one, in seconds
            (both phases of a staged update).
        verify_seconds: the verifying phase of a staged update (every engine's ``Complete(verify_only)``),
            in seconds; 0 for a streaming one.
        total_seconds: first Prepare sent to the last Complete reply, in seconds.
        engines: target -> :class:`EngineSyncResult`, in target order: the engines that serve
            ``weight_version`` now.
        excluded: target -> why, for the engines the client's ``exclude`` fleet policy left out of
            this update (:mod:`wsync_grpc.trainer.roster`); empty under ``fail``. Their weights are
            the ones they had.
        rejoined: the engines that were behind (excluded earlier, restarted, added) and serve the
            new version now, in target order.
        attempts: how many times the update ran (1, plus one for every time it was abandoned to
            leave engines out; the timings are the last attempt's).
        delta: with deltas on (``sync(delta=True)``), what the update sent: a delta against
            ``delta.base_version``, or whole (``base_version`` empty); ``None`` with deltas off.
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
    verify_seconds: float
    total_seconds: float
    engines: dict[str, EngineSyncResult]
    excluded: dict[str, EngineFailure] = field(default_factory=dict)
    rejoined: list[str] = field(default_factory=list)
    attempts: int = 1
    delta: DeltaSummary | None = None

    @property
    def gb_per_s(self) -> float:
        """End-to-end throughput: ``payload_bytes`` over ``total_seconds`` (Prepare to Complete), GB/s."""
        return _gb_per_s(self.payload_bytes, self.total_seconds)

    @property
    def phases(self) -> dict[str, float]:
        """The sync's time from the first Prepare to the last Complete reply, split into disjoint phases.

        ``prepare`` (the Prepare round trip: every engine validated and armed), ``broadcast`` (from
        the last Prepare reply to the first Complete: the broadcast itself, :attr:`broadcast_seconds`,
        with packing overlapped, plus opening the held ``Watch`` calls), ``verify`` (waiting for every
        engine to have received and verified everything: the first commit phase of a staged update;
        0 for a streaming one) and ``apply`` (the applying Complete round trip). They add up to
        :attr:`total_seconds`. Seconds.
        """
        return {
            "prepare": self.prepare_seconds,
            "broadcast": self.total_seconds - self.prepare_seconds - self.complete_seconds,
            "verify": self.verify_seconds,
            "apply": self.complete_seconds - self.verify_seconds,
        }

    @property
    def broadcast_gb_per_s(self) -> float:
        """``wire_bytes`` over ``broadcast_seconds``, in GB/s."""
        return _gb_per_s(self.wire_bytes, self.broadcast_seconds)


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


def failure_lines(failures: Mapping[str, EngineFailure]) -> str:
    """Every failure of ``failures`` on one line, ``"; "``-separated (for error messages)."""
    return "; ".join(str(f) for f in failures.values())


@dataclass(frozen=True)
class Commit:
    """How an update's transfer and commit went (``UpdateProtocol.transfer_and_commit``).

    Attributes:
        results: target -> the engine's result, in target order.
        done: when the last Complete replied (``time.monotonic()``).
        started: when the first Complete was sent (``time.monotonic()``).
        verify_s: the verifying Complete's round trip (staged), in seconds.
        transfer_s: the broadcast, in seconds (0 for a disk update).
        pack_s: the packing inside it, in seconds.
    """

    results: dict[str, EngineSyncResult]
    done: float
    started: float
    verify_s: float
    transfer_s: float
    pack_s: float


def engine_result(target: str, r: pb.CompleteResponse, prepared: pb.PrepareResponse) -> EngineSyncResult:
    """One engine's :class:`~wsync_grpc.trainer.results.EngineSyncResult` from its Complete and Prepare replies."""
    return EngineSyncResult(
        target=target,
        update_id=r.update_id,
        weight_version=r.weight_version,
        bucket_count=r.bucket_count,
        tensor_count=r.tensor_count,
        bytes_received=r.bytes_received,
        ready_seconds=prepared.ready_seconds,
        receive_seconds=r.receive_seconds,
        apply_seconds=r.apply_seconds,
        total_seconds=r.total_seconds,
        cache_flushed=r.cache_flushed,
        verify_seconds=r.verify_seconds,
        buckets_verified=r.buckets_verified,
        weight_identity=r.weight_identity,
    )
