"""What an update reports when it is armed (Prepare), verified or applied (Complete), or failed (metrics)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wsync_grpc.core.errors import WsyncError, clip
from wsync_grpc.service.status import Progress
from wsync_grpc.service.tracing import record_span

if TYPE_CHECKING:
    from wsync_grpc.service.session import UpdateSession

log = logging.getLogger("wsync_grpc.service.session")


@dataclass(frozen=True)
class PrepareResult:
    """An armed update (the fields of ``wsync.v1.PrepareResponse``; sizes in bytes, times in seconds)."""

    update_id: str
    bucket_count: int
    tensor_count: int
    total_bytes: int
    ready_seconds: float


@dataclass(frozen=True)
class CompleteResult:
    """An applied (or only verified) update (the fields of ``wsync.v1.CompleteResponse``).

    Sizes in bytes, times in seconds. The counts are worker 0's; every worker
    receives the same buckets. ``verified_only``: the first phase of a
    two-phase Complete, nothing applied (``weight_version`` is still the served one).
    """

    update_id: str
    weight_version: str
    bucket_count: int
    tensor_count: int
    bytes_received: int
    receive_seconds: float
    apply_seconds: float
    total_seconds: float
    cache_flushed: bool
    verified_only: bool = False
    prepare_seconds: float = 0.0
    verify_seconds: float = 0.0


def _last_arrival(s: UpdateSession, default: float) -> float:
    """When the last bucket arrived on the slowest worker (monotonic seconds); ``default`` before any did."""
    return max((r.last_arrival_at or default) for r in s.receivers) if s.receivers else default


def _result(
    s: UpdateSession, done: float, *, version: str, applied: int, apply_s: float, flushed: bool, verified_only: bool
) -> CompleteResult:
    """What update ``s`` reports at ``done`` (monotonic seconds); the keywords are what differs between replies."""
    armed = s.armed_at or s.started
    r0 = s.receivers[0] if s.receivers else None
    return CompleteResult(
        update_id=s.header.update_id,
        weight_version=version,
        bucket_count=r0.buckets_done if r0 else 0,
        tensor_count=applied,
        bytes_received=r0.bytes_done if r0 else 0,
        receive_seconds=max(0.0, _last_arrival(s, done) - armed),
        apply_seconds=apply_s,
        total_seconds=done - s.started,
        cache_flushed=flushed,
        verified_only=verified_only,
        prepare_seconds=armed - s.started,
        verify_seconds=s.verify_s,
    )


def verified_result(s: UpdateSession, served_version: str, done: float) -> CompleteResult:
    """The result of update ``s``, verified at ``done`` (monotonic seconds) while ``served_version`` is served."""
    log.info("update %s verified: every bucket arrived; waiting for the applying Complete", clip(s.header.update_id))
    return _result(s, done, version=served_version, applied=0, apply_s=0.0, flushed=False, verified_only=True)


def applied_result(s: UpdateSession, t0: float, done: float, flush_cache: bool) -> CompleteResult:
    """The result of update ``s``, applied from ``t0`` to ``done`` (monotonic seconds), logged."""
    applied = s.receivers[0].tensors_applied if s.receivers else 0
    result = _result(
        s,
        done,
        version=s.header.weight_version,
        applied=applied,
        apply_s=done - t0,
        flushed=flush_cache,
        verified_only=False,
    )
    log.info(
        "update %s applied: version %s, %d tensors, %d bytes, %.3f s total",
        clip(result.update_id),
        clip(result.weight_version),
        result.tensor_count,
        result.bytes_received,
        result.total_seconds,
    )
    return result


def record_applied(s: UpdateSession, result: CompleteResult) -> CompleteResult:
    """Count applied update ``s`` in the engine's metrics (its phases, in seconds); return ``result``."""
    phases = {"prepare": result.prepare_seconds, "receive": result.receive_seconds}
    if s.verified:
        phases["verify"] = result.verify_seconds
    phases["apply"] = result.apply_seconds
    s.state.metrics.update_applied(phases, result.total_seconds, sum(r.bytes_done for r in s.receivers))
    return result


def record_failed(s: UpdateSession, err: WsyncError) -> None:
    """Count failed update ``s`` in the engine's metrics (cancelled when ``err`` says it was asked for)."""
    cancelled = err.reason in ("UPDATE_CANCELLED", "SHUTDOWN")
    received = sum(r.bytes_done for r in s.receivers)
    s.state.metrics.update_failed(err.reason, cancelled, time.monotonic() - s.started, received)


def progress_of(s: UpdateSession) -> Progress:
    """Where update ``s`` stands (the slowest worker's counts; sizes in bytes, times in seconds). Lock held."""
    h = s.header
    return Progress(
        update_id=h.update_id,
        weight_version=h.weight_version,
        layout=h.layout,
        apply_mode=h.apply_mode,
        buckets_expected=len(s.feed),
        buckets_received=min((r.buckets_done for r in s.receivers), default=0),
        bytes_expected=s.bytes,
        bytes_received=min((r.bytes_done for r in s.receivers), default=0),
        elapsed_seconds=time.monotonic() - s.started,
        incremental=h.incremental,
    )


def trace_receive(s: UpdateSession) -> None:
    """Record update ``s``'s ``wsync.engine.receive`` span: armed receivers to the last bucket's arrival."""
    if s.trace_context is None or s.armed_at is None or not s.receivers:
        return
    last = _last_arrival(s, s.armed_at)
    record_span(
        "wsync.engine.receive", s.trace_context, s.armed_at, last, update_id=s.header.update_id, buckets=len(s.feed)
    )
