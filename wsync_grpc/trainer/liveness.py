"""The trainer's hold on each engine for the length of one update (``wsync.v1`` ``Watch`` with ``hold``).

From Prepare's reply to Complete's, the trainer keeps one held ``Watch`` call
open per engine (:class:`Holds`). Each engine fails its update at once when
that call ends early (the trainer died); the trainer, in turn, takes the early
end of an engine's stream (the engine died, or its update failed on its own)
as that engine's failure: it records it and sets the sync's cancel signal, so
that the broadcast stops at its next bounded wait instead of at the group
timeout (``docs/architecture.md``, "Liveness").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import RemoteEngine
from wsync_grpc.trainer.results import EngineFailure


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
        req = pb.WatchRequest(update_id=update_id, hold=True, owner=owner)  # the engine's default interval
        for e in engines:
            stream = e.stub.Watch(req, metadata=metadata)
            self._calls.append(stream)
            threading.Thread(target=self._read, args=(e.target, stream), name="wsync-hold", daemon=True).start()

    @property
    def failures(self) -> dict[str, EngineFailure]:
        """target -> why its stream ended before the update did (the engine died, or its update failed)."""
        with self._lock:
            return dict(self._failures)

    def _read(self, target: str, stream: grpc.Call) -> None:
        last: pb.WatchResponse | None = None
        try:
            for msg in stream:  # type: ignore[attr-defined]
                last = msg
        except Exception as exc:
            if not self._released.is_set():
                self._fail(EngineFailure.from_exception(target, "Watch", exc))
            return
        if self._released.is_set() or (last is not None and last.state == pb.LIFECYCLE_STATE_READY):
            return  # applied (Complete replies with the result)
        error = last.last_error if last is not None else pb.ErrorDetail()
        why = error.message or "the engine ended the update"
        self._fail(EngineFailure(target, "Watch", grpc.StatusCode.ABORTED, error.reason, why))

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
        for call in self._calls:
            call.cancel()  # type: ignore[no-untyped-call]
