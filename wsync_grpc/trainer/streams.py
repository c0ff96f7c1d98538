"""The client's long-lived streams, multiplexed on one event-loop thread whatever the size of the fleet.

The trainer keeps calls open to every engine for long stretches: one
``KeepAlive`` call per engine for as long as it owns it
(:class:`~wsync_grpc.trainer.lease.Leases`), and one held ``Watch`` call per
engine for the length of each update (:class:`~wsync_grpc.trainer.liveness.Holds`).
gRPC's synchronous API reads a stream on a thread of its own (and runs one
more per channel while a call is in flight), so a fleet of N engines would cost
the trainer 2N threads or more. A :class:`StreamLoop` runs them all as asyncio
tasks over ``grpc.aio`` channels (one per engine, with the same options and
credentials as the engine's synchronous channel) on one thread, ``wsync-streams``:
the trainer's threads stay constant in N.

The calls the client fans out to every engine (GetStatus, Init, Prepare,
Complete, Cancel...: :meth:`Fleet.gather <wsync_grpc.trainer.fleet.Fleet.gather>`)
run on the same loop and channels, so a fan-out to N engines costs no thread
per engine either.

Every method but :meth:`StreamLoop.stub` and :meth:`StreamLoop.spawn` is
called from the client's threads, never from the loop's own; those two run on
the loop (inside a coroutine given to :meth:`StreamLoop.run` or :meth:`StreamLoop.submit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar, cast

import grpc
import grpc.aio
from wsync.v1 import weight_sync_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
"""What ``read()`` of a ``grpc.aio`` stream returns once the stream ended with OK."""

CLOSE_TIMEOUT_S = 5.0
"""How long :meth:`StreamLoop.close` waits for the streams and channels to end, in seconds."""

WAIT_SLICE_S = 0.5
"""How often :meth:`StreamLoop.run` checks that the loop still runs while it waits, in seconds."""


async def next_message(call: grpc.aio.UnaryStreamCall[Any, R]) -> R | None:
    """The next message of a server stream; ``None`` once it ended with OK.

    Raises:
        grpc.aio.AioRpcError: the stream ended with another status.
        asyncio.CancelledError: the call (or the task reading it) was cancelled.
    """
    msg = await call.read()
    return None if msg is EOF else cast(R, msg)


class StreamClosed(RuntimeError):
    """The :class:`StreamLoop` was closed: no stream can be started on it any more."""


class StreamLoop:
    """One asyncio event loop on one daemon thread (``wsync-streams``), with one ``grpc.aio`` channel per engine.

    The thread starts with the first :meth:`run` and ends with :meth:`close`.
    Channels are created on the loop when a stream first needs them
    (:meth:`stub`) and closed by :meth:`drop` or :meth:`close`.

    Args:
        options: the gRPC channel options (the same as the synchronous channels': message sizes, keepalive...).
        credentials: TLS channel credentials; ``None`` uses plaintext channels.
    """

    def __init__(self, options: Sequence[tuple[str, Any]], credentials: grpc.ChannelCredentials | None) -> None:
        self._options = list(options)
        self._credentials = credentials
        self.interceptors: Callable[[str], Sequence[Any]] = lambda _target: ()
        """target -> the ``grpc.aio`` client interceptors of its channel (the fleet's: the lease credential)."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Touched on the loop's thread only:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, weight_sync_pb2_grpc.WeightSyncServiceAsyncStub] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise StreamClosed("the client's stream loop is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._serve, args=(loop,), name="wsync-streams", daemon=True)
                self._loop, self._thread = loop, thread
                thread.start()
            return self._loop

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return self._thread is not None and threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's).

        Args:
            coro: the coroutine.
            timeout: how long to wait, in seconds; ``None``: until it ends.

        Returns:
            What ``coro`` returned.

        Raises:
            StreamClosed: the loop was closed (before ``coro`` ran, or while waiting for it).
            RuntimeError: called on the loop's own thread.
            TimeoutError: ``coro`` did not end within ``timeout`` (it is cancelled).
            Exception: whatever ``coro`` raised.
        """
        try:
            loop = self._started()
        except StreamClosed:
            coro.close()
            raise
        if self.on_loop():
            coro.close()
            raise RuntimeError("StreamLoop.run called on the loop's own thread")
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            raise StreamClosed("the client's stream loop is closed") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(left)
            except FutureTimeout:
                if self._thread is not None and not self._thread.is_alive():  # stopped by close() meanwhile
                    future.cancel()
                    raise StreamClosed("the client's stream loop is closed") from None
                if deadline is not None and time.monotonic() >= deadline:
                    future.cancel()
                    raise TimeoutError(f"no result from the stream loop within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the loop and return its future at once (from any thread but the loop's).

        The future's ``cancel()`` cancels the coroutine (and the calls it awaits).

        Raises:
            StreamClosed: the loop was closed.
        """
        try:
            loop = self._started()
            return asyncio.run_coroutine_threadsafe(coro, loop)
        except (StreamClosed, RuntimeError):
            coro.close()
            raise StreamClosed("the client's stream loop is closed") from None

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start ``coro`` as a task on the loop, cancelled by :meth:`close` if still running. Loop thread only.

        An error that ends the task is logged (the task's owner reads its outcome through its own state).

        Raises:
            StreamClosed: the loop is closing.
        """
        if self._closed:
            coro.close()
            raise StreamClosed("the client's stream loop is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", task.get_name(), exc_info=task.exception())

    def stub(self, target: str) -> weight_sync_pb2_grpc.WeightSyncServiceAsyncStub:
        """The ``grpc.aio`` stub of ``target``'s channel, created at its first use. Loop thread only.

        A channel in TRANSIENT_FAILURE (its engine refused or dropped its connections) is replaced by a
        fresh one, which connects at once instead of after the old one's reconnection backoff (seconds
        to minutes): a stream opened after the engine came back is not refused for it.

        Raises:
            StreamClosed: the loop is closing.
        """
        if self._closed:
            raise StreamClosed("the client's stream loop is closed")
        channel = self._channels.get(target)
        if channel is not None and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # It waits out a growing reconnection backoff, failing every call at once meanwhile: an engine
            # that came back (restarted) is reached at once on a fresh channel. Its calls all failed already.
            del self._channels[target], self._stubs[target]
            self.spawn(channel.close(None), name=f"wsync-close {target}")
        stub = self._stubs.get(target)
        if stub is None:
            interceptors = list(self.interceptors(target))
            channel = (
                grpc.aio.secure_channel(target, self._credentials, options=self._options, interceptors=interceptors)
                if self._credentials is not None
                else grpc.aio.insecure_channel(target, options=self._options, interceptors=interceptors)
            )
            stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
            self._channels[target], self._stubs[target] = channel, stub
        return stub

    def drop(self, target: str) -> None:
        """Close ``target``'s channel (ending its calls), if it has one: the engine left the fleet. Idempotent."""

        async def drop() -> None:
            self._stubs.pop(target, None)
            channel = self._channels.pop(target, None)
            if channel is not None:
                await channel.close(None)

        with contextlib.suppress(StreamClosed):
            self.run(drop(), CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Cancel every task, close every channel, stop the loop and join its thread. Idempotent.

        Bounded by :data:`CLOSE_TIMEOUT_S` (twice, at most): a stream that does not end in time is left to the
        daemon thread (logged).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shut() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
            await asyncio.gather(*(c.close(None) for c in channels), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop).result(CLOSE_TIMEOUT_S * 2)
        except Exception:
            log.warning("the stream loop did not close its streams within %.0f s", CLOSE_TIMEOUT_S * 2, exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the stream loop's thread did not end within %.0f s", CLOSE_TIMEOUT_S)
