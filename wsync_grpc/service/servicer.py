"""The in-engine ``wsync.v1.WeightSyncService`` servicer: a thin gRPC edge over the update controller.

Each RPC converts its request to domain values (:mod:`wsync_grpc.wire.convert`),
delegates to the engine's :class:`~wsync_grpc.service.controller.UpdateController`
(Init, Leave, Prepare, Update, Complete, Cancel, checksums) or engine-wide state
(:class:`~wsync_grpc.service.engine_state.EngineState`: Pause, Resume, status),
and builds the response. Every duration a request chooses passes through the
operator's :class:`~wsync_grpc.core.timeouts.ServerBounds` here, the one place
where they are capped. Every method is wrapped by
:func:`~wsync_grpc.wire.status.grpc_errors`, the one place where errors become
gRPC statuses; spans join the caller's trace here (:mod:`wsync_grpc.service.tracing`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence

import grpc
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.engine import Engine, PauseMode
from wsync_grpc.core.errors import InvalidArgument
from wsync_grpc.core.lifecycle import Lifecycle, Rpc, State
from wsync_grpc.core.ownership import DEFAULT_LEASE_TTL_S
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S, DEFAULT_PREPARE_TIMEOUT_S, ServerBounds
from wsync_grpc.service.adapters import list_adapters, unload_adapter
from wsync_grpc.service.controller import CancelOutcome, UpdateController
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.lease import DEFAULT_KEEPALIVE_INTERVAL_S, credential_of, keepalive_stream, open_keepalive
from wsync_grpc.service.prepare import BucketsMessage, HeaderMessage, PrepareMessage, StreamBroken
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.service.status import owner_info, status_response
from wsync_grpc.service.tracing import server_span
from wsync_grpc.service.watch import DEFAULT_WATCH_INTERVAL_S, hold, watch_stream
from wsync_grpc.wire.convert import (
    PAUSE_MODES,
    declared_digests,
    digest_from_proto,
    from_proto,
    header_from_proto,
    seconds,
    state_to_proto,
    transport_from_proto,
)
from wsync_grpc.wire.status import grpc_errors

log = logging.getLogger(__name__)


class WeightSyncServicer(weight_sync_pb2_grpc.WeightSyncServiceServicer):
    """Serves ``wsync.v1.WeightSyncService`` for one engine.

    Args:
        engine: the engine.
        prepare_timeout_s, keep_buffers, checkpoint_roots, bounds, allowed_masters: see
            :class:`~wsync_grpc.service.controller.UpdateController` (a Prepare stream that stalls
            longer than ``prepare_timeout_s`` is cancelled: the client sees CANCELLED). ``bounds`` also
            caps Init's group timeout and lease ttl, Complete's and Pause's timeouts, and the Watch and
            KeepAlive intervals (``None``: the defaults).

    Attributes:
        controller: the protocol-agnostic side every RPC delegates to.

    Raises:
        ValueError: a checkpoint root that is not a directory; an allowed master network that is not one.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        prepare_timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S,
        keep_buffers: bool | None = None,
        checkpoint_roots: Sequence[str] = (),
        bounds: ServerBounds | None = None,
        allowed_masters: Sequence[str] = (),
    ) -> None:
        self.controller = UpdateController(
            engine,
            prepare_timeout_s=prepare_timeout_s,
            keep_buffers=keep_buffers,
            checkpoint_roots=checkpoint_roots,
            bounds=bounds,
            allowed_masters=allowed_masters,
        )

    @property
    def engine(self) -> EngineState[UpdateSession]:
        """The engine-wide state (lifecycle, membership, ownership, metrics)."""
        return self.controller.state

    @property
    def prepare_timeout_s(self) -> float:
        """See the constructor; assigning it applies from the next Prepare."""
        return self.controller.prepare_timeout_s

    @prepare_timeout_s.setter
    def prepare_timeout_s(self, value: float) -> None:
        self.controller.prepare_timeout_s = value

    @property
    def bounds(self) -> ServerBounds:
        """The operator's caps on the durations callers choose; assigning it applies from the next call."""
        return self.controller.bounds

    @bounds.setter
    def bounds(self, value: ServerBounds) -> None:
        self.controller.bounds = value

    @property
    def lifecycle(self) -> Lifecycle:
        """The lifecycle state machine."""
        return self.controller.state.lifecycle

    @property
    def state(self) -> State:
        """The lifecycle state."""
        return self.controller.state.lifecycle.state

    @property
    def weight_version(self) -> str:
        """The weight version being served."""
        return self.controller.state.weight_version

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of receive buffers the workers keep for the next update (``keep_buffers``), in bytes.

        Tensors received in place (streaming apply on an engine that offers
        :class:`~wsync_grpc.core.engine.InPlaceReceive`) take none.
        """
        return self.controller.state.receive_buffer_bytes

    # --------------------------------------------------------------- Init/Leave

    @grpc_errors
    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        """Join the weight-sync group (see the contract for semantics); the group timeout and ttl capped."""
        st = self.controller.state
        params = st.membership.params_of(request)
        params = dataclasses.replace(params, timeout_s=self.bounds.timeout(params.timeout_s))
        ttl_s = self.bounds.lease_ttl(seconds(request.lease_ttl, DEFAULT_LEASE_TTL_S))
        outcome = self.controller.init(params, request.owner, credential_of(context), ttl_s, request.force)
        with st.lock:
            view = st.owner_view()
            return pb.InitResponse(
                already_joined=outcome.already_joined,
                group=st.membership.info(),
                join_seconds=outcome.join_seconds,
                owner=owner_info(view) if view is not None else pb.OwnerInfo(),
                lease_credential=outcome.lease.credential,
            )

    @grpc_errors
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        """Leave the weight-sync group (idempotent)."""
        return pb.LeaveResponse(was_member=self.controller.leave(credential_of(context), request.force))

    # ------------------------------------------------------ Prepare/Update/Complete

    @grpc_errors
    def Prepare(
        self, request_iterator: Iterator[pb.PrepareRequest], context: grpc.ServicerContext
    ) -> pb.PrepareResponse:
        """Read, validate and arm one update (see the contract for semantics)."""
        with server_span("wsync.engine.prepare", context) as trace_context:
            result = self.controller.prepare(
                prepare_messages(request_iterator),
                lambda: context.cancel(),  # type: ignore[no-untyped-call]
                trace_context,
                credential_of(context),
            )
        return pb.PrepareResponse(**dataclasses.asdict(result))

    @grpc_errors
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        """Declare further buckets of an incremental update, and digests of buckets already declared."""
        outcome = self.controller.update(
            credential_of(context),
            request.update_id,
            transport_from_proto(request.transport) if request.transport else None,
            request.buckets,
            spec_digests(request.buckets),
            declared_digests(request.digests),
        )
        return pb.UpdateResponse(**dataclasses.asdict(outcome))

    @grpc_errors
    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> pb.CompleteResponse:
        """Wait for the receivers, then apply and publish the new weight version (or only verify, phase one)."""
        upd, timeout = self.controller.begin_complete(
            credential_of(context),
            request.update_id,
            lambda default_s: self.bounds.timeout(seconds(request.timeout, default_s)),  # refused before any change
            request.verify_only,
        )
        phase = "verify" if request.verify_only else "apply"
        with server_span(f"wsync.engine.{phase}", context, update_id=upd.header.update_id):
            result = self.controller.finish_complete(upd, timeout, request.verify_only, request.flush_cache)
        if request.verify_only or not upd.verified:  # every bucket arrived in this call: trace the receive
            upd.trace_receive()
        return pb.CompleteResponse(**dataclasses.asdict(result))

    @grpc_errors
    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        """Abandon the update in flight (idempotent)."""
        outcome = self.controller.cancel(
            credential_of(context), request.update_id, request.reason or "cancelled", request.force
        )
        return cancel_response(outcome)

    # ------------------------------------------------------------- Pause/Resume

    @grpc_errors
    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext) -> pb.PauseResponse:
        """Stop admission; handle requests in flight per the mode."""
        mode = from_proto(PAUSE_MODES, request.mode, PauseMode.ABORT, "pause mode")
        timeout = self.bounds.timeout(seconds(request.timeout, DEFAULT_PAUSE_TIMEOUT_S))
        already, outcome, current = self.controller.state.pause(mode, timeout)
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
        was_paused, resumed = self.controller.state.resume(request.force)
        return pb.ResumeResponse(was_paused=was_paused, resumed_requests=resumed)

    # ------------------------------------------------------------ Status/checks

    @grpc_errors
    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        """Report state, admission, version, group, progress, last error."""
        return status_response(self.controller.state.snapshot())

    @grpc_errors
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchResponse]:
        """Stream the progress of the update in flight until it ends; with ``hold``, its end fails the update. The
        update that failed the engine (FAILED) answers one last message saying why, as an open call would have
        seen: a held Watch opened just after Prepare's reply may come after the update failed on its own."""
        st = self.controller.state
        interval_s = self.bounds.interval(seconds(request.interval, DEFAULT_WATCH_INTERVAL_S))
        with st.lock:
            failed = st.update_that_failed(request.update_id)  # ended: its stream is one message, the last
            if failed is None:
                st.lifecycle.check(Rpc.WATCH)
            session = failed if failed is not None else st.current(request.update_id)
            if request.hold:
                st.check_owner(credential_of(context), "Watch with hold")
                if failed is None:
                    hold(session, context)
        return watch_stream(st, session, interval_s, context)

    @grpc_errors
    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> Iterator[pb.KeepAliveResponse]:
        """Hold the owner's lease while the call is open; its end releases it."""
        interval_s = self.bounds.interval(seconds(request.interval, DEFAULT_KEEPALIVE_INTERVAL_S))
        lease = open_keepalive(self.controller.state, request.owner, credential_of(context), context)
        return keepalive_stream(self.controller.state, request.owner, lease, interval_s, context)

    @grpc_errors
    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        """The LoRA adapters served, with their versions."""
        return list_adapters(self.controller.engine)

    @grpc_errors
    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        """Stop serving a LoRA adapter (idempotent); the owner's call."""
        return unload_adapter(self.controller.state, request, credential_of(context))

    @grpc_errors
    def GetWeightChecksums(
        self, request: pb.GetWeightChecksumsRequest, context: grpc.ServicerContext
    ) -> pb.GetWeightChecksumsResponse:
        """SHA-256 of each served tensor, read between two inference steps."""
        version, checksums = self.controller.checksums(request.names)
        out = pb.GetWeightChecksumsResponse(weight_version=version)
        for name, dtype, shape, sha in checksums:
            out.checksums.add(name=name, dtype=str(dtype).removeprefix("torch."), shape=list(shape), sha256=sha)
        return out

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Cancel any update in flight and leave the group (server shutdown)."""
        self.controller.shutdown()


def prepare_messages(requests: Iterator[pb.PrepareRequest]) -> Iterator[PrepareMessage]:
    """A Prepare call's ``wsync.v1.PrepareRequest`` stream as the controller reads it.

    The header is converted when the reader asks (after its owner check); bucket
    specs pass as they are (the validator reads their fields without a copy), their digests
    converted beside them.

    Raises:
        InvalidArgument: EMPTY_MESSAGE, a message with neither header nor bucket.
        StreamBroken: the call broke (the client went away, or the stream was stopped).
    """
    try:
        for msg in requests:
            kind = msg.WhichOneof("kind")
            if kind == "header":
                yield HeaderMessage(msg.header.owner, functools.partial(header_from_proto, msg.header))
            elif kind == "bucket":
                yield BucketsMessage([msg.bucket], spec_digests([msg.bucket]))
            elif kind == "buckets":
                yield BucketsMessage(msg.buckets.buckets, spec_digests(msg.buckets.buckets))
            else:
                raise InvalidArgument("EMPTY_MESSAGE", "a PrepareRequest carried neither header nor bucket")
    except grpc.RpcError as e:
        raise StreamBroken(str(e)) from None


def spec_digests(specs: Sequence[pb.BucketSpec]) -> list[Digest | None]:
    """Each spec's digest (``None``: none); ``[]`` when no spec carries one.

    Raises:
        InvalidArgument: see :func:`~wsync_grpc.wire.convert.digest_from_proto`.
    """
    if not any(s.HasField("digest") for s in specs):
        return []
    return [digest_from_proto(s.digest, s.index) if s.HasField("digest") else None for s in specs]


def cancel_response(outcome: CancelOutcome) -> pb.CancelResponse:
    """A :class:`~wsync_grpc.service.controller.CancelOutcome` as ``wsync.v1.CancelResponse``."""
    return pb.CancelResponse(
        cancelled=outcome.cancelled, update_id=outcome.update_id, state=state_to_proto(outcome.state)
    )
