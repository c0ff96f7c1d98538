"""The trainer's lease on each engine: one ``KeepAlive`` call per engine for as long as the client lives.

An engine has one owner at a time (``docs/architecture.md``, "Ownership").
The client becomes it at ``Init`` (or at a disk update's ``Prepare``), which
returns its lease credential (``RemoteEngine.lease``), and holds it with one
open ``KeepAlive`` call per engine (:class:`Leases`), opened once that
credential is there: while the call is open, no other trainer
can take the engine; when the client's process dies, gRPC ends the call and
the engine releases the lease at once. A call that breaks (the engine
restarted, the connection dropped) is reopened after
:data:`RETRY_S`; one that ends with ``NOT_OWNER`` (another trainer owns the
engine, or an operator forced it away) is not: the next ``init``/``sync``
tries again, and fails with that engine's ``NOT_OWNER`` if it still belongs
to someone else.

Every call is an asyncio task on the client's
:class:`~wsync_grpc.trainer.streams.StreamLoop` (one thread for the whole
fleet), not a thread per engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import grpc
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.results import EngineFailure
from wsync_grpc.trainer.streams import StreamClosed, next_message
from wsync_grpc.wire.lease import LEASE_HEADER, LeaseHolder
from wsync_grpc.wire.status import error_reason

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Wait before reopening a KeepAlive call that broke, in seconds."""


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _credential_from(lease: LeaseHolder) -> None:
    """Wait until ``lease`` holds a credential (woken as soon as one is taken), at most :data:`RETRY_S`."""
    arrived = asyncio.Event()
    loop = asyncio.get_running_loop()
    remove = lease.listen(lambda: loop.call_soon_threadsafe(arrived.set))
    try:
        if not lease.credential:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), RETRY_S)
    finally:
        remove()


class Leases:
    """One ``KeepAlive`` call per engine of ``fleet``, each read (and reopened when it breaks) by a task.

    The tasks run on ``fleet.streams`` (one thread, whatever the number of engines).
    :meth:`start` reads ``fleet.members`` as it is then (excluded members too), so
    engines added to the fleet between syncs get their call at the next formation;
    :meth:`forget` ends the call of an engine that leaves it. A call whose channel
    the fleet closed (``Fleet.reconnect``) is reopened on the fresh one.

    Args:
        fleet: the client's engines, owner name, call metadata (token) and stream loop.
    """

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._lost: dict[str, EngineFailure] = {}
        # Touched on the loop's thread only:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def lost(self) -> dict[str, EngineFailure]:
        """target -> why the client does not hold that engine (NOT_OWNER), for engines whose lease ended."""
        with self._lock:
            return dict(self._lost)

    def start(self) -> None:
        """Open a KeepAlive call to every engine of the fleet that has none running (e.g. after a ``NOT_OWNER``).

        Returns once every call is started (not answered). Nothing happens once :meth:`close` was called.
        """
        if self._closed.is_set():
            return
        targets = [e.target for e in self._fleet.members]
        with contextlib.suppress(StreamClosed):
            self._fleet.streams.run(self._start(targets))

    async def _start(self, targets: list[str]) -> None:
        streams = self._fleet.streams
        for target in targets:
            task = self._tasks.get(target)
            if task is None or task.done():
                with self._lock:
                    self._lost.pop(target, None)
                self._tasks[target] = streams.spawn(self._hold(target), name=f"wsync-lease {target}")

    async def _hold(self, target: str) -> None:
        req = pb.KeepAliveRequest(owner=self._fleet.owner)
        while not self._closed.is_set():
            lease = self._lease(target)
            if lease is None:  # no longer a member
                return
            credential = lease.credential
            if not credential:  # it comes from Init or a disk Prepare: a KeepAlive never claims the engine
                await _credential_from(lease)
                continue
            try:
                metadata = (*self._fleet.metadata, (LEASE_HEADER, credential))
                call = self._fleet.streams.stub(target).KeepAlive(req, metadata=metadata)
            except StreamClosed:
                return
            try:
                while await next_message(call) is not None:
                    pass
            except asyncio.CancelledError:
                if _cancelling():  # forget() or close()
                    call.cancel()
                    raise
                continue  # the fleet closed the channel under the call (a reconnection): reopen it at once
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                if error_reason(exc) == "NOT_OWNER":
                    lease.drop(credential)  # an ended lease: it proves nothing any more
                    failure = EngineFailure.from_exception(target, "KeepAlive", exc)
                    log.warning("%s: the client does not own the engine any more: %s", target, failure.message)
                    with self._lock:
                        self._lost[target] = failure
                    return
            await asyncio.sleep(RETRY_S)

    def _lease(self, target: str) -> LeaseHolder | None:
        """The client's lease credential holder on member ``target``; ``None`` once it is no member."""
        try:
            return self._fleet.member(target).lease
        except KeyError:
            return None

    def forget(self, target: str) -> None:
        """End ``target``'s KeepAlive call (the engine releases the lease at once) and forget its state.

        For an engine that left the fleet; a later :meth:`start` opens a new call if it is back. Idempotent.
        """
        with self._lock:
            self._lost.pop(target, None)

        async def forget() -> None:
            task = self._tasks.pop(target, None)
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])

        with contextlib.suppress(StreamClosed):
            self._fleet.streams.run(forget())

    def close(self) -> None:
        """End every KeepAlive call: each engine releases the lease at once. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()

        async def close() -> None:
            tasks = [t for t in self._tasks.values() if not t.done()]
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

        with contextlib.suppress(StreamClosed):
            self._fleet.streams.run(close())
