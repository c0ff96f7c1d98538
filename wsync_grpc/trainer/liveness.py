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
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import RemoteEngine
from wsync_grpc.trainer.results import EngineFailure

REATTACH_S = 2.0
"""How long a re-opened held Watch may take to send its first message, in seconds."""

MAX_REATTACHES = 3
"""Re-attachments allowed per engine and update: connections that keep dropping are a failure."""


class Holds:
    """The held ``Watch`` calls of one update, one per engine, each read by its own thread.

    Args:
        engines: the engines the update was prepared on.
        update_id: the update's id.
        metadata: the call metadata (token).
        owner: the client's owner name (only the engine's owner may hold a Watch).
        cancel: set when an engine's stream ends before :meth:`stop` (the sync's cancel signal).
    """

    def __init__(
        self,
        engines: Sequence[RemoteEngine],
        update_id: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        owner: str,
        cancel: threading.Event,
    ) -> None:
        self._cancel = cancel
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._failures: dict[str, EngineFailure] = {}
        self._calls: list[grpc.Call] = []
        self._request = pb.WatchRequest(update_id=update_id, hold=True, owner=owner)  # the engine's default interval
        self._metadata = metadata
        for e in engines:
            stream = e.stub.Watch(self._request, metadata=metadata)
            self._calls.append(stream)
            threading.Thread(target=self._read, args=(e, stream), name="wsync-hold", daemon=True).start()

    @property
    def failures(self) -> dict[str, EngineFailure]:
        """target -> why its stream ended before the update did (the engine died, or its update failed)."""
        with self._lock:
            return dict(self._failures)

    def _read(self, engine: RemoteEngine, stream: grpc.Call) -> None:
        target = engine.target
        last: pb.WatchResponse | None = None
        messages: Iterator[pb.WatchResponse] = stream  # type: ignore[assignment]
        reattached = 0
        while True:
            try:
                for msg in messages:
                    last = msg
                break
            except Exception as exc:
                if self._released.is_set():
                    return
                again = self._reattach(engine, exc) if reattached < MAX_REATTACHES else None
                if again is None:
                    self._fail(EngineFailure.from_exception(target, "Watch", exc))
                    return
                reattached += 1
                messages = again
        if self._released.is_set() or (last is not None and last.state == pb.LIFECYCLE_STATE_READY):
            return  # applied (Complete replies with the result)
        error = last.last_error if last is not None else pb.ErrorDetail()
        why = error.message or "the engine ended the update"
        self._fail(EngineFailure(target, "Watch", grpc.StatusCode.ABORTED, error.reason, why))

    def _reattach(self, engine: RemoteEngine, exc: Exception) -> Iterator[pb.WatchResponse] | None:
        """A new held Watch on the update after ``exc`` broke the last one; ``None`` when it cannot be had.

        Only a dropped connection (UNAVAILABLE) is worth it; the new call must answer within :data:`REATTACH_S`.
        """
        if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            return None
        call = engine.stub.Watch(self._request, metadata=self._metadata)
        with self._lock:
            self._calls.append(call)
        if self._released.is_set():
            call.cancel()  # type: ignore[no-untyped-call]
            return None
        timer = threading.Timer(REATTACH_S, call.cancel)  # type: ignore[attr-defined]
        timer.start()
        try:
            first: pb.WatchResponse = next(call)  # type: ignore[call-overload]
        except (grpc.RpcError, StopIteration):
            return None
        finally:
            timer.cancel()
        return itertools.chain([first], call)  # type: ignore[arg-type]

    def _fail(self, failure: EngineFailure) -> None:
        with self._lock:
            self._failures.setdefault(failure.target, failure)
        self._cancel.set()

    def stop(self) -> dict[str, EngineFailure]:
        """Stop taking the streams' ends as failures (the trainer abandons the update); the failures so far."""
        self._released.set()
        return self.failures

    def close(self) -> None:
        """End every held call (once the update ended everywhere, or was cancelled everywhere). Idempotent."""
        self._released.set()
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()  # type: ignore[no-untyped-call]
