"""The trainer half of every transport: what a sender is given (:class:`SendSite`, :class:`SendJob`) and offers.

Each transport part (:class:`~wsync_grpc.transports.TransportPart`) builds one
:class:`TransportSender` per trainer client (:meth:`TransportPart.sender
<wsync_grpc.transports.TransportPart.sender>`), as it builds one receiver per engine worker, and the
trainer's update runner (:class:`~wsync_grpc.trainer.runner.UpdateRunner`) hands it one
:class:`SendJob` per update, as the engine hands its receivers one
:class:`~wsync_grpc.core.update.ReceivePlan`.

A sender reads who the trainer's ranks are from :class:`TrainerPeers`: one process
(:data:`ONE_PROCESS`), or a sharded trainer's ranks, whose coordination (the rank rounds) is the
trainer's (:mod:`wsync_grpc.trainer.sharded`). A transport that has several ranks send asks the peers
for more than this protocol (the broadcast transport's
:class:`~wsync_grpc.transports.broadcast.sender.DirectSends`).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.group.process_group import WeightSyncGroup

SENDING_RANK = 0
"""The group rank of a single trainer process, which sends every bucket (the contract's rank 0)."""


class TrainerPeers(Protocol):
    """The trainer's ranks in the weight-sync group, as its membership and its senders see them.

    The weight-sync group's ranks are the trainer's first (``0 .. trainer_ranks - 1``), then every
    engine's workers in target order (``wsync.v1.InitRequest.trainer_ranks``).
    """

    @property
    def trainer_ranks(self) -> int:
        """How many group ranks the trainer holds (``0 .. trainer_ranks - 1``); engines' workers follow."""
        ...

    @property
    def rank(self) -> int:
        """The group rank this process joins the weight-sync group as."""
        ...

    def forming(self, port: int, world_size: int) -> None:
        """The membership is about to form a group (store at ``port``, ``world_size`` ranks).

        Called before the engines' Init calls go out: a trainer of several ranks has its other ranks
        join now, beside this one (each blocks until the whole group formed).

        Raises:
            Exception: a trainer rank failed or is gone.
        """
        ...

    def repeating(self) -> None:
        """The update that just failed runs again over fewer engines (a fleet policy left some out): the
        trainer's other ranks, if any, must follow the next attempt.

        Raises:
            Exception: a trainer rank is gone (the update is not run again).
        """
        ...


class OneProcess:
    """:class:`TrainerPeers` of a trainer that is one process, group rank 0 (the contract's single sender)."""

    trainer_ranks = 1
    """One trainer rank: rank 0."""
    rank = SENDING_RANK
    """This process joins as rank 0."""

    def forming(self, port: int, world_size: int) -> None:
        """Nothing: this process is the trainer's only rank."""

    def repeating(self) -> None:
        """Nothing: this process is the trainer's only rank."""


ONE_PROCESS = OneProcess()
"""The :class:`TrainerPeers` of every trainer that is one process."""


@dataclass(frozen=True)
class SendSite:
    """Where a transport's sender runs, and what it may use there (the trainer's twin of
    :class:`~wsync_grpc.worker.receiver.ReceiveSite`).

    Attributes:
        peers: the trainer's ranks (:data:`ONE_PROCESS`, or a sharded trainer's).
        device: the trainer's device (its staging buffers live there).
        keep_buffers: keep staging buffers between updates; ``None``: where the device is CPU (see
            ``TrainerClient(keep_buffers=...)``).
        timeout_s: the longest a sender waits for the engines at one step of a send (the client's
            ``group_timeout_s`` when the sender was built), in seconds.
    """

    peers: TrainerPeers
    device: torch.device
    keep_buffers: bool | None = None
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S


@dataclass(frozen=True)
class SendJob:
    """One update's send, as the trainer hands it to its sender (:meth:`TransportSender.send`): what to send,
    how, and how to report it.

    Attributes:
        group: this process's membership of the weight-sync group; ``None`` for a transport that needs
            none (``TransportPart.needs_group`` false).
        buckets: the update's planned buckets, in index order (each with its sending rank, ``src``).
        layout: how buckets travel (one collective per bucket, or one per tensor).
        tensors: a bucket's tensors by slot name, asked for once per bucket when it is packed, posted or
            hashed (e.g. a :meth:`WeightSource.bucket_tensors
            <wsync_grpc.trainer.source.WeightSource.bucket_tensors>`).
        topology: which trainer ranks send which bytes (:class:`~wsync_grpc.core.topology.SendTopology`).
        cancel: set to stop at the next wait.
        update_id: the update's id (``wsync.v1`` ``update_id``); ``""`` where the sender needs none.
        on_sent: called from the sending thread once a bucket is on every engine, with the bucket and the
            bytes on every engine so far (bytes); ``None`` for none.
        on_digest: called with each bucket and its digest as soon as it was hashed (while it is on the
            wire); ``None``: nothing is hashed while sending.
        digest_of: a bucket's digest where it is not the hash of its bytes (a delta bucket's: of the tensors it
            results in, :meth:`DeltaPayload.digest_of <wsync_grpc.trainer.delta.DeltaPayload.digest_of>`), hashed by
            the trainer as each bucket is sent, or by each rank before Prepare where the ranks send their own
            pieces; ``None``: of its bytes.
    """

    group: WeightSyncGroup | None
    buckets: Sequence[Bucket]
    layout: Layout
    tensors: Callable[[Bucket], Mapping[str, torch.Tensor]]
    topology: SendTopology
    cancel: threading.Event
    update_id: str = ""
    on_sent: Callable[[Bucket, int], None] | None = None
    on_digest: Callable[[Bucket, Digest], None] | None = None
    digest_of: Callable[[Bucket], Digest] | None = None

    def own(self, rank: int) -> SendJob:
        """The same job restricted to the buckets group rank ``rank`` sends (a sharded trainer's direct send)."""
        return dataclasses.replace(self, buckets=[b for b in self.buckets if b.src == rank])

    def joined(self) -> WeightSyncGroup:
        """The job's group.

        Raises:
            ValueError: the job has none (the transport's part does not need one).
        """
        if self.group is None:
            raise ValueError("this send needs the weight-sync group, and the update formed none")
        return self.group


class TransportSender(Protocol):
    """A transport's trainer half: moves one update's buckets from the trainer's ranks to every engine."""

    def header_fields(self, job: SendJob) -> Mapping[str, Any]:
        """The fields of the update's header (:class:`~wsync_grpc.core.header.UpdateHeader`) its engines need
        before any byte, by name (the transport's handle, e.g. ``shared_memory``); empty for none. Called once
        per update, before Prepare; what it opens ends with the update's send or :meth:`release`.

        Raises:
            Exception: the handle could not be made (the update is abandoned before Prepare).
        """
        ...

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """Every bucket's digest of ``job``, computed before the update is prepared; ``None``: the sender hashes
        each bucket as it sends it (:meth:`send` calls ``job.on_digest``), and the digests follow the Prepare.

        Raises:
            Exception: a trainer rank failed or is gone (the update is abandoned before Prepare).
        """
        ...

    def send(self, job: SendJob) -> float:
        """Send every bucket of one update (``job``), in index order, in ``job.layout``, from the ranks
        ``job.topology`` names.

        Returns:
            The time spent packing or preparing tensors, in seconds (overlapped with the wire).

        Raises:
            ValueError: a topology this sender cannot serve.
            Exception: the transport's (a timeout, a peer gone) or
                :class:`~wsync_grpc.core.errors.Cancelled`; the update is then abandoned.
        """
        ...

    def release(self) -> None:
        """Drop what the sender keeps between updates (its staging buffers); an abandoned send may still read them."""
        ...


@runtime_checkable
class ZeroCopySender(TransportSender, Protocol):
    """A :class:`TransportSender` that may read the trainer's tensors where they already live instead of packing
    them (the shared-memory sender: tensors in the trainer's shared memory, read by the engines from their
    storages). The trainer sets :attr:`storages` from its ``shared_memory_zero_copy`` setting before every update.
    """

    storages: bool
    """Whether the next updates offer the zero-copy path; ``False``: every bucket is packed."""


@runtime_checkable
class ChecksSend(TransportSender, Protocol):
    """A :class:`TransportSender` that can tell, before any call, whether it can carry a send (the update runner
    asks it right after planning, before it holds or prepares any engine)."""

    def check_send(
        self, buckets: Sequence[Bucket], tensors: Callable[[Bucket], Mapping[str, torch.Tensor]], topology: SendTopology
    ) -> None:
        """Whether ``buckets`` (their ``tensors``, sent from ``topology``'s ranks) can go by this sender.

        Raises:
            ValueError: they cannot (e.g. CPU tensors through a ring in GPU memory), with what to do instead.
        """
        ...


class EngineReads:
    """The :class:`TransportSender` of a transport whose engines read the bytes themselves (a checkpoint on
    disk): the trainer sends nothing."""

    def header_fields(self, job: SendJob) -> Mapping[str, Any]:
        """None: the header names what the engines read."""
        return {}

    def digests_before_send(self, job: SendJob) -> Mapping[int, Digest] | None:
        """None: the engines hash what they read."""
        return None

    def send(self, job: SendJob) -> float:
        """Nothing to send (no bucket is the trainer's).

        Raises:
            ValueError: ``job`` has buckets: a trainer cannot send over this transport.
        """
        if job.buckets:
            raise ValueError("the engines read this transport's bytes themselves: the trainer sends none")
        return 0.0

    def release(self) -> None:
        """Nothing is kept."""


ENGINE_READS = EngineReads()
"""The one :class:`EngineReads` sender."""
