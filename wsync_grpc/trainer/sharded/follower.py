"""A trainer rank other than 0: what it keeps between calls, and what it keeps while it follows one.

A follower talks to no engine: rank 0 leads every round (:mod:`wsync_grpc.trainer.sharded.rounds`) and
the follower does its half. What it needs for that is small: the settings it plans and joins with (the
rank's :class:`~wsync_grpc.trainer.settings.ClientSettings`), its membership of the weight-sync group
(:class:`FollowerGroup`), its two pack buffers (:class:`Follower`), and, per call, the buckets it planned
and the first error of its own (:class:`FollowedCall`).

Units: times in seconds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.trainer.delta import DeltaPayload
from wsync_grpc.trainer.options import BackendName
from wsync_grpc.trainer.planning import Planner
from wsync_grpc.trainer.request import BroadcastRequest
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.sharded.ranks import TrainerRanks
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.transports.broadcast.sender import PackBuffers
from wsync_grpc.transports.sending import ONE_PROCESS, SendSite
from wsync_grpc.transports.shared_memory.sender import SharedMemorySender

__all__ = ["FollowedCall", "Follower", "FollowerGroup", "JoinSettings"]


class JoinSettings(Protocol):
    """What joining the weight-sync group reads (a :class:`~wsync_grpc.trainer.settings.ClientSettings`)."""

    @property
    def master_address(self) -> str:
        """Trainer rank 0's store host (every rank is given rank 0's address)."""
        ...

    @property
    def group_name(self) -> str:
        """The group's name (store prefix)."""
        ...

    @property
    def backend(self) -> BackendName:
        """The group's backend."""
        ...

    @property
    def device(self) -> torch.device:
        """Where this rank's collectives run."""
        ...

    @property
    def group_timeout_s(self) -> float:
        """Group join and per-collective timeout, in seconds."""
        ...


class FollowerGroup:
    """A trainer rank other than 0: its membership of the weight-sync group, joined when rank 0 forms one.

    Args:
        settings: read at every join (its ``master_address`` is rank 0's store host; its group name,
            backend, device and group timeout are rank 0's).
        ranks: the trainer's ranks.
    """

    def __init__(self, settings: JoinSettings, ranks: TrainerRanks) -> None:
        self._settings = settings
        self._ranks = ranks
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._group: WeightSyncGroup | None = None
        self._error: BaseException | None = None
        self._generation = 0

    def join(self, port: int, world_size: int) -> None:
        """Leave the current group and start joining the one being formed (in a helper thread)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            old, self._group, self._error = self._group, None, None
        if old is not None:
            old.destroy()
        s = self._settings

        def run() -> None:
            try:
                g = join_group(
                    master_address=s.master_address,
                    master_port=port,
                    rank=self._ranks.rank,
                    world_size=world_size,
                    group_name=s.group_name,
                    backend=s.backend,
                    device=s.device,
                    timeout_s=s.group_timeout_s,
                    trainer_ranks=self._ranks.size,
                )
            except BaseException as e:
                with self._lock:
                    if generation == self._generation:
                        self._error = e
                return
            with self._lock:
                if generation == self._generation:
                    self._group = g
                    return
            g.destroy()  # a newer formation (or close) came first

        self._thread = threading.Thread(target=run, name="wsync-follower-join", daemon=True)
        self._thread.start()

    def group(self) -> WeightSyncGroup:
        """The joined group, waiting for a join in progress (bounded by the group timeout).

        Raises:
            RuntimeError: never joined, or the join failed or has not ended.
        """
        thread = self._thread
        if thread is not None:
            thread.join(self._settings.group_timeout_s + 5.0)
        with self._lock:
            if self._group is not None:
                return self._group
            if self._error is not None:
                raise RuntimeError(f"trainer rank {self._ranks.rank} could not join the group: {self._error}")
        raise RuntimeError(f"trainer rank {self._ranks.rank} is not a member of the weight-sync group")

    def close(self) -> None:
        """Leave the group (idempotent; a join in progress destroys its group when it ends)."""
        with self._lock:
            self._generation += 1
            group, self._group = self._group, None
        if group is not None:
            group.destroy()


class Follower:
    """A trainer rank other than 0, between calls: its settings, its membership of the group, its pack buffers.

    Args:
        ranks: the trainer's ranks (this one is not rank 0).
        settings: this rank's settings (the same as rank 0's where planning and the group are concerned:
            the ranks agree on the planning ones at every call); read at every plan and every join.
        keep_buffers: keep the two pack buffers of the direct sends between syncs (as
            :class:`~wsync_grpc.trainer.client.TrainerClient`'s ``keep_buffers``).
    """

    def __init__(self, ranks: TrainerRanks, settings: ClientSettings, keep_buffers: bool | None) -> None:
        self.ranks = ranks
        self.settings = settings
        self.group = FollowerGroup(settings, ranks)
        self.buffers = PackBuffers(keep_buffers, settings.device)
        self._planner = Planner(settings)
        self._rings: SharedMemorySender | None = None

    @property
    def rings(self) -> SharedMemorySender:
        """This rank's ring of shared memory for its own buckets (direct sends through shared memory: made at the
        first, its segment kept between syncs as rank 0's is)."""
        if self._rings is None:
            site = SendSite(ONE_PROCESS, self.settings.device, timeout_s=self.settings.group_timeout_s)
            self._rings = SharedMemorySender(site)
        return self._rings

    def call(self, source: WeightSource, request: BroadcastRequest) -> FollowedCall:
        """Start following one update: plan its buckets as rank 0 does (same metadata, settings and topology).

        Raises:
            ValueError: a planning error (rank 0 meets the same one).
        """
        buckets, _messages = self._planner.plan(
            source.metadata(), request.bucket_bytes, request.dtype, request.layout, request.topology
        )
        delta: DeltaPayload | None = getattr(source, "delta", None)
        if delta is None or not delta.is_delta:
            return FollowedCall(self, source, request, buckets)
        delta_buckets, _messages = self._planner.plan(
            source.metadata(),
            request.bucket_bytes,
            request.dtype,
            request.layout,
            request.topology,
            delta.plan_deltas(),
        )
        return FollowedCall(self, source, request, buckets, delta=delta, delta_buckets=delta_buckets)

    def close(self) -> None:
        """Leave the weight-sync group and drop the buffers and the ring (not collective; idempotent)."""
        self.group.close()
        self.buffers.release()
        if self._rings is not None:
            self._rings.release()


@dataclasses.dataclass
class FollowedCall:
    """One update as a follower follows it, round by round.

    Attributes:
        follower: the rank's state between calls.
        source: this rank's tensors as the update reads them (whole tensors, ``DTensor`` s gathered per
            bucket; or, in the direct mode, this rank's own shards).
        request: the update, as every rank built it.
        buckets: the planned buckets, the same on every rank.
        error: this rank's first failure in the call (raised once rank 0 shares the outcome).
        delta: this rank's delta payload (a direct send with deltas on,
            :attr:`~wsync_grpc.trainer.sharded.source.DirectSource.delta`); ``None``: none.
        delta_buckets: the buckets planned for the delta (rank 0 runs it when every engine serves the base: it
            says so in the rounds that send); ``None``: none.
    """

    follower: Follower
    source: WeightSource
    request: BroadcastRequest
    buckets: list[Bucket]
    error: BaseException | None = None
    delta: DeltaPayload | None = None
    delta_buckets: list[Bucket] | None = None

    def plan(
        self, delta: bool
    ) -> tuple[list[Bucket], Callable[[Bucket], Mapping[str, torch.Tensor]], Callable[[Bucket], Digest] | None]:
        """The buckets this update sends, how to read a bucket's tensors and its digest (``None``: from its bytes):
        the delta's (``delta``: rank 0 runs the delta) or the whole update's.

        Raises:
            RuntimeError: rank 0 runs a delta this rank planned none for (the ranks' bases differ).
        """
        if not delta:
            return self.buckets, self.source.bucket_tensors, None
        if self.delta is None or self.delta_buckets is None:
            raise RuntimeError("trainer rank 0 sends a delta this rank has no payload for")
        return self.delta_buckets, self.delta.bucket_tensors, self.delta.digest_of

    @property
    def ranks(self) -> TrainerRanks:
        """The trainer's ranks."""
        return self.follower.ranks

    def failed(self, error: BaseException, *, report: bool) -> None:
        """Keep ``error`` unless an earlier one is kept; ``report``: rank 0 hears of it in the next round."""
        self.error = self.error or error
        if report:
            self.ranks.report_failure()
