"""What a :class:`~wsync_grpc.trainer.client.TrainerClient` shows, and the operator calls it passes to every engine.

Read-only properties (targets, ranks, the group, the owner) and the calls that
need no sync lock and may run from any thread at any time: ``GetStatus``,
``Pause``, ``Resume``, ``GetWeightChecksums``.

Units: seconds for timeouts.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.membership import Membership
from wsync_grpc.trainer.metrics import TrainerMetrics
from wsync_grpc.trainer.options import PauseModeName


class ClientViews:
    """The properties and operator calls of :class:`~wsync_grpc.trainer.client.TrainerClient` (its base class)."""

    _fleet: Fleet
    _membership: Membership
    _metrics: TrainerMetrics

    @property
    def targets(self) -> list[str]:
        """The engines' addresses, in rank order."""
        return [e.target for e in self._fleet.engines]

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The registry of the client's Prometheus metrics (serve it with ``prometheus_client``)."""
        return self._metrics.registry

    @property
    def owner(self) -> str:
        """The client's name as the engines' owner."""
        return self._fleet.owner

    @property
    def stubs(self) -> dict[str, weight_sync_pb2_grpc.WeightSyncServiceStub]:
        """target -> the generated stub on the client's channel, for calls the client does not wrap."""
        return {e.target: e.stub for e in self._fleet.engines}

    @property
    def call_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The metadata (token) to pass along with calls made on :attr:`stubs`."""
        return self._fleet.metadata

    @property
    def needs_init(self) -> bool:
        """Whether the next :meth:`sync` (re-)initializes the group first."""
        return self._membership.needs_init

    @property
    def group(self) -> WeightSyncGroup | None:
        """The trainer's membership of the weight-sync group (rank 0), ``None`` before :meth:`init`."""
        return self._membership.group

    @property
    def workers(self) -> dict[str, int]:
        """target -> workers, as of the last :meth:`init` (0 before it)."""
        return {e.target: e.workers for e in self._fleet.engines}

    @property
    def rank_offsets(self) -> dict[str, int]:
        """target -> group rank of the engine's first worker, as of the last :meth:`init` (0 before it)."""
        return {e.target: e.rank_offset for e in self._fleet.engines}

    @property
    def world_size(self) -> int:
        """1 + every engine's workers, as of the last :meth:`init` (1 before it)."""
        return 1 + sum(e.workers for e in self._fleet.engines)

    @property
    def port(self) -> int | None:
        """The TCP port of the trainer's store in the current group; ``None`` when not joined."""
        return self._membership.port

    def status(self) -> dict[str, pb.GetStatusResponse]:
        """``GetStatus`` on every engine: target -> reply (EngineCallError when some does not answer)."""
        return self._fleet.status()

    def pause(self, mode: PauseModeName = "abort", timeout: float | None = None) -> dict[str, pb.PauseResponse]:
        """``Pause`` every engine: target -> reply (how many requests were aborted/drained/frozen).

        Args:
            mode: ``"abort"`` (end requests in flight), ``"wait"`` (drain them) or ``"keep"``
                (freeze them until resume), as vLLM's ``/pause?mode=``.
            timeout: drain bound of ``"wait"``, in seconds; ``None`` = the engine's default (60 s).

        Raises:
            ValueError: unknown mode.
            EngineCallError: some engine failed (e.g. DEADLINE_EXCEEDED when the drain timed out).
        """
        return self._fleet.pause(mode, timeout)

    def resume(self, force: bool = False) -> dict[str, pb.ResumeResponse]:
        """``Resume`` every engine: target -> reply.

        Args:
            force: resume even an engine whose weights a failed update left dirty (half-updated).

        Raises:
            EngineCallError: some engine refused (e.g. FAILED_PRECONDITION ENGINE_DIRTY).
        """
        return self._fleet.resume(force)

    def checksums(self, names: Iterable[str] = ()) -> dict[str, pb.GetWeightChecksumsResponse]:
        """``GetWeightChecksums`` on every engine: target -> SHA-256 of each served tensor.

        Args:
            names: tensors to digest; empty (default) = every tensor.

        Raises:
            EngineCallError: some engine failed (e.g. INVALID_ARGUMENT UNKNOWN_TENSOR).
        """
        return self._fleet.checksums(names)
