"""The in-engine ``wsync.v1.WeightSyncService`` servicer: a thin gRPC edge over the update session.

Each RPC checks the lifecycle (:mod:`wsync_grpc.core.lifecycle`), converts
the request to domain values (:mod:`wsync_grpc.wire.convert`), delegates to
the engine's group membership (:mod:`wsync_grpc.service.membership`), the
update in flight (:mod:`wsync_grpc.service.session`) or the engine-wide
state (:mod:`wsync_grpc.service.engine_state`), and builds the response.
Every method is wrapped by :func:`~wsync_grpc.wire.status.grpc_errors`, the
one place where errors become gRPC statuses; every wait is bounded. The
engine is reached only through :class:`~wsync_grpc.core.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Sequence

import grpc
from opentelemetry.context import Context
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.engine import (
    Engine,
    FusedGroups,
    PauseMode,
    ServedChecksums,
)
from wsync_grpc.core.errors import Aborted, AlreadyExists, InvalidArgument, Phase, domain_error
from wsync_grpc.core.lifecycle import Event, Lifecycle, Rpc, State, WrongState
from wsync_grpc.core.lora import LoraAdapters, adapter_param_specs
from wsync_grpc.core.ownership import DEFAULT_LEASE_TTL_S, describe
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S, DEFAULT_PREPARE_TIMEOUT_S
from wsync_grpc.core.validation import UpdateValidator
from wsync_grpc.service.adapters import list_adapters, unload_adapter
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.lease import DEFAULT_KEEPALIVE_INTERVAL_S, keepalive_stream, open_keepalive
from wsync_grpc.service.outcome import trace_receive
from wsync_grpc.service.prepare import PrepareReader, cancelled_while_preparing
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.service.status import owner_info, status_response
from wsync_grpc.service.tracing import server_span
from wsync_grpc.service.watch import DEFAULT_WATCH_INTERVAL_S, hold, watch_stream
from wsync_grpc.transports import transport_for
from wsync_grpc.transports.disk.checkpoint import CheckpointRoots
from wsync_grpc.wire.convert import PAUSE_MODES, from_proto, seconds, state_to_proto, transport_from_proto
from wsync_grpc.wire.status import grpc_errors

log = logging.getLogger(__name__)


class WeightSyncServicer(weight_sync_pb2_grpc.WeightSyncServiceServicer):
    """Serves ``wsync.v1.WeightSyncService`` for one engine.

    Args:
        adapter: the engine.
        prepare_timeout_s: bound on arming the receivers at Prepare, and on the
            silence between two messages of a Prepare stream, in seconds: a
            stream that stalls longer is cancelled (the client sees
            CANCELLED), so a stuck trainer cannot hold the engine in PREPARING.
            Read at each Prepare.
        keep_buffers: keep receive buffers between updates (see
            :class:`~wsync_grpc.worker.buffers.BufferPool`). ``None`` (default): keep
            them on CPU workers, where fresh memory costs page faults on every
            update; not on CUDA workers, where torch's caching allocator
            already reuses freed blocks and the KV cache wants the memory.
        checkpoint_roots: directories disk updates may read checkpoints from
            (``wsync serve --checkpoint-root``); empty (default): disk updates
            are refused with PERMISSION_DENIED. Engines whose workers are other
            processes (:class:`~wsync_grpc.core.engine.RemoteWorkers`) read
            them there.

    Raises:
        ValueError: a checkpoint root that is not a directory.
    """

    def __init__(
        self,
        adapter: Engine,
        *,
        prepare_timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S,
        keep_buffers: bool | None = None,
        checkpoint_roots: Sequence[str] = (),
    ) -> None:
        self.adapter = adapter
        self.checkpoint_roots = CheckpointRoots(checkpoint_roots)
        self.prepare_timeout_s = prepare_timeout_s
        self.engine = EngineState(adapter, keep_buffers)
        self._lock = self.engine.lock
        self._preparing: PrepareReader | None = None  # the Prepare stream being read, in PREPARING

    @property
    def lifecycle(self) -> Lifecycle:
        """The lifecycle state machine."""
        return self.engine.lifecycle

    @property
    def state(self) -> State:
        """The lifecycle state."""
        return self.engine.lifecycle.state

    @property
    def weight_version(self) -> str:
        """The weight version being served."""
        return self.engine.weight_version

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of receive buffers the workers keep for the next update (``keep_buffers``), in bytes.

        Tensors received in place (streaming apply on an engine that offers
        :class:`~wsync_grpc.core.engine.InPlaceReceive`) take none.
        """
        return self.engine.receive_buffer_bytes

    # --------------------------------------------------------------- Init/Leave

    @grpc_errors
    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        """Join the weight-sync group (see the contract for semantics)."""
        m = self.engine.membership
        params = m.params_of(request)
        ttl_s = seconds(request.lease_ttl, DEFAULT_LEASE_TTL_S)
        with self._lock:
            previous = self.engine.ownership.owner
            changed = self.engine.claim(request.owner, "Init", ttl_s, request.force)
            if changed and request.force and previous is not None:
                self._cancel_in_flight("", f"the engine was taken over from {describe(previous)} (forced)")
            state = self.lifecycle.check(Rpc.INIT)
            if state == State.READY:
                if params == m.params:
                    return pb.InitResponse(already_joined=True, group=m.info(), owner=self._owner_info())
                if not changed:
                    raise AlreadyExists(
                        "GROUP_MISMATCH",
                        f"already joined group {m.params.group_name if m.params else ''!r} with other "
                        "parameters; call Leave first",
                    )
                m.leave()  # the previous owner is gone: its group goes with it
                self.lifecycle.fire(Event.LEAVE)
            self.lifecycle.fire(Event.JOIN)
            self.engine.failed_update = None
        start = time.monotonic()
        try:
            groups = m.join(params)
        except BaseException as e:
            err = domain_error(e, Phase.JOIN)
            with self._lock:
                self.lifecycle.fire(Event.JOIN_FAILED)
                self.engine.record_error(err)
            raise err from e
        with self._lock:
            m.joined(params, groups)
            self.lifecycle.fire(Event.JOINED)
            return pb.InitResponse(group=m.info(), join_seconds=time.monotonic() - start, owner=self._owner_info())

    def _owner_info(self) -> pb.OwnerInfo:
        """The live owner's ``wsync.v1.OwnerInfo`` (empty when none). Lock held."""
        view = self.engine.owner_view()
        return owner_info(view) if view is not None else pb.OwnerInfo()

    @grpc_errors
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        """Leave the weight-sync group (idempotent)."""
        with self._lock:
            if request.force:
                self._force_away(request.owner, "Leave")
            else:
                self.engine.check_owner(request.owner, "Leave")
            state = self.lifecycle.check(Rpc.LEAVE)
            if self.engine.ownership.owner == request.owner:
                self.engine.ownership.expire()  # the owner left: its lease lives only while it keeps it alive
            if state == State.UNINITIALIZED:
                return pb.LeaveResponse(was_member=False)
            was_member = self.engine.membership.leave()
            self.lifecycle.fire(Event.LEAVE)
            return pb.LeaveResponse(was_member=was_member)

    def _force_away(self, caller: str, what: str) -> None:
        """An operator's force: the live owner, if another caller, loses the engine. Lock held."""
        lost = self.engine.ownership.force_release(caller, self.engine.update is not None)
        if lost is not None:
            log.warning("%s with force: %s loses the engine", what, describe(lost))

    # ------------------------------------------------------ Prepare/Update/Complete

    @grpc_errors
    def Prepare(
        self, request_iterator: Iterator[pb.PrepareRequest], context: grpc.ServicerContext
    ) -> pb.PrepareResponse:
        """Read, validate and arm one update (see the contract for semantics)."""
        with server_span("wsync.engine.prepare", context) as trace_context:
            return self._prepare(request_iterator, context, trace_context)

    def _prepare(
        self, request_iterator: Iterator[pb.PrepareRequest], context: grpc.ServicerContext, trace_context: Context
    ) -> pb.PrepareResponse:
        started = time.monotonic()
        with self._lock:
            self.lifecycle.begin(Rpc.PREPARE, Event.PREPARE)
            reader = self._preparing = PrepareReader(self.prepare_timeout_s, self._claim_for_prepare)
        try:
            validator = update_validator(self.adapter)
            header, buckets = reader.read(validator, request_iterator, context)
            transport = transport_for(header.transport)
            if transport.needs_group and self.lifecycle.origin is not State.READY:
                raise WrongState(Rpc.PREPARE, self.lifecycle.origin, "a broadcast needs the group: call Init first")
            planned = transport.plan(header, validator, buckets, self.checkpoint_roots)
            with self._lock:
                if reader.cancel.is_set():
                    raise cancelled_while_preparing()
                session = UpdateSession(self.engine, planned, transport, validator, started)
                session.trace_context = trace_context
                session.start()
        except BaseException:
            with self._lock:
                self._preparing = None
                if self.lifecycle.state == State.PREPARING:
                    self.lifecycle.fire(Event.REJECTED)
            raise
        session.wait_armed(self.prepare_timeout_s)
        with self._lock:
            self._preparing = None
            result = session.armed()
        return pb.PrepareResponse(**dataclasses.asdict(result))

    def _claim_for_prepare(self, owner: str) -> None:
        """The Prepare header named ``owner``: it must own the engine, or the engine must have no live owner."""
        with self._lock:
            self.engine.claim(owner, "Prepare")

    @grpc_errors
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        """Declare further buckets of an incremental update."""
        with self._lock:
            self.engine.check_owner(request.owner, "Update")
            self.lifecycle.check(Rpc.UPDATE)
            upd = self.engine.current(request.update_id)
            upd.check_accepts_buckets()
            transport_for(transport_from_proto(request.transport)).check_update()
            if not request.buckets:
                raise InvalidArgument("EMPTY_UPDATE", "UpdateRequest.buckets is empty")
            upd.declare(request.buckets)
            return pb.UpdateResponse(update_id=upd.header.update_id, bucket_count=len(upd.feed), total_bytes=upd.bytes)

    @grpc_errors
    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> pb.CompleteResponse:
        """Wait for the receivers, then apply and publish the new weight version (or only verify, phase one)."""
        with self._lock:
            self.engine.check_owner(request.owner, "Complete")
            state = self.lifecycle.check(Rpc.COMPLETE)
            if state == State.FAILED:
                raise self.engine.failure_of(request.update_id)
            upd = self.engine.current(request.update_id)
            timeout = seconds(request.timeout, self.engine.membership.group_timeout_s)  # refused before anything
            upd.begin_complete(request.verify_only)
        phase = "verify" if request.verify_only else "apply"
        with server_span(f"wsync.engine.{phase}", context, update_id=upd.header.update_id):
            result = upd.verify(timeout) if request.verify_only else upd.complete(timeout, request.flush_cache)
        if request.verify_only or not upd.verified:  # every bucket arrived in this call: trace the receive
            trace_receive(upd)
        return pb.CompleteResponse(**dataclasses.asdict(result))

    @grpc_errors
    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        """Abandon the update in flight (idempotent)."""
        reason = request.reason or "cancelled"
        with self._lock:
            if not request.force:
                self.engine.check_owner(request.owner, "Cancel")
            state = self.lifecycle.check(Rpc.CANCEL)
            response = self._cancel_in_flight(request.update_id, reason, state)
            if request.force:
                self._force_away(request.owner, "Cancel")
            return response

    def _cancel_in_flight(self, update_id: str, reason: str, state: State | None = None) -> pb.CancelResponse:
        """Abandon the update in flight (``update_id``: only if it names it; ``""``: any). Lock held."""
        state = self.lifecycle.state if state is None else state
        reader = self._preparing
        if state == State.PREPARING and reader is not None:
            # update_id naming another update (or given before the header told us
            # this one's) leaves the Prepare alone, as it leaves an armed update alone.
            if update_id and update_id != reader.update_id:
                return pb.CancelResponse(cancelled=False, state=state_to_proto(state))
            reader.cancel.set()
            if self.engine.update is not None:  # the stream was read and the receivers are being armed
                self.engine.update.fail(Aborted("UPDATE_CANCELLED", f"the update was cancelled: {reason}"))
            current = state_to_proto(self.lifecycle.state)
            return pb.CancelResponse(cancelled=True, update_id=reader.update_id or "", state=current)
        upd = self.engine.update
        if upd is None or (update_id and update_id != upd.header.update_id):
            return pb.CancelResponse(cancelled=False, state=state_to_proto(state))
        upd.fail(Aborted("UPDATE_CANCELLED", f"the update was cancelled: {reason}"))
        return pb.CancelResponse(
            cancelled=True, update_id=upd.header.update_id, state=state_to_proto(self.lifecycle.state)
        )

    # ------------------------------------------------------------- Pause/Resume

    @grpc_errors
    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext) -> pb.PauseResponse:
        """Stop admission; handle requests in flight per the mode."""
        mode = from_proto(PAUSE_MODES, request.mode, PauseMode.ABORT, "pause mode")
        timeout = seconds(request.timeout, DEFAULT_PAUSE_TIMEOUT_S)
        already, outcome, current = self.engine.pause(mode, timeout)
        return pb.PauseResponse(
            already_paused=already,
            mode=PAUSE_MODES[current],
            aborted_requests=outcome.aborted,
            drained_requests=outcome.drained,
            frozen_requests=outcome.frozen,
        )

    @grpc_errors
    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> pb.ResumeResponse:
        """Admit requests again (refused while weights are dirty, unless forced)."""
        was_paused, resumed = self.engine.resume(request.force)
        return pb.ResumeResponse(was_paused=was_paused, resumed_requests=resumed)

    # ------------------------------------------------------------ Status/checks

    @grpc_errors
    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        """Report state, admission, version, group, progress, last error."""
        return status_response(self.engine.snapshot())

    @grpc_errors
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchResponse]:
        """Stream the progress of the update in flight until it ends; with ``hold``, its end fails the update."""
        interval_s = seconds(request.interval, DEFAULT_WATCH_INTERVAL_S)
        with self._lock:
            self.lifecycle.check(Rpc.WATCH)
            session = self.engine.current(request.update_id)
            if request.hold:
                self.engine.check_owner(request.owner, "Watch with hold")
                hold(session, context)
        return watch_stream(self.engine, session, interval_s, context)

    @grpc_errors
    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> Iterator[pb.KeepAliveResponse]:
        """Hold the owner's lease while the call is open; its end releases it."""
        interval_s = seconds(request.interval, DEFAULT_KEEPALIVE_INTERVAL_S)
        generation = open_keepalive(self.engine, request.owner, context)
        return keepalive_stream(self.engine, request.owner, generation, interval_s, context)

    @grpc_errors
    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        """The LoRA adapters served, with their versions."""
        return list_adapters(self.adapter)

    @grpc_errors
    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        """Stop serving a LoRA adapter (idempotent); the owner's call."""
        return unload_adapter(self.engine, request)

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
        if isinstance(self.adapter, ServedChecksums):
            out.weight_version = self.engine.weight_version
            for n, dtype, shape, sha in self.adapter.weight_checksums(names):
                out.checksums.add(name=n, dtype=str(dtype).removeprefix("torch."), shape=list(shape), sha256=sha)
            return out
        with self.adapter.weights_lock():
            out.weight_version = self.engine.weight_version
            for n in names:
                t = self.adapter.get_weight(n)
                out.checksums.add(
                    name=n,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=list(t.shape),
                    sha256=tensor_sha256(t),
                )
        return out

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Cancel any update in flight and leave the group (server shutdown)."""
        with self._lock:
            if self.engine.update is not None:
                self.engine.update.fail(Aborted("SHUTDOWN", "the engine is shutting down"))
            self.engine.membership.leave()


def update_validator(adapter: Engine) -> UpdateValidator:
    """A fresh validator for one update of ``adapter``: its tensors, ties, fused groups and LoRA targets.

    Every registered transport's rules apply (:func:`~wsync_grpc.transports.transport_for`; a disk update
    reads where the engine's roots allow); adapter updates only on an engine that serves adapters
    (:class:`~wsync_grpc.core.lora.LoraAdapters`).
    """
    fused = adapter.fused_groups() if isinstance(adapter, FusedGroups) else ()
    specs = None
    if isinstance(adapter, LoraAdapters) and (lora := adapter.lora_linears()):
        specs = functools.partial(adapter_param_specs, lora, max_rank=adapter.lora_max_rank())
    return UpdateValidator(adapter.parameter_specs(), adapter.aliases(), fused, transport_for, specs)
