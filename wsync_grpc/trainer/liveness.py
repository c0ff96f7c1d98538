"""The trainer's hold on each engine for the length of one update (``wsync.v1`` ``Watch`` with ``hold``).

From Prepare's reply to Complete's, the trainer keeps one held ``Watch`` call
open per engine (:class:`Holds`). Each engine fails its update at once when
that call ends early (the trainer died); the trainer, in turn, takes the early
end of an engine's stream (the engine died, or its update failed on its own)
as that engine's failure: it records it and sets the sync's cancel signal, so
that the broadcast stops at its next bounded wait instead of at the group
timeout (``docs/architecture.md``, "Liveness").

A stream that breaks with UNAVAILABLE (its connection dropped) is not taken
for the engine's death at once: the trainer re-attaches, opening a new held
``Watch`` on the same update, and takes the engine for lost only when that does
not answer within :data:`REATTACH_S` (a dead engine refuses the connection at
once; a frozen one never answers; one whose update ended refuses the Watch).
The engine, in turn, keeps a broadcast update alive while the new call comes
or buckets keep arriving.

Every held call is an asyncio task on the client's
:class:`~wsync_grpc.trainer.streams.StreamLoop` (one thread for the whole
fleet), not a thread per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import grpc
import grpc.aio
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import RemoteEngine
from wsync_grpc.trainer.results import EngineFailure
from wsync_grpc.trainer.streams import StreamClosed, StreamLoop, next_message
from wsync_grpc.wire.lease import LEASE_HEADER

REATTACH_S = 2.0
"""How long a re-opened held Watch may take to send its first message, in seconds."""

MAX_REATTACHES = 3
"""Re-attachments allowed per engine and update: connections that keep dropping are a failure."""


class Holds:
    """The held ``Watch`` calls of one update, one per engine, each read by a task on ``streams``.

    The calls are open when the constructor returns; their ends are read on the
    stream loop's one thread, whatever the number of engines.

    Args:
        streams: the client's stream loop (``Fleet.streams``).
        engines: the engines the update was prepared on.
        update_id: the update's id.
        metadata: the call metadata (token).
        owner: the client's owner name (only the engine's owner may hold a Watch).
        cancel: set when an engine's stream ends before :meth:`stop` (the sync's cancel signal).

    Raises:
        StreamClosed: the client was closed.
    """

    def __init__(
        self,
        streams: StreamLoop,
        engines: Sequence[RemoteEngine],
        update_id: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        owner: str,
        cancel: threading.Event,
    ) -> None:
        self._streams = streams
        self._cancel = cancel
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._failures: dict[str, EngineFailure] = {}
        self._request = pb.WatchRequest(update_id=update_id, hold=True, owner=owner)  # the engine's default interval
        self._metadata = metadata
        self._leases = {e.target: e.lease for e in engines}  # a held Watch is the owner's: it shows its credential
        # Touched on the loop's thread only:
        self._calls: list[grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]] = []
        self._tasks: list[asyncio.Task[None]] = []
        streams.run(self._open([e.target for e in engines]))

    @property
    def failures(self) -> dict[str, EngineFailure]:
        """target -> why its stream ended before the update did (the engine died, or its update failed)."""
        with self._lock:
            return dict(self._failures)

    def _watch(self, target: str) -> grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]:
        credential = self._leases[target].credential
        metadata = (*self._metadata, (LEASE_HEADER, credential)) if credential else self._metadata
        call = self._streams.stub(target).Watch(self._request, metadata=metadata)
        self._calls.append(call)
        return call

    async def _open(self, targets: list[str]) -> None:
        for target in targets:
            call = self._watch(target)
            self._tasks.append(self._streams.spawn(self._read(target, call), name=f"wsync-hold {target}"))

    async def _read(self, target: str, call: grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]) -> None:
        last: pb.WatchResponse | None = None
        reattached = 0
        while True:
            try:
                while (msg := await next_message(call)) is not None:
                    last = msg
                break
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._released.is_set() or (task is not None and task.cancelling()):  # close()
                    call.cancel()
                    raise
                # the fleet closed the engine's channel under the call (it was removed or reconnected)
                self._fail(EngineFailure(target, "Watch", grpc.StatusCode.CANCELLED, "", "the channel was closed"))
                return
            except Exception as exc:
                if self._released.is_set():
                    return
                again = await self._reattach(target, exc) if reattached < MAX_REATTACHES else None
                if again is None:
                    self._fail(EngineFailure.from_exception(target, "Watch", exc))
                    return
                reattached += 1
                call, last = again
        if self._released.is_set() or (last is not None and last.state == pb.LIFECYCLE_STATE_READY):
            return  # applied (Complete replies with the result)
        error = last.last_error if last is not None else pb.ErrorDetail()
        why = error.message or "the engine ended the update"
        self._fail(EngineFailure(target, "Watch", grpc.StatusCode.ABORTED, error.reason, why))

    async def _reattach(
        self, target: str, exc: Exception
    ) -> tuple[grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse], pb.WatchResponse] | None:
        """A new held Watch on the update after ``exc`` broke the last one, and its first message;
        ``None`` when it cannot be had.

        Only a dropped connection (UNAVAILABLE) is worth it; the new call must answer within :data:`REATTACH_S`.
        """
        if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        try:
            call = self._watch(target)
        except StreamClosed:
            return None
        if self._released.is_set():
            call.cancel()
            return None
        try:
            reading = next_message(call)
            first = await asyncio.wait_for(reading, REATTACH_S)
        except (grpc.RpcError, TimeoutError):
            call.cancel()
            return None
        if first is None:
            return None
        return call, first

    def _fail(self, failure: EngineFailure) -> None:
        with self._lock:
            self._failures.setdefault(failure.target, failure)
        self._cancel.set()

    def stop(self) -> dict[str, EngineFailure]:
        """Stop taking the streams' ends as failures (the trainer abandons the update); the failures so far."""
        self._released.set()
        return self.failures

    def close(self) -> None:
        """End every held call (once the update ended everywhere, or was cancelled everywhere). Idempotent.

        Returns once every call is cancelled and its task ended.
        """
        self._released.set()

        async def close() -> None:
            for call in self._calls:
                call.cancel()
            tasks = [t for t in self._tasks if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

        with contextlib.suppress(StreamClosed):
            self._streams.run(close())
