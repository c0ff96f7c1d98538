"""The engines as the trainer reaches them, and one RPC fanned out over all of them.

A :class:`Fleet` owns the engines (:class:`RemoteEngine`, in target order,
which is rank order), the call metadata (the token), and
:attr:`Fleet.streams`: one event-loop thread and one ``grpc.aio`` channel per
engine (:mod:`wsync_grpc.trainer.streams`), on which every call the client
makes runs, so that its threads do not grow with the fleet.
:meth:`Fleet.gather` starts one call per engine concurrently on that loop,
then collects every reply or failure; :meth:`Fleet.fan_out` raises
:class:`~wsync_grpc.trainer.results.EngineCallError` when any engine failed.
The fan-out helpers (status, pause, resume, checksums, leave) and the calls
that the group formation, the update and the failure protocol fan out are
built on them; the long-lived streams (leases, held Watch calls) run on the
same loop. Each engine also keeps a synchronous channel and stub
(:attr:`RemoteEngine.stub`) for the caller's own raw calls
(``TrainerClient.stubs``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.engine import PauseMode
from wsync_grpc.trainer.results import EngineCallError, EngineFailure, failure_lines
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.streams import StreamLoop
from wsync_grpc.wire.convert import PAUSE_MODES, duration
from wsync_grpc.wire.keepalive import Keepalive
from wsync_grpc.wire.lease import LeaseHolder, aio_lease_interceptors, lease_channel
from wsync_grpc.wire.targets import check_clear_token

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest reply the client accepts, in bytes (checksums of 100k tensors exceed gRPC's 4 MiB default)."""

R = TypeVar("R")

STOP_POLL_S = 0.05
"""How often :meth:`Fleet.gather` looks at its ``stop`` event, in seconds."""


@dataclass
class RemoteEngine:
    """One engine: its channel and stub, and its place in the group as of the last init.

    Attributes:
        target: the engine's ``host:port``.
        channel: the client's channel to it.
        stub: the generated stub on that channel.
        workers: the engine's workers (0 before init).
        rank_offset: group rank of its first worker (0 before init).
        fixed_workers: the worker count the caller gave for it (``TrainerClient(workers=...)``);
            ``None`` asks the engine (``GetStatus().engine.workers``).
        taking_part: whether it takes part in the next update (and in the group formed for it); an
            engine the fleet policy excluded does not (:mod:`wsync_grpc.trainer.roster`).
        version: the weight version the client last saw it serve (``None``: not known yet, e.g. an
            engine added since the last update).
        updates_completed: its ``GetStatus().updates_completed`` when last seen (a lower count later
            means the engine restarted).
        excluded: why the fleet policy left it out of the last update; ``None`` when it was not.
        lease: the client's lease credential on it, sent with every call on :attr:`channel` and taken from
            the replies that issue one (:mod:`wsync_grpc.wire.lease`).
    """

    target: str
    channel: grpc.Channel
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    workers: int = 0
    rank_offset: int = 0
    fixed_workers: int | None = None
    taking_part: bool = True
    version: str | None = None
    updates_completed: int = 0
    excluded: EngineFailure | None = None
    lease: LeaseHolder = field(default_factory=LeaseHolder)


class Fleet:
    """Every engine of one client, in target order, and the calls fanned out over them.

    Args:
        targets: the engines' ``host:port``, in rank order.
        settings: the client's settings (``rpc_timeout_s`` is read at every call).
        token: sent as ``authorization: Bearer <token>`` with every call; ``None`` sends none.
        credentials: TLS channel credentials; ``None`` uses plaintext channels.
        channel_options: extra gRPC channel options.
        owner: the client's owner name, sent with every call that needs the engine's ownership
            (``InitRequest.owner``...).
        keepalive: HTTP/2 keepalive of every channel (:mod:`wsync_grpc.wire.keepalive`): an engine that
            freezes or is cut off is dropped after ``keepalive.timeout_s`` without an answer, which ends the
            update's held ``Watch`` on it as its death would; ``None``: a ping every 10 s, 20 s to answer.
    """

    def __init__(
        self,
        targets: Sequence[str],
        settings: ClientSettings,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        channel_options: Sequence[tuple[str, Any]],
        owner: str,
        keepalive: Keepalive | None = None,
    ) -> None:
        self._settings = settings
        self.owner = owner
        """The client's owner name."""
        self.metadata: tuple[tuple[str, str | bytes], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        """The metadata (token) every call carries."""
        options = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            # Subchannels of its own: a fresh channel (reconnect) must not inherit a shared one's backoff.
            ("grpc.use_local_subchannel_pool", 1),
            *(keepalive if keepalive is not None else Keepalive()).channel_options(),
            *channel_options,
        ]
        self._options = options
        self._credentials = credentials
        self.streams = StreamLoop(options, credentials)
        self.streams.interceptors = self._aio_interceptors  # its channels carry each engine's lease too
        """The event loop (one thread) and ``grpc.aio`` channels, same options, of the engines' long-lived streams."""
        self._token_in_clear = bool(token) and credentials is None
        self.members: list[RemoteEngine] = []
        """Every engine of the client, in rank order (those the fleet policy excluded too)."""
        for i, t in enumerate(targets):
            self.add(t, settings.fixed_workers[i] if settings.fixed_workers else None)

    @property
    def engines(self) -> list[RemoteEngine]:
        """The engines taking part in the next update (every member but the excluded ones), in rank order."""
        return [e for e in self.members if e.taking_part]

    def member(self, target: str) -> RemoteEngine:
        """The member at ``target``.

        Raises:
            KeyError: no member has that address.
        """
        for e in self.members:
            if e.target == target:
                return e
        raise KeyError(target)

    def add(self, target: str, workers: int | None = None) -> RemoteEngine:
        """Open a channel to ``target`` and make it the last member (highest ranks); returns it.

        Raises:
            ValueError: ``target`` is a member already, or ``workers`` is below 1, or a token would travel in
                clear to a target that is not a loopback address.
        """
        if self._token_in_clear:
            check_clear_token(target)
        if any(e.target == target for e in self.members):
            raise ValueError(f"{target} is an engine of this client already")
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        lease = LeaseHolder()
        ch = self._channel(target, lease)
        e = RemoteEngine(target, ch, weight_sync_pb2_grpc.WeightSyncServiceStub(ch), fixed_workers=workers, lease=lease)
        self.members.append(e)
        return e

    def replace(self, target: str, new_target: str) -> RemoteEngine:
        """Put a fresh member at ``new_target`` in member ``target``'s place (its rank order); returns it.

        For an engine that serves at another address now (a supervisor restarted it on another port or
        node: :attr:`Roster.resolver <wsync_grpc.trainer.roster.Roster.resolver>`): the member at
        ``new_target`` is taken for a new engine (version and workers unknown, no lease credential;
        ``fixed_workers`` kept), and ``target``'s channels (the streams' too) are closed.

        Raises:
            KeyError: no member has address ``target``.
            ValueError: ``new_target`` is a member already, or a token would travel in clear to it (not a
                loopback address).
        """
        old = self.member(target)
        if self._token_in_clear:
            check_clear_token(new_target)
        if any(e.target == new_target for e in self.members):
            raise ValueError(f"{new_target} is an engine of this client already")
        lease = LeaseHolder()
        ch = self._channel(new_target, lease)
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(ch)
        e = RemoteEngine(new_target, ch, stub, fixed_workers=old.fixed_workers, lease=lease)
        self.members[self.members.index(old)] = e
        old.channel.close()
        self.streams.drop(target)
        return e

    def _aio_interceptors(self, target: str) -> list[Any]:
        """The interceptors of ``target``'s ``grpc.aio`` channel: its member's lease credential."""
        try:
            return aio_lease_interceptors(self.member(target).lease)
        except KeyError:
            return []

    def _channel(self, target: str, lease: LeaseHolder) -> grpc.Channel:
        if self._credentials is not None:
            ch = grpc.secure_channel(target, self._credentials, options=self._options)
        else:
            ch = grpc.insecure_channel(target, options=self._options)
        return lease_channel(ch, lease)[0]

    def reconnect(self, e: RemoteEngine) -> None:
        """Give ``e`` a fresh channel (and stub), closing the old one (its ``grpc.aio`` channel too).

        A channel whose engine refused its connections waits out a growing backoff (up to
        minutes) before it tries again, failing calls at once meanwhile; an engine that was
        unreachable is asked again on a fresh channel (with subchannels of its own), which
        connects at once.
        """
        old = e.channel
        e.channel = self._channel(e.target, e.lease)
        e.stub = weight_sync_pb2_grpc.WeightSyncServiceStub(e.channel)
        old.close()
        self.streams.drop(e.target)  # its streams reopen on a fresh aio channel too

    def remove(self, target: str) -> RemoteEngine:
        """Forget the member at ``target`` and close its channels (the streams' too); returns it.

        Raises:
            KeyError: no member has that address.
        """
        e = self.member(target)
        self.members.remove(e)
        e.channel.close()
        self.streams.drop(target)
        return e

    def close(self) -> None:
        """Close every channel, and the stream loop (its thread ends). Idempotent."""
        self.streams.close()
        for e in self.members:
            e.channel.close()

    # ------------------------------------------------------------------ gather / fan out

    def gather(
        self,
        rpc: str,
        start: Callable[[RemoteEngine], Awaitable[R]],
        engines: Sequence[RemoteEngine] | None = None,
        *,
        stop: threading.Event | None = None,
    ) -> tuple[dict[str, R], dict[str, EngineFailure]]:
        """Start one call per engine (concurrently), then collect every reply or failure.

        The calls run on the client's event loop (:attr:`streams`), over the engines' ``grpc.aio``
        channels: a fan-out to N engines costs no thread per engine. Every call carries its own
        deadline, so collecting is bounded.

        Args:
            rpc: the RPC's name, for the failures.
            start: starts the call on one engine, on the loop's thread: e.g.
                ``lambda e: fleet.aio(e).GetStatus(request, timeout=..., metadata=...)``.
            engines: the engines to call; ``None`` = every engine taking part (:attr:`engines`).
            stop: once set (polled every :data:`STOP_POLL_S` seconds), the calls still running are cancelled
                and fail with ``CANCELLED`` (e.g. the sync's cancel signal, set when an engine it holds is
                lost: the others' answers would not change its fate); ``None``: every call runs to its end.

        Returns:
            target -> reply for the engines that answered, target -> failure for the others.

        Raises:
            StreamClosed: the client was closed.
        """
        engines = list(self.engines if engines is None else engines)

        async def one(e: RemoteEngine) -> R:
            return await start(e)

        async def every() -> list[R | BaseException]:
            calls = [asyncio.ensure_future(one(e)) for e in engines]
            if stop is not None:
                running = set(calls)
                while running and not stop.is_set():
                    _done, running = await asyncio.wait(running, timeout=STOP_POLL_S)
                for call in running:
                    call.cancel()
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = self.streams.run(every()) if engines else []
        results: dict[str, R] = {}
        failures: dict[str, EngineFailure] = {}
        for e, out in zip(engines, outcomes, strict=True):
            if isinstance(out, asyncio.CancelledError):
                failures[e.target] = EngineFailure(
                    e.target, rpc, grpc.StatusCode.CANCELLED, "", "not waited for: the call's sync was cancelled"
                )
            elif isinstance(out, BaseException):
                failures[e.target] = EngineFailure.from_exception(e.target, rpc, out)
            else:
                results[e.target] = out
        return results, failures

    def submit(self, start: Callable[[], Awaitable[R]]) -> Future[R]:
        """Start one call on the client's event loop and return its future at once.

        Args:
            start: starts the call, on the loop's thread (as for :meth:`gather`).

        Raises:
            StreamClosed: the client was closed.
        """

        async def call() -> R:
            return await start()

        return self.streams.submit(call())

    def aio(self, e: RemoteEngine) -> weight_sync_pb2_grpc.WeightSyncServiceAsyncStub:
        """``e``'s ``grpc.aio`` stub (on the loop's thread only: inside a ``start`` of :meth:`gather`)."""
        return self.streams.stub(e.target)

    def fan_out(
        self, rpc: str, start: Callable[[RemoteEngine], Awaitable[R]], engines: Sequence[RemoteEngine] | None = None
    ) -> dict[str, R]:
        """:meth:`gather`, then target -> reply.

        Raises:
            EngineCallError: some engine failed; ``results`` has the others' replies.
        """
        results, failures = self.gather(rpc, start, engines)
        if failures:
            raise EngineCallError(
                f"{rpc} failed on {len(failures)} of {len(results) + len(failures)} engine(s): "
                f"{failure_lines(failures)}",
                rpc=rpc,
                failures=failures,
                results=results,
            )
        return results

    # ------------------------------------------------------------------ one engine's calls

    def start_get_status(self, e: RemoteEngine) -> Awaitable[pb.GetStatusResponse]:
        """Start ``GetStatus`` on ``e`` (on the loop: a ``start`` of :meth:`gather`)."""
        timeout = self._settings.rpc_timeout_s
        return self.aio(e).GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self.metadata)

    def start_cancel(self, e: RemoteEngine, update_id: str, reason: str) -> Awaitable[pb.CancelResponse]:
        """Start ``Cancel`` of ``update_id`` (``""`` = whatever is in flight) on ``e`` (on the loop)."""
        return self.aio(e).Cancel(
            pb.CancelRequest(update_id=update_id, reason=reason, owner=self.owner),
            timeout=self._settings.rpc_timeout_s,
            metadata=self.metadata,
        )

    # ------------------------------------------------------------------ fan-out helpers

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """``GetStatus`` on every engine: target -> reply (``TrainerClient.status``)."""
        return self.fan_out("GetStatus", self.start_get_status)

    def pause(self, mode: PauseMode, timeout: float | None) -> dict[str, pb.PauseResponse]:
        """``Pause`` every engine: target -> reply (``TrainerClient.pause``).

        The deadline is the RPC timeout plus the drain bound (``timeout`` seconds, or the engine's default of 60 s).

        Raises:
            EngineCallError: some engine failed.
        """
        req = pb.PauseRequest(mode=PAUSE_MODES[mode])
        if timeout is not None:
            req.timeout.CopyFrom(duration(timeout))
        deadline = self._settings.timeouts.pause_rpc_s(timeout)
        return self.fan_out("Pause", lambda e: self.aio(e).Pause(req, timeout=deadline, metadata=self.metadata))

    def resume(self, force: bool) -> dict[str, pb.ResumeResponse]:
        """``Resume`` every engine: target -> reply (``TrainerClient.resume``)."""
        req = pb.ResumeRequest(force=force)
        return self.fan_out(
            "Resume",
            lambda e: self.aio(e).Resume(req, timeout=self._settings.rpc_timeout_s, metadata=self.metadata),
        )

    def checksums(self, names: Iterable[str]) -> dict[str, pb.GetWeightChecksumsResponse]:
        """``GetWeightChecksums`` on every engine: target -> reply (``TrainerClient.checksums``)."""
        req = pb.GetWeightChecksumsRequest(names=list(names))
        return self.fan_out(
            "GetWeightChecksums",
            lambda e: self.aio(e).GetWeightChecksums(req, timeout=self._settings.rpc_timeout_s, metadata=self.metadata),
        )

    def leave(self, timeout: float) -> dict[str, pb.LeaveResponse]:
        """``Leave`` on every engine, every call bounded by ``timeout`` seconds.

        Raises:
            EngineCallError: some engine failed.
        """
        return self.fan_out(
            "Leave",
            lambda e: self.aio(e).Leave(pb.LeaveRequest(owner=self.owner), timeout=timeout, metadata=self.metadata),
        )
