"""The engines as the trainer reaches them, and one RPC fanned out over all of them.

A :class:`Fleet` owns one gRPC channel and stub per engine
(:class:`RemoteEngine`, in target order, which is rank order) and the call
metadata (the token). :meth:`Fleet.gather` starts one call per engine
concurrently, then collects every reply or failure; :meth:`Fleet.fan_out`
raises :class:`~wsync_grpc.trainer.results.EngineCallError` when any engine
failed. The fan-out helpers (status, pause, resume, checksums, leave) and
the calls that the group formation and the failure protocol fan out
(GetStatus, Cancel) are built on them. The long-lived streams (leases, held
Watch calls) run on :attr:`Fleet.streams` instead, one ``grpc.aio`` channel per
engine on one event-loop thread (:mod:`wsync_grpc.trainer.streams`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest reply the client accepts, in bytes (checksums of 100k tensors exceed gRPC's 4 MiB default)."""

R = TypeVar("R")


@dataclass
class RemoteEngine:
    """One engine: its channel and stub, and its place in the group as of the last init.

    Attributes:
        target: the engine's ``host:port``.
        channel: the client's channel to it.
        stub: the generated stub on that channel.
        workers: the engine's workers (0 before init).
        rank_offset: group rank of its first worker (0 before init).
    """

    target: str
    channel: grpc.Channel
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    workers: int = 0
    rank_offset: int = 0


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
            *(keepalive if keepalive is not None else Keepalive()).channel_options(),
            *channel_options,
        ]
        self.streams = StreamLoop(options, credentials)
        """The event loop (one thread) and ``grpc.aio`` channels, same options, of the engines' long-lived streams."""
        self.engines: list[RemoteEngine] = []
        """The engines, in rank order."""
        for t in targets:
            ch = (
                grpc.secure_channel(t, credentials, options=options)
                if credentials is not None
                else grpc.insecure_channel(t, options=options)
            )
            self.engines.append(RemoteEngine(t, ch, weight_sync_pb2_grpc.WeightSyncServiceStub(ch)))

    def close(self) -> None:
        """Close every channel, and the stream loop (its thread ends). Idempotent."""
        self.streams.close()
        for e in self.engines:
            e.channel.close()

    # ------------------------------------------------------------------ gather / fan out

    def gather(
        self, rpc: str, start: Callable[[RemoteEngine], grpc.Future[R]], engines: Sequence[RemoteEngine] | None = None
    ) -> tuple[dict[str, R], dict[str, EngineFailure]]:
        """Start one call per engine (concurrently), then collect every reply or failure.

        Every call carries its own deadline, so collecting is bounded.

        Args:
            rpc: the RPC's name, for the failures.
            start: starts the call on one engine.
            engines: the engines to call; ``None`` = every engine.

        Returns:
            target -> reply for the engines that answered, target -> failure for the others.
        """
        engines = self.engines if engines is None else engines
        futures: dict[str, grpc.Future[R]] = {}
        failures: dict[str, EngineFailure] = {}
        for e in engines:
            try:
                futures[e.target] = start(e)
            except Exception as exc:
                failures[e.target] = EngineFailure.from_exception(e.target, rpc, exc)
        results: dict[str, R] = {}
        for target, fut in futures.items():
            try:
                results[target] = fut.result()
            except Exception as exc:
                failures[target] = EngineFailure.from_exception(target, rpc, exc)
        return results, failures

    def fan_out(
        self, rpc: str, start: Callable[[RemoteEngine], grpc.Future[R]], engines: Sequence[RemoteEngine] | None = None
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

    def start_get_status(self, e: RemoteEngine) -> grpc.Future[pb.GetStatusResponse]:
        """Start ``GetStatus`` on ``e``."""
        return e.stub.GetStatus.future(
            pb.GetStatusRequest(), timeout=self._settings.rpc_timeout_s, metadata=self.metadata
        )

    def start_cancel(self, e: RemoteEngine, update_id: str, reason: str) -> grpc.Future[pb.CancelResponse]:
        """Start ``Cancel`` of ``update_id`` (``""`` = whatever is in flight) on ``e``."""
        return e.stub.Cancel.future(
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
        return self.fan_out("Pause", lambda e: e.stub.Pause.future(req, timeout=deadline, metadata=self.metadata))

    def resume(self, force: bool) -> dict[str, pb.ResumeResponse]:
        """``Resume`` every engine: target -> reply (``TrainerClient.resume``)."""
        req = pb.ResumeRequest(force=force)
        return self.fan_out(
            "Resume",
            lambda e: e.stub.Resume.future(req, timeout=self._settings.rpc_timeout_s, metadata=self.metadata),
        )

    def checksums(self, names: Iterable[str]) -> dict[str, pb.GetWeightChecksumsResponse]:
        """``GetWeightChecksums`` on every engine: target -> reply (``TrainerClient.checksums``)."""
        req = pb.GetWeightChecksumsRequest(names=list(names))
        return self.fan_out(
            "GetWeightChecksums",
            lambda e: e.stub.GetWeightChecksums.future(
                req, timeout=self._settings.rpc_timeout_s, metadata=self.metadata
            ),
        )

    def leave(self, timeout: float) -> dict[str, pb.LeaveResponse]:
        """``Leave`` on every engine, every call bounded by ``timeout`` seconds.

        Raises:
            EngineCallError: some engine failed.
        """
        return self.fan_out(
            "Leave",
            lambda e: e.stub.Leave.future(pb.LeaveRequest(owner=self.owner), timeout=timeout, metadata=self.metadata),
        )
