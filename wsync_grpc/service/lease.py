"""``KeepAlive``: the owner's hold on its lease, as a server stream (``docs/architecture.md``, "Ownership").

A KeepAlive call presents the owner's lease credential (the ``wsync-lease`` header,
:mod:`wsync_grpc.wire.lease`), or none to claim an engine that has no live owner (its first message
then carries the new credential). While one of the owner's KeepAlive calls is open the lease cannot expire;
gRPC ends the call as soon as the owner's process dies or its connection
drops, and the end of the owner's last call releases the lease at once
(:meth:`~wsync_grpc.core.ownership.Ownership.keepalive_closed`). When the
ownership passes to someone else (an operator's force) the stream ends with
FAILED_PRECONDITION / NOT_OWNER.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.errors import FailedPrecondition, clip
from wsync_grpc.core.ownership import Lease, describe
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.service.status import owner_info
from wsync_grpc.service.watch import owner_gone
from wsync_grpc.wire.convert import state_to_proto
from wsync_grpc.wire.lease import presented
from wsync_grpc.wire.status import to_status

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_INTERVAL_S = 1.0
"""Time between two ``KeepAliveResponse`` messages when the request gives none, in seconds."""

POLL_S = 0.05
"""How often a KeepAlive stream checks whether its owner lost the engine, in seconds."""


def credential_of(context: grpc.ServicerContext) -> str:
    """The lease credential the call presents (its ``wsync-lease`` header; ``""``: none)."""
    return presented(context.invocation_metadata())


def open_keepalive(
    engine: EngineState[UpdateSession], owner: str, credential: str, context: grpc.ServicerContext
) -> Lease:
    """Hold the lease the caller presents (``credential``), or claim the engine for ``owner`` when it presents
    none and the engine has no live owner; count this call, whose end releases the lease. Lock not held.

    Returns:
        The caller's lease (the stream's first message carries its credential).

    Raises:
        FailedPrecondition: NOT_OWNER, another owner is alive, or ``credential`` is a lease credential that is
            not the current one (a KeepAlive never turns an ended lease into a new one).
    """
    with engine.lock:
        engine.ownership.check_holder(credential, what="KeepAlive")
        lease = engine.claim(owner, credential, "KeepAlive")
        generation = engine.ownership.keepalive_opened()

    def on_call_end() -> None:
        with engine.lock:
            last = engine.ownership.keepalive_closed(generation)
            released = engine.ownership.generation == generation and engine.owner_view() is None
            update = engine.update
        if released:
            log.info("the owner %s closed its last KeepAlive call: its lease is released", clip(owner))
        if last and update is not None:  # the owner's update, held by no Watch yet: the trainer may have died
            owner_gone(update)

    if not context.add_callback(on_call_end):
        on_call_end()
    return lease


def keepalive_stream(
    engine: EngineState[UpdateSession], owner: str, lease: Lease, interval_s: float, context: grpc.ServicerContext
) -> Iterator[pb.KeepAliveResponse]:
    """One message at once (with the lease's credential) and one every ``interval_s`` seconds while the
    caller (``owner``) holds the engine.

    Ends with FAILED_PRECONDITION / NOT_OWNER once the ownership passed to
    someone else; stops without a last message when the caller has gone.
    """
    generation = lease.generation
    credential = lease.credential
    while context.is_active():
        with engine.lock:
            own = engine.ownership
            lost = own.generation != generation
            if not lost:
                msg = pb.KeepAliveResponse(
                    state=state_to_proto(engine.lifecycle.state), weight_version=engine.weight_version
                )
                view = engine.owner_view()
                if view is not None:
                    msg.owner.CopyFrom(owner_info(view))
                msg.lease_credential, credential = credential, ""  # the first message only
        if lost:
            err = FailedPrecondition(
                "NOT_OWNER",
                f"the engine no longer belongs to {describe(owner)} (an operator took it over, or it was left)",
                owner=clip(own.owner or "", 200),
            )
            context.abort_with_status(to_status(err))
            return
        yield msg
        until = time.monotonic() + interval_s
        while time.monotonic() < until and context.is_active():
            with engine.lock:
                if engine.ownership.generation != generation:
                    break
            time.sleep(POLL_S)
