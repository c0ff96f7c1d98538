"""The trainer's lease on each engine: one ``KeepAlive`` call per engine for as long as the client lives.

An engine has one owner at a time (``docs/architecture.md``, "Ownership").
The client becomes it at ``Init`` and holds it with one open ``KeepAlive``
call per engine (:class:`Leases`): while the call is open, no other trainer
can take the engine; when the client's process dies, gRPC ends the call and
the engine releases the lease at once. A call that breaks (the engine
restarted, the connection dropped) is reopened after
:data:`RETRY_S`; one that ends with ``NOT_OWNER`` (another trainer owns the
engine, or an operator forced it away) is not: the next ``init``/``sync``
tries again, and fails with that engine's ``NOT_OWNER`` if it still belongs
to someone else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import RemoteEngine
from wsync_grpc.trainer.results import EngineFailure
from wsync_grpc.wire.status import error_reason

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Wait before reopening a KeepAlive call that broke, in seconds."""


class Leases:
    """One ``KeepAlive`` call per engine, each read (and reopened when it breaks) by its own thread.

    Args:
        engines: the engines.
        owner: the client's owner name.
        metadata: the call metadata (token).
    """

    def __init__(
        self, engines: Sequence[RemoteEngine], owner: str, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> None:
        self._engines = engines  # the fleet's live list: members added later get a lease at the next start
        self._owner = owner
        self._metadata = metadata
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._calls: dict[str, grpc.Call] = {}
        self._lost: dict[str, EngineFailure] = {}
        self._forgotten: set[str] = set()

    @property
    def lost(self) -> dict[str, EngineFailure]:
        """target -> why the client does not hold that engine (NOT_OWNER), for engines whose lease ended."""
        with self._lock:
            return dict(self._lost)

    def start(self) -> None:
        """Open a KeepAlive call to every engine that has none running (e.g. after a ``NOT_OWNER``)."""
        with self._lock:
            if self._closed.is_set():
                return
            for e in self._engines:
                t = self._threads.get(e.target)
                self._forgotten.discard(e.target)
                if t is None or not t.is_alive():
                    self._lost.pop(e.target, None)
                    t = threading.Thread(target=self._hold, args=(e,), name="wsync-lease", daemon=True)
                    self._threads[e.target] = t
                    t.start()

    def _hold(self, e: RemoteEngine) -> None:
        req = pb.KeepAliveRequest(owner=self._owner)
        while not self._closed.is_set():
            call = e.stub.KeepAlive(req, metadata=self._metadata)
            with self._lock:
                if e.target in self._forgotten:
                    call.cancel()  # type: ignore[no-untyped-call]
                    return
                self._calls[e.target] = call
            if self._closed.is_set():
                call.cancel()  # type: ignore[no-untyped-call]
            try:
                for _ in call:  # type: ignore[attr-defined]
                    pass
            except grpc.RpcError as exc:
                if self._closed.is_set() or e.target in self._forgotten:
                    return
                if error_reason(exc) == "NOT_OWNER":
                    failure = EngineFailure.from_exception(e.target, "KeepAlive", exc)
                    log.warning("%s: the client does not own the engine any more: %s", e.target, failure.message)
                    with self._lock:
                        self._lost[e.target] = failure
                    return
            self._closed.wait(RETRY_S)

    def forget(self, target: str) -> None:
        """End ``target``'s KeepAlive call (the engine releases the lease at once) and forget it."""
        with self._lock:
            call = self._calls.pop(target, None)
            self._threads.pop(target, None)
            self._lost.pop(target, None)
            self._forgotten.add(target)
        if call is not None:
            call.cancel()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """End every KeepAlive call: each engine releases the lease at once. Idempotent."""
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()  # type: ignore[no-untyped-call]
