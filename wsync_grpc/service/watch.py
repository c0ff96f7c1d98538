"""``Watch``: the stream of an update's progress, and the trainer's proof of life for it.

gloo does not reliably fail a receive posted on a peer that died: an engine
whose trainer was killed could wait for the whole group timeout. So a trainer
holds one ``Watch`` call open per engine for the length of each update
(``WatchRequest.hold``). gRPC ends that call as soon as the trainer's
connection drops, and the engine then fails the update with UNAVAILABLE /
PEER_LOST (staged: the old weights stay; streaming: dirty and paused, as for
any broken streaming update). The trainer treats the early end of the same
stream as the engine's death (``docs/architecture.md``, "Liveness").

Before it declares the trainer lost, the engine consults the update's progress
where it proves the trainer alive: when the trainer sends the bytes itself (a
broadcast), the update lives on while buckets keep arriving or the trainer
holds another ``Watch`` (it re-attaches after a dropped connection), checked
every :data:`REATTACH_S`. A dead trainer sends nothing more: it is declared lost
within one or two such periods. Where the engine reads the bytes itself (disk),
its own progress proves nothing, and the update fails at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.errors import Unavailable, clip
from wsync_grpc.core.timeouts import Deadline
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.service.status import error_detail, progress_message
from wsync_grpc.wire.convert import state_to_proto

log = logging.getLogger(__name__)

DEFAULT_WATCH_INTERVAL_S = 0.5
"""Time between two ``WatchResponse`` messages when the request gives none, in seconds."""

REATTACH_S = 0.5
"""After the end of the trainer's last held Watch, how long the engine waits for a bucket or a new held Watch
before it declares the trainer lost (broadcast updates), in seconds."""

GONE_POLL_S = 0.25
"""How often a Watch stream waiting for its next message checks whether its caller has gone, in seconds."""


def hold(session: UpdateSession, context: grpc.ServicerContext) -> None:
    """Make the end of the call ``context`` fail ``session`` unless it ended first or Complete was called. Lock held.

    The callback runs on a gRPC thread when the call ends for any reason: the
    trainer's process died or its connection dropped, it cancelled the call,
    or the stream ended because the update did (then it does nothing). Another
    held Watch of the update still open, or (broadcast) buckets still arriving,
    keep the update alive (see the module's description).
    """
    session.held_watches += 1

    def on_call_end() -> None:
        with session.state.lock:
            session.held_watches -= 1
            if _still_held(session):
                return
        _unheld(session, "Watch")

    if not context.add_callback(on_call_end):  # the call has already ended
        on_call_end()


def owner_gone(session: UpdateSession) -> None:
    """The owner's last ``KeepAlive`` call ended while ``session`` was the engine's update. Lock not held.

    A trainer opens its held ``Watch`` only once Prepare replied: one killed in between (while an engine reads a
    checkpoint on its own from Prepare on, say) leaves no held call whose end would tell. Its KeepAlive, open
    since its first call, ends with it. So an update that no held ``Watch`` stands for is taken for lost as at
    the end of the last one (:func:`hold`); one that a held ``Watch`` stands for is left to that call's end.
    """
    with session.state.lock:
        if _still_held(session) or session.state.update is not session:
            return
    _unheld(session, "KeepAlive")


def _still_held(session: UpdateSession) -> bool:
    """Whether ``session`` needs no failing now: it ended, Complete was called, or a held Watch is still open.
    Lock held."""
    return session.ended.is_set() or session.completing or session.held_watches > 0


def _unheld(session: UpdateSession, call: str) -> None:
    """No call of the trainer holds ``session`` any more (the last to end: its ``call``, ``"Watch"`` or
    ``"KeepAlive"``): fail it, at once or once it shows no progress."""
    if session.transport.needs_group:  # the trainer sends the bytes: their arrival proves it alive
        threading.Thread(target=_confirm_lost, args=(session, call), name="wsync-hold", daemon=True).start()
    else:
        _peer_lost(session, call)


def _confirm_lost(session: UpdateSession, call: str) -> None:
    """Fail ``session`` once a period of :data:`REATTACH_S` passed with no bucket and no new held Watch."""
    mark = session.progress_mark()
    while not session.ended.wait(REATTACH_S):
        with session.state.lock:
            if _still_held(session):
                return
        current = session.progress_mark()
        if current == mark:
            _peer_lost(session, call)
            return
        mark = current


def _peer_lost(session: UpdateSession, call: str) -> None:
    log.warning("update %s: the trainer's %s call ended before the update did", clip(session.header.update_id), call)
    session.fail(
        Unavailable(
            "PEER_LOST",
            f"the trainer's {call} call ended before the update did (did the trainer die?); the update is abandoned",
        )
    )


def watch_stream(
    engine: EngineState[UpdateSession], session: UpdateSession, interval_s: float, context: grpc.ServicerContext
) -> Iterator[pb.WatchResponse]:
    """One message at once, one every ``interval_s`` seconds, a last one (``ended``) once ``session`` ended.

    Stops early, without a last message, when the caller has gone (within :data:`GONE_POLL_S`, whatever
    the interval: the call's thread and its slot are not held for an absent caller).
    """
    gone = threading.Event()
    if not context.add_callback(gone.set):
        gone.set()
    while True:
        ended = session.ended.is_set()
        with engine.lock:
            msg = pb.WatchResponse(state=state_to_proto(engine.lifecycle.state), ended=ended)
            if not ended:
                msg.update.CopyFrom(progress_message(session.progress()))
            if engine.last_error is not None:
                msg.last_error.CopyFrom(error_detail(engine.last_error))
        yield msg
        if ended or gone.is_set():
            return
        deadline = Deadline(interval_s)
        while not (gone.is_set() or deadline.passed or session.ended.wait(min(GONE_POLL_S, deadline.left()))):
            pass
        if gone.is_set():
            return
