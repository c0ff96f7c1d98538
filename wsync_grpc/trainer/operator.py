"""The operator's calls of a trainer client, on every engine, from any thread at any time: :class:`OperatorCalls`.

Each returns, per target, the typed view of the engine's reply (:mod:`wsync_grpc.trainer.views`), in
target order.

Units: times in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from wsync_grpc.trainer.options import PauseModeName, pause_mode_of
from wsync_grpc.trainer.parts import ClientParts
from wsync_grpc.trainer.views import CancelResult, Checksums, EngineStatus, PauseResult, ResumeResult

R = TypeVar("R")
V = TypeVar("V")


def per_target(replies: Mapping[str, R], view: Callable[[R], V]) -> dict[str, V]:
    """target -> ``view(reply)``, in the replies' (target) order."""
    return {t: view(r) for t, r in replies.items()}


class OperatorCalls(ClientParts):
    """``GetStatus``, ``Pause``, ``Resume``, ``GetWeightChecksums`` and ``Cancel`` on every engine (a base of
    :class:`~wsync_grpc.trainer.client.TrainerClient`); none takes the client's op lock."""

    def status(self) -> dict[str, EngineStatus]:
        """``GetStatus`` on every engine: target -> :class:`~wsync_grpc.trainer.views.EngineStatus`.

        Raises:
            EngineCallError: some engine did not answer.
        """
        return per_target(self._fleet.status(), EngineStatus.from_proto)

    def pause(self, mode: PauseModeName = "abort", timeout: float | None = None) -> dict[str, PauseResult]:
        """``Pause`` every engine: target -> :class:`~wsync_grpc.trainer.views.PauseResult`
        (how many requests were aborted/drained/frozen).

        Args:
            mode: ``"abort"`` (end requests in flight), ``"wait"`` (drain them) or ``"keep"``
                (freeze them until resume), as vLLM's ``/pause?mode=``.
            timeout: drain bound of ``"wait"``, in seconds; ``None`` = the engine's default (60 s).

        Raises:
            ValueError: unknown mode.
            EngineCallError: some engine failed (e.g. DEADLINE_EXCEEDED when the drain timed out).
        """
        return per_target(self._fleet.pause(pause_mode_of(mode), timeout), PauseResult.from_proto)

    def resume(self, force: bool = False) -> dict[str, ResumeResult]:
        """``Resume`` every engine: target -> :class:`~wsync_grpc.trainer.views.ResumeResult`.

        Args:
            force: resume even an engine whose weights a failed update left dirty (half-updated).

        Raises:
            EngineCallError: some engine refused (e.g. FAILED_PRECONDITION ENGINE_DIRTY).
        """
        return per_target(self._fleet.resume(force), ResumeResult.from_proto)

    def checksums(self, names: Iterable[str] = ()) -> dict[str, Checksums]:
        """``GetWeightChecksums`` on every engine: target -> :class:`~wsync_grpc.trainer.views.Checksums`
        (the SHA-256 of each served tensor).

        Args:
            names: tensors to digest; empty (default) = every tensor.

        Raises:
            EngineCallError: some engine failed (e.g. INVALID_ARGUMENT UNKNOWN_TENSOR).
        """
        return per_target(self._fleet.checksums(names), Checksums.from_proto)

    def cancel(self, reason: str = "cancelled by the trainer") -> dict[str, CancelResult]:
        """Cancel whatever update is in flight on every engine, and interrupt a :meth:`sync` in flight.

        Engines that had an update in flight abandon it, go to FAILED and leave the group (the client
        re-initializes next). From another thread while ``sync`` runs: its broadcast stops at the next
        wait and it raises :class:`SyncError`.

        Args:
            reason: recorded in the engines' ``last_error``.
        Returns:
            target -> :class:`~wsync_grpc.trainer.views.CancelResult` (``cancelled`` is False where
            nothing was in flight).

        Raises:
            EngineCallError: some engine failed (e.g. FAILED_PRECONDITION while applying).
        """
        self._cancel_event.set()
        self._roster.cancelled = True
        return per_target(self._membership.cancel_updates(reason), CancelResult.from_proto)
