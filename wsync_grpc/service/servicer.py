"""The in-engine ``wsync.v1.WeightSyncService`` servicer.

It owns the lifecycle state machine (:mod:`wsync_grpc.core.lifecycle`), the
engine's membership of the weight-sync group (:mod:`wsync_grpc.group.process_group`), and
one background receiver per worker (:mod:`wsync_grpc.worker.receiver`); it reaches
the engine only through :class:`~wsync_grpc.core.adapter.EngineAdapter`. Every RPC
either does its work or fails fast with a canonical status (one mapping, in
:mod:`wsync_grpc.wire.status`); every wait is bounded.

Failure protocol: a failed, timed-out or cancelled update abandons the
update (the served weights are untouched with staged apply; with streaming
apply they are marked dirty and the engine stays paused), moves to FAILED and
leaves the group, because collectives already posted can no longer be
matched. A fresh Init starts over.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf import duration_pb2
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.adapter import EngineAdapter, PauseMode
from wsync_grpc.core.lifecycle import Event, Lifecycle, Rpc, State
from wsync_grpc.core.validation import Bucket, UpdateHeader, UpdateValidator, validate_transport
from wsync_grpc.group.process_group import (
    DEFAULT_GROUP_NAME,
    DEFAULT_TIMEOUT_S,
    GroupError,
    GroupTimeout,
    WeightSyncGroup,
    join_group,
    resolve_backend,
)
from wsync_grpc.wire.status import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    WsyncError,
    as_wsync_error,
    grpc_errors,
)
from wsync_grpc.worker.receiver import BucketFeed, BufferPool, WorkerReceiver

log = logging.getLogger(__name__)

DEFAULT_PAUSE_TIMEOUT_S = 60.0
"""Drain bound of a WAIT pause when the request gives none, in seconds."""

_BACKENDS = {pb.BACKEND_UNSPECIFIED: "", pb.BACKEND_GLOO: "gloo", pb.BACKEND_NCCL: "nccl"}
_BACKEND_ENUM = {"gloo": pb.BACKEND_GLOO, "nccl": pb.BACKEND_NCCL}
_PAUSE_MODES = {
    pb.PAUSE_MODE_UNSPECIFIED: PauseMode.ABORT,
    pb.PAUSE_MODE_ABORT: PauseMode.ABORT,
    pb.PAUSE_MODE_WAIT: PauseMode.WAIT,
    pb.PAUSE_MODE_KEEP: PauseMode.KEEP,
}
_PAUSE_ENUM = {
    PauseMode.ABORT: pb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: pb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: pb.PAUSE_MODE_KEEP,
}


def seconds(d: duration_pb2.Duration, default: float) -> float:
    """A ``google.protobuf.Duration`` in seconds; ``default`` when unset or zero.

    Raises:
        InvalidArgument: a negative duration.
    """
    s = d.seconds + d.nanos / 1e9
    if s < 0:
        raise InvalidArgument("NEGATIVE_TIMEOUT", f"timeout must not be negative, got {s} s")
    return s if s > 0 else default


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of ``t``'s bytes (C-contiguous, native byte order, its own dtype)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class _GroupParams:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


@dataclass
class _Update:
    header: UpdateHeader
    feed: BucketFeed
    cancel: threading.Event
    started: float
    receivers: list[WorkerReceiver] = field(default_factory=list)
    armed_at: float | None = None
    completing: bool = False
    auto_paused: bool = False
    error: WsyncError | None = None
    tensors: int = 0
    bytes: int = 0


class WeightSyncServicer(weight_sync_pb2_grpc.WeightSyncServiceServicer):
    """Serves ``wsync.v1.WeightSyncService`` for one engine.

    Args:
        adapter: the engine.
        prepare_timeout_s: bound on arming the receivers at Prepare, and on the
            silence between two messages of a Prepare stream, in seconds: a
            stream that stalls longer is cancelled (the client sees
            CANCELLED), so a stuck trainer cannot hold the engine in PREPARING.
        keep_buffers: keep receive buffers between updates (see
            :class:`~wsync_grpc.worker.receiver.BufferPool`). ``None`` (default): keep
            them on CPU workers, where fresh memory costs page faults on every
            update; not on CUDA workers, where torch's caching allocator
            already reuses freed blocks and the KV cache wants the memory.
    """

    def __init__(
        self, adapter: EngineAdapter, *, prepare_timeout_s: float = 30.0, keep_buffers: bool | None = None
    ) -> None:
        self.adapter = adapter
        self.lifecycle = Lifecycle()
        self.prepare_timeout_s = prepare_timeout_s
        self._lock = threading.RLock()
        self._params: _GroupParams | None = None
        self._groups: list[WeightSyncGroup] = []
        self._update: _Update | None = None
        self._failed_update: _Update | None = None
        self._weight_version = ""
        self._dirty = False
        self._last_error: pb.ErrorDetail | None = None
        self._updates_completed = 0
        self._preparing_cancel: threading.Event | None = None
        self._preparing_id: str | None = None  # the update id of the Prepare being read, once its header is in
        self._dirty_paused = False  # the engine is paused because of dirty weights, not by an operator
        specs = adapter.parameter_specs()
        self._devices = list(adapter.worker_devices())
        self._pools = [BufferPool(d, d.type == "cpu" if keep_buffers is None else keep_buffers) for d in self._devices]
        self._engine_info = pb.EngineInfo(
            name=adapter.name,
            parameter_count=sum(s.numel for s in specs.values()),
            parameter_bytes=sum(s.nbytes for s in specs.values()),
            tensor_count=len(specs),
            workers=len(self._devices),
        )

    # ------------------------------------------------------------------ helpers

    @property
    def state(self) -> State:
        """The lifecycle state."""
        return self.lifecycle.state

    @property
    def weight_version(self) -> str:
        """The weight version being served."""
        return self._weight_version

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of receive buffers the workers keep for the next update (``keep_buffers``), in bytes.

        Tensors received in place (streaming apply on an engine that offers
        :class:`~wsync_grpc.core.adapter.InPlaceReceive`) take none.
        """
        return sum(p.free_bytes for p in self._pools)

    def _record_error(self, err: WsyncError, update_id: str = "") -> None:
        self._last_error = pb.ErrorDetail(
            reason=err.reason, message=err.message, update_id=update_id, unix_seconds=time.time()
        )

    def _leave_groups(self) -> None:
        for g in self._groups:
            g.destroy()
        self._groups = []
        self._params = None

    def _fail(self, upd: _Update, err: WsyncError) -> None:
        """Abandon ``upd``: stop its receivers, leave the group, record ``err``. Idempotent."""
        with self._lock:
            if upd.error is not None or self._update is not upd:
                return
            upd.error = err
            upd.cancel.set()
            upd.feed.close()
            applied = any(r.tensors_applied or r.wrote_served for r in upd.receivers)
            for r in upd.receivers:
                # A receive may still be posted into these buffers: never reuse them.
                r.release(reuse=r.done.is_set() and r.error is None)
            self._leave_groups()
            self.lifecycle.fire(Event.FAIL)
            self._update = None
            self._failed_update = upd
            self._record_error(err, upd.header.update_id)
            log.warning(
                "update %s (version %s) failed: %s %s",
                upd.header.update_id,
                upd.header.weight_version,
                err.reason,
                err.message,
            )
            if upd.header.streaming and applied:
                self._mark_dirty(upd)
                log.error("streaming update failed half-way: weights are dirty, the engine stays paused")
            elif upd.auto_paused:
                self.adapter.resume()

    def _mark_dirty(self, upd: _Update) -> None:
        """Flag half-updated weights and keep the engine paused until an update succeeds."""
        self._dirty = True
        if _may_step(self.adapter):  # serving, or a WAIT pause whose requests still run
            self._dirty_paused = not self.adapter.is_paused()
            self.adapter.pause(PauseMode.KEEP, DEFAULT_PAUSE_TIMEOUT_S)
        elif upd.auto_paused:
            self._dirty_paused = True  # our own freeze now holds because of the dirt

    def _on_receiver_event(self, r: WorkerReceiver) -> None:
        with self._lock:
            upd = self._update
            if upd is None or r not in upd.receivers:
                return
            if r.error is not None:
                err = _receive_error(r.error, r.group.timeout_s)
                threading.Thread(target=self._fail, args=(upd, err), daemon=True).start()
                return
            declared = len(upd.feed)
            if all(x.buckets_done == declared for x in upd.receivers):
                self.lifecycle.fire_if(Event.ALL_RECEIVED)

    def _current(self, update_id: str) -> _Update:
        upd = self._update
        if upd is None:
            raise FailedPrecondition("NO_UPDATE", "no update is in flight")
        if update_id != upd.header.update_id:
            raise FailedPrecondition(
                "UPDATE_ID_MISMATCH",
                f"update_id {update_id!r} does not name the update in flight ({upd.header.update_id!r})",
            )
        return upd

    # --------------------------------------------------------------------- Init

    @grpc_errors
    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        """Join the weight-sync group (see the contract for semantics)."""
        params = self._init_params(request)
        with self._lock:
            state = self.lifecycle.check(Rpc.INIT)
            if state == State.READY:
                if params == self._params:
                    return pb.InitResponse(already_joined=True, group=self._group_info())
                raise AlreadyExists(
                    "GROUP_MISMATCH",
                    f"already joined group {self._params.group_name if self._params else ''!r} with other "
                    "parameters; call Leave first",
                )
            self.lifecycle.fire(Event.JOIN)
            self._failed_update = None
        start = time.monotonic()
        try:
            groups = self._join(params)
        except BaseException as e:
            err = as_wsync_error(e)
            if isinstance(e, GroupTimeout):
                err = DeadlineExceeded("JOIN_TIMEOUT", str(e))
            elif isinstance(e, GroupError):
                err = Unavailable("JOIN_FAILED", str(e))
            elif isinstance(e, ValueError):
                err = InvalidArgument("INVALID_GROUP", str(e))
            with self._lock:
                self.lifecycle.fire(Event.JOIN_FAILED)
                self._record_error(err)
            raise err from e
        with self._lock:
            self._groups = groups
            self._params = params
            self.lifecycle.fire(Event.JOINED)
            return pb.InitResponse(group=self._group_info(), join_seconds=time.monotonic() - start)

    def _init_params(self, r: pb.InitRequest) -> _GroupParams:
        if not r.master_address:
            raise InvalidArgument("MISSING_MASTER_ADDRESS", "master_address is required")
        if not 1 <= r.master_port <= 65535:
            raise InvalidArgument("INVALID_PORT", f"master_port {r.master_port} is not in 1..65535")
        if r.rank_offset < 1:
            raise InvalidArgument("INVALID_RANK_OFFSET", "rank_offset must be at least 1 (rank 0 is the trainer)")
        workers = len(self._devices)
        if r.world_size < r.rank_offset + workers:
            raise InvalidArgument(
                "INVALID_WORLD_SIZE",
                f"world_size {r.world_size} cannot hold ranks {r.rank_offset}..{r.rank_offset + workers - 1} "
                f"of this engine's {workers} worker(s)",
            )
        if r.backend not in _BACKENDS:
            raise InvalidArgument("UNKNOWN_ENUM_VALUE", f"backend value {r.backend} is not defined")
        try:
            backends = {resolve_backend(_BACKENDS[r.backend], d) for d in self._devices}
        except ValueError as e:
            raise InvalidArgument("INVALID_BACKEND", str(e)) from None
        if len(backends) != 1:
            raise InvalidArgument("INVALID_BACKEND", "the workers' devices need different backends")
        return _GroupParams(
            master_address=r.master_address,
            master_port=r.master_port,
            rank_offset=r.rank_offset,
            world_size=r.world_size,
            group_name=r.group_name or DEFAULT_GROUP_NAME,
            backend=backends.pop(),
            timeout_s=seconds(r.timeout, DEFAULT_TIMEOUT_S),
        )

    def _join(self, p: _GroupParams) -> list[WeightSyncGroup]:
        """Join every worker concurrently (each join blocks until the whole group has formed).

        Bounded by the join timeout plus a margin even when a join overruns its own timeout
        (torch's store connect retries can): such a join is left to finish in the background
        and the group it forms, if any, is destroyed.
        """
        ex = concurrent.futures.ThreadPoolExecutor(len(self._devices), thread_name_prefix="wsync-join")
        deadline = time.monotonic() + p.timeout_s + 10
        try:
            futures = [
                ex.submit(
                    join_group,
                    master_address=p.master_address,
                    master_port=p.master_port,
                    rank=p.rank_offset + i,
                    world_size=p.world_size,
                    group_name=p.group_name,
                    backend=p.backend,
                    device=d,
                    timeout_s=p.timeout_s,
                )
                for i, d in enumerate(self._devices)
            ]
            groups: list[WeightSyncGroup] = []
            error: BaseException | None = None
            for f in futures:
                try:
                    groups.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
                except BaseException as e:
                    failure: BaseException = e
                    if not f.done():  # the join overran its own timeout: give up on it
                        failure = GroupTimeout(f"the group did not form within {p.timeout_s:g} s")
                        f.add_done_callback(_destroy_late_group)
                    error = error or failure
            if error is not None:
                for g in groups:
                    g.destroy()
                raise error
            return groups
        finally:
            ex.shutdown(wait=False)

    def _group_info(self) -> pb.GroupInfo:
        p = self._params
        if p is None:
            return pb.GroupInfo()
        info = pb.GroupInfo(
            group_name=p.group_name,
            world_size=p.world_size,
            ranks=[p.rank_offset + i for i in range(len(self._devices))],
            backend=_BACKEND_ENUM[p.backend],
            master_address=p.master_address,
            master_port=p.master_port,
            devices=[str(d) for d in self._devices],
        )
        info.timeout.FromTimedelta(datetime.timedelta(seconds=p.timeout_s))
        return info

    # ------------------------------------------------------------------ Prepare

    @grpc_errors
    def Prepare(
        self, request_iterator: Iterator[pb.PrepareRequest], context: grpc.ServicerContext
    ) -> pb.PrepareResponse:
        """Read, validate and arm one update (see the contract for semantics)."""
        started = time.monotonic()
        cancel = threading.Event()
        with self._lock:
            self.lifecycle.begin(Rpc.PREPARE, Event.PREPARE)
            self._preparing_cancel = cancel
            self._preparing_id = None
        try:
            header, buckets = self._read_prepare(request_iterator, cancel, context)
            with self._lock:
                if cancel.is_set():
                    raise Aborted("UPDATE_CANCELLED", "the update was cancelled while it was being prepared")
                upd = _Update(header=header, feed=BucketFeed(), cancel=threading.Event(), started=started)
                upd.feed.extend(buckets)
                if not header.incremental:
                    upd.feed.close()
                upd.tensors = sum(len(b.tensors) for b in buckets)
                upd.bytes = sum(b.size_bytes for b in buckets)
                if header.streaming and _may_step(self.adapter):
                    # Streaming apply changes weights bucket by bucket: freeze requests
                    # between two steps until Complete. A WAIT pause does not stop the
                    # requests it is draining (or failed to drain): freeze them too.
                    upd.auto_paused = not self.adapter.is_paused()
                    self.adapter.pause(PauseMode.KEEP, DEFAULT_PAUSE_TIMEOUT_S)
                self._update = upd
                self._start_receivers(upd)
        except BaseException:
            with self._lock:
                self._preparing_cancel = None
                if self.lifecycle.state == State.PREPARING:
                    self.lifecycle.fire(Event.REJECTED)
            raise
        self._wait_armed(upd)
        with self._lock:
            self._preparing_cancel = None
            if upd.error is not None:
                raise upd.error
            self.lifecycle.fire(Event.ARMED)
            upd.armed_at = time.monotonic()
            # Receivers may have finished already (tiny updates): re-check.
            if upd.receivers and all(r.buckets_done == len(upd.feed) for r in upd.receivers):
                self.lifecycle.fire_if(Event.ALL_RECEIVED)
        log.info(
            "update %s (version %s): %d buckets, %d tensors, %d bytes armed in %.1f ms",
            header.update_id,
            header.weight_version,
            len(buckets),
            upd.tensors,
            upd.bytes,
            (upd.armed_at - started) * 1e3,
        )
        return pb.PrepareResponse(
            update_id=header.update_id,
            bucket_count=len(buckets),
            tensor_count=upd.tensors,
            total_bytes=upd.bytes,
            ready_seconds=upd.armed_at - started,
        )

    def _read_prepare(
        self, stream: Iterator[pb.PrepareRequest], cancel: threading.Event, context: grpc.ServicerContext
    ) -> tuple[UpdateHeader, list[Bucket]]:
        v = UpdateValidator(self.adapter.parameter_specs(), self.adapter.aliases())
        buckets: list[Bucket] = []
        # Reading the stream blocks until the client's next message: a watchdog cancels the RPC
        # (which ends the read) when Cancel is called or the stream stalls.
        last_message = [time.monotonic()]
        read_done = threading.Event()
        stalled = threading.Event()

        def watchdog() -> None:
            while not read_done.wait(0.05):
                if time.monotonic() - last_message[0] > self.prepare_timeout_s:
                    stalled.set()
                if stalled.is_set() or cancel.is_set():
                    context.cancel()  # type: ignore[no-untyped-call]
                    return

        threading.Thread(target=watchdog, name="wsync-prepare-watchdog", daemon=True).start()
        try:
            for msg in stream:
                last_message[0] = time.monotonic()
                if cancel.is_set():
                    raise Aborted("UPDATE_CANCELLED", "the update was cancelled while it was being prepared")
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    self._preparing_id = v.header_message(msg.header).update_id
                elif kind in ("bucket", "buckets"):
                    if v.header is None:
                        raise InvalidArgument("MISSING_HEADER", "a bucket arrived before the header")
                    specs = [msg.bucket] if kind == "bucket" else msg.buckets.buckets
                    if not specs:
                        raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried an empty bucket batch")
                    v.check_more_buckets(len(buckets) + len(specs))
                    buckets.extend(v.bucket_message(spec) for spec in specs)
                else:
                    raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried neither header nor bucket")
        except grpc.RpcError as e:  # the client went away mid-stream, or the watchdog cancelled the call
            if cancel.is_set():
                raise Aborted("UPDATE_CANCELLED", "the update was cancelled while it was being prepared") from None
            if stalled.is_set():
                log.warning("Prepare stream sent nothing for %g s: cancelled", self.prepare_timeout_s)
                raise DeadlineExceeded(
                    "PREPARE_STALLED", f"the Prepare stream sent nothing for {self.prepare_timeout_s:g} s"
                ) from None
            raise Aborted("STREAM_BROKEN", f"the Prepare stream broke before it ended: {e}") from None
        finally:
            read_done.set()
        v.finish_stream()
        assert v.header is not None
        return v.header, buckets

    def _start_receivers(self, upd: _Update) -> None:
        for i, g in enumerate(self._groups):
            r = WorkerReceiver(
                worker=i,
                group=g,
                adapter=self.adapter,
                feed=upd.feed,
                flattened=upd.header.flattened,
                streaming=upd.header.streaming,
                cancel=upd.cancel,
                pool=self._pools[i],
                on_event=self._on_receiver_event,
            )
            upd.receivers.append(r)
        for r in upd.receivers:
            r.start()

    def _wait_armed(self, upd: _Update) -> None:
        deadline = time.monotonic() + self.prepare_timeout_s
        for r in upd.receivers:
            if not r.armed.wait(max(0.0, deadline - time.monotonic())):
                err = DeadlineExceeded(
                    "ARM_TIMEOUT", f"the receivers were not armed within {self.prepare_timeout_s:g} s"
                )
                self._fail(upd, err)
                raise err

    # ------------------------------------------------------------------- Update

    @grpc_errors
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        """Declare further buckets of an incremental update."""
        with self._lock:
            self.lifecycle.check(Rpc.UPDATE)
            upd = self._current(request.update_id)
            if not upd.header.incremental:
                raise FailedPrecondition(
                    "NOT_INCREMENTAL", "the update in flight was not prepared with incremental = true"
                )
            if upd.completing:
                raise FailedPrecondition("COMPLETING", "Complete was already called for this update")
            validate_transport(request.transport)
            if not request.buckets:
                raise InvalidArgument("EMPTY_UPDATE", "UpdateRequest.buckets is empty")
            v = UpdateValidator(self.adapter.parameter_specs(), self.adapter.aliases())
            # Re-validate against what this update already declared.
            v.header = upd.header
            v.buckets_declared = len(upd.feed)
            v.bytes_declared = upd.bytes
            v._seen = {t.canonical: t.name for i in range(len(upd.feed)) for t in _declared(upd.feed, i).tensors}
            new = [v.bucket_message(b) for b in request.buckets]
            upd.feed.extend(new)
            upd.tensors += sum(len(b.tensors) for b in new)
            upd.bytes += sum(b.size_bytes for b in new)
            self.lifecycle.fire(Event.MORE_BUCKETS)
            return pb.UpdateResponse(update_id=upd.header.update_id, bucket_count=len(upd.feed), total_bytes=upd.bytes)

    # ----------------------------------------------------------------- Complete

    @grpc_errors
    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> pb.CompleteResponse:
        """Wait for the receivers, apply, publish the new weight version."""
        with self._lock:
            state = self.lifecycle.check(Rpc.COMPLETE)
            if state == State.FAILED:
                failed = self._failed_update
                if failed is not None and failed.error is not None and request.update_id == failed.header.update_id:
                    raise failed.error
                raise FailedPrecondition("WRONG_STATE", "Complete is not allowed in state FAILED: no such update")
            upd = self._current(request.update_id)
            if upd.completing:
                raise Aborted("COMPLETE_IN_PROGRESS", "Complete is already running for this update")
            upd.completing = True
            upd.feed.close()
            timeout = seconds(request.timeout, self._groups[0].timeout_s if self._groups else DEFAULT_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        for r in upd.receivers:
            if not r.done.wait(max(0.0, deadline - time.monotonic())):
                self._fail(
                    upd,
                    DeadlineExceeded(
                        "RECEIVE_TIMEOUT",
                        f"{r.buckets_done} of {len(upd.feed)} buckets arrived within the Complete timeout "
                        f"of {timeout:g} s",
                    ),
                )
                break
            if r.error is not None:
                self._fail(upd, _receive_error(r.error, r.group.timeout_s))
                break
        with self._lock:
            if upd.error is not None:
                raise upd.error
            self.lifecycle.fire_if(Event.ALL_RECEIVED)
            self.lifecycle.fire(Event.APPLY)
        return self._apply(upd, request.flush_cache)

    def _apply(self, upd: _Update, flush_cache: bool) -> pb.CompleteResponse:
        t0 = time.monotonic()
        try:
            with self.adapter.weights_lock():
                if not upd.header.streaming:
                    for r in upd.receivers:
                        for named in r.staged:
                            r.tensors_applied += self.adapter.load_weights(r.worker, named)
                        r.tensors_applied += r.apply_swaps()
                if flush_cache:
                    self.adapter.flush_cache()
                self.adapter.set_weight_version(upd.header.weight_version)
        except BaseException as e:
            err = as_wsync_error(e)
            with self._lock:
                self._fail(upd, err)
                if not upd.header.streaming:
                    # A staged apply that broke half-way is as dirty as a streaming one.
                    self._mark_dirty(upd)
            raise err from e
        done = time.monotonic()
        with self._lock:
            for r in upd.receivers:
                r.release(reuse=True)
            self._weight_version = upd.header.weight_version
            self._dirty = False
            self._updates_completed += 1
            self._update = None
            self.lifecycle.fire(Event.APPLIED)
            if upd.auto_paused or self._dirty_paused:
                self.adapter.resume()
            self._dirty_paused = False
        last = max((r.last_arrival_at or done) for r in upd.receivers) if upd.receivers else done
        armed = upd.armed_at or upd.started
        r0 = upd.receivers[0] if upd.receivers else None
        resp = pb.CompleteResponse(
            update_id=upd.header.update_id,
            weight_version=upd.header.weight_version,
            bucket_count=r0.buckets_done if r0 else 0,
            tensor_count=r0.tensors_applied if r0 else 0,
            bytes_received=r0.bytes_done if r0 else 0,
            receive_seconds=max(0.0, last - armed),
            apply_seconds=done - t0,
            total_seconds=done - upd.started,
            cache_flushed=flush_cache,
        )
        log.info(
            "update %s applied: version %s, %d tensors, %d bytes, %.3f s total",
            resp.update_id,
            resp.weight_version,
            resp.tensor_count,
            resp.bytes_received,
            resp.total_seconds,
        )
        return resp

    # ------------------------------------------------------------ Pause/Resume

    @grpc_errors
    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext) -> pb.PauseResponse:
        """Stop admission; handle requests in flight per the mode."""
        if request.mode not in _PAUSE_MODES:
            raise InvalidArgument("UNKNOWN_ENUM_VALUE", f"pause mode value {request.mode} is not defined")
        mode = _PAUSE_MODES[request.mode]
        timeout = seconds(request.timeout, DEFAULT_PAUSE_TIMEOUT_S)
        with self._lock:
            already = self.adapter.is_paused()
            if self._update is not None:
                self._update.auto_paused = False  # the operator's pause now holds after the update
            self._dirty_paused = False
        try:
            outcome = self.adapter.pause(mode, timeout)
        except TimeoutError as e:
            raise DeadlineExceeded(
                "DRAIN_TIMEOUT",
                f"requests in flight did not finish within {timeout:g} s; the engine stays paused "
                f"and they keep running (Pause with mode ABORT ends them): {e}",
            ) from None
        current = self.adapter.pause_mode() or mode
        return pb.PauseResponse(
            already_paused=already,
            mode=_PAUSE_ENUM[current],
            aborted_requests=outcome.aborted,
            drained_requests=outcome.drained,
            frozen_requests=outcome.frozen,
        )

    @grpc_errors
    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> pb.ResumeResponse:
        """Admit requests again (refused while weights are dirty, unless forced)."""
        with self._lock:
            upd = self._update
            if upd is not None and upd.header.streaming:
                raise FailedPrecondition(
                    "STREAMING_UPDATE_IN_FLIGHT",
                    f"a streaming update is changing the weights (state {self.state.name}); "
                    "Resume after Complete or Cancel",
                )
            if self._dirty and not request.force:
                raise FailedPrecondition(
                    "ENGINE_DIRTY",
                    "a failed update left the weights half-updated; run a complete update, "
                    "or Resume with force = true to serve them anyway",
                )
            was_paused = self.adapter.is_paused()
            resumed = self.adapter.resume() if was_paused else 0
            self._dirty_paused = False
            if self._dirty:
                log.warning("resumed with dirty weights (forced by the operator)")
        return pb.ResumeResponse(was_paused=was_paused, resumed_requests=resumed)

    # ------------------------------------------------------------------ Status

    @grpc_errors
    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        """Report state, admission, version, group, progress, last error."""
        with self._lock:
            resp = pb.GetStatusResponse(
                state=self.state.value,  # type: ignore[arg-type]
                paused=self.adapter.is_paused(),
                dirty=self._dirty,
                weight_version=self._weight_version,
                updates_completed=self._updates_completed,
            )
            mode = self.adapter.pause_mode()
            if mode is not None:
                resp.pause_mode = _PAUSE_ENUM[mode]
            if self._params is not None:
                resp.group.CopyFrom(self._group_info())
            upd = self._update
            if upd is not None:
                h = upd.header
                resp.update.CopyFrom(
                    pb.UpdateProgress(
                        update_id=h.update_id,
                        weight_version=h.weight_version,
                        layout=h.layout,  # type: ignore[arg-type]
                        apply_mode=h.apply_mode,  # type: ignore[arg-type]
                        buckets_expected=len(upd.feed),
                        buckets_received=min((r.buckets_done for r in upd.receivers), default=0),
                        bytes_expected=upd.bytes,
                        bytes_received=min((r.bytes_done for r in upd.receivers), default=0),
                        elapsed_seconds=time.monotonic() - upd.started,
                        incremental=h.incremental,
                    )
                )
            if self._last_error is not None:
                resp.last_error.CopyFrom(self._last_error)
            resp.engine.CopyFrom(self._engine_info)
            running, waiting = self.adapter.request_counts()
            resp.engine.running_requests = running
            resp.engine.waiting_requests = waiting
            return resp

    # ------------------------------------------------------------ Cancel/Leave

    @grpc_errors
    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        """Abandon the update in flight (idempotent)."""
        reason = request.reason or "cancelled"
        with self._lock:
            state = self.lifecycle.check(Rpc.CANCEL)
            if state == State.PREPARING:
                cancel = self._preparing_cancel
                if cancel is not None:
                    # update_id naming another update (or given before the header told us
                    # this one's) leaves the Prepare alone, as it leaves an armed update alone.
                    if request.update_id and request.update_id != self._preparing_id:
                        return pb.CancelResponse(cancelled=False, state=state.value)  # type: ignore[arg-type]
                    cancel.set()
                    return pb.CancelResponse(
                        cancelled=True,
                        update_id=self._preparing_id or "",
                        state=state.value,  # type: ignore[arg-type]
                    )
            upd = self._update
            if upd is None or (request.update_id and request.update_id != upd.header.update_id):
                return pb.CancelResponse(cancelled=False, state=state.value)  # type: ignore[arg-type]
            self._fail(upd, Aborted("UPDATE_CANCELLED", f"the update was cancelled: {reason}"))
            return pb.CancelResponse(
                cancelled=True,
                update_id=upd.header.update_id,
                state=self.state.value,  # type: ignore[arg-type]
            )

    @grpc_errors
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        """Leave the weight-sync group (idempotent)."""
        with self._lock:
            state = self.lifecycle.check(Rpc.LEAVE)
            if state == State.UNINITIALIZED:
                return pb.LeaveResponse(was_member=False)
            was_member = bool(self._groups)
            self._leave_groups()
            self.lifecycle.fire(Event.LEAVE)
            return pb.LeaveResponse(was_member=was_member)

    # --------------------------------------------------------------- Checksums

    @grpc_errors
    def GetWeightChecksums(
        self, request: pb.GetWeightChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.GetWeightChecksumsResponse:
        """SHA-256 of each served tensor, read between two inference steps."""
        specs = self.adapter.parameter_specs()
        aliases = self.adapter.aliases()
        names = list(request.names) or list(specs)
        for n in names:
            if aliases.get(n, n) not in specs:
                raise InvalidArgument(
                    "UNKNOWN_TENSOR",
                    f"tensor {n[:120]!r} is not a parameter of the served model",
                    tensor=n[:120],
                )
        out = pb.GetWeightChecksumsResponse()
        with self.adapter.weights_lock():
            out.weight_version = self._weight_version
            for n in names:
                t = self.adapter.get_weight(n)
                out.checksums.add(
                    name=n,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=list(t.shape),
                    sha256=tensor_sha256(t),
                )
        return out

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Cancel any update in flight and leave the group (server shutdown)."""
        with self._lock:
            if self._update is not None:
                self._fail(self._update, Aborted("SHUTDOWN", "the engine is shutting down"))
            self._leave_groups()


def _destroy_late_group(f: concurrent.futures.Future[WeightSyncGroup]) -> None:
    """Leave a group whose join finished after Init gave up on it."""
    if not f.cancelled() and f.exception() is None:
        f.result().destroy()


def _may_step(adapter: EngineAdapter) -> bool:
    """Whether requests in flight may still run inference steps: serving, or paused in WAIT mode."""
    return adapter.pause_mode() in (None, PauseMode.WAIT)


def _declared(feed: BucketFeed, i: int) -> Bucket:
    b = feed.get(i, 0)
    assert b is not None
    return b


def _receive_error(e: BaseException, timeout_s: float) -> WsyncError:
    """Map a receiver thread's exception to the error reported for the update."""
    if isinstance(e, WsyncError):
        return e
    if isinstance(e, GroupTimeout):
        return DeadlineExceeded(
            "RECEIVE_TIMEOUT", f"no bucket arrived within the group timeout of {timeout_s:g} s: {e}"
        )
    if isinstance(e, GroupError):
        if str(e) == "cancelled":
            return Aborted("UPDATE_CANCELLED", "the update was cancelled")
        return Unavailable("PEER_LOST", f"the weight-sync group broke while receiving (did the trainer die?): {e}")
    return as_wsync_error(e)
