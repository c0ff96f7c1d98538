"""``Watch``: the stream of an update's progress, and the trainer's proof of life for it.

gloo does not reliably fail a receive posted on a peer that died: an engine
whose trainer was killed could wait for the whole group timeout. So a trainer
holds one ``Watch`` call open per engine for the length of each update
(``WatchRequest.hold``). gRPC ends that call as soon as the trainer's
connection drops, and the engine then fails the update at once with
UNAVAILABLE / PEER_LOST (staged: the old weights stay; streaming: dirty and
paused, as for any broken streaming update). The trainer treats the early end
of the same stream as the engine's death (``docs/architecture.md``, "Liveness").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.errors import Unavailable, clip
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.service.status import error_detail, progress_message
from wsync_grpc.wire.convert import state_to_proto

log = logging.getLogger(__name__)

DEFAULT_WATCH_INTERVAL_S = 0.5
"""Time between two ``WatchResponse`` messages when the request gives none, in seconds."""


def hold(session: UpdateSession, context: grpc.ServicerContext) -> None:
    """Make the end of the call ``context`` fail ``session`` unless it ended first or Complete was called.

    The callback runs on a gRPC thread when the call ends for any reason: the
    trainer's process died or its connection dropped, it cancelled the call,
    or the stream ended because the update did (then it does nothing).
    """

    def on_call_end() -> None:
        if session.ended.is_set() or session.completing:
            return
        log.warning("update %s: the trainer's Watch call ended before the update did", clip(session.header.update_id))
        session.fail(
            Unavailable(
                "PEER_LOST",
                "the trainer's Watch call ended before the update did (did the trainer die?); the update is abandoned",
            )
        )

    if not context.add_callback(on_call_end):  # the call has already ended
        on_call_end()


def watch_stream(
    engine: EngineState, session: UpdateSession, interval_s: float, context: grpc.ServicerContext
) -> Iterator[pb.WatchResponse]:
    """One message at once, one every ``interval_s`` seconds, a last one (``ended``) once ``session`` ended.

    Stops early, without a last message, when the caller has gone.
    """
    while True:
        ended = session.ended.is_set()
        with engine.lock:
            msg = pb.WatchResponse(state=state_to_proto(engine.lifecycle.state), ended=ended)
            if not ended:
                msg.update.CopyFrom(progress_message(session.progress()))
            if engine.last_error is not None:
                msg.last_error.CopyFrom(error_detail(engine.last_error))
        yield msg
        if ended or not context.is_active():
            return
        session.ended.wait(interval_s)
