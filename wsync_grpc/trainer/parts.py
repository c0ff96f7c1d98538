"""The parts a :class:`~wsync_grpc.trainer.client.TrainerClient` is made of, built explicitly once, and the lock
its updates run under: :class:`ClientParts`.

The client's calls are grouped by what they are about, each group a base of the client over these parts:
the updates (:mod:`wsync_grpc.trainer.client`), the operator's calls (:mod:`wsync_grpc.trainer.operator`),
the members and their group (:mod:`wsync_grpc.trainer.members`).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from wsync_grpc.core.header import DELTA_TRANSPORTS
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.trainer.deadline import CancelSignal, check_timeout
from wsync_grpc.trainer.delta import DeltaPayload, DeltaSync, DeltaTracker, SyncPlan, fallen_back
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.lease import Leases
from wsync_grpc.trainer.membership import Membership
from wsync_grpc.trainer.metrics import TrainerMetrics
from wsync_grpc.trainer.mixed import TransportRunner
from wsync_grpc.trainer.protocol import UpdateProtocol
from wsync_grpc.trainer.request import BroadcastRequest, UpdateRequest
from wsync_grpc.trainer.results import SyncResult
from wsync_grpc.trainer.roster import FleetPolicy, Roster
from wsync_grpc.trainer.runner import Senders, UpdateRunner
from wsync_grpc.trainer.sender import Sender
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.source import WeightSource, WholeTensors
from wsync_grpc.transports.broadcast.sender import PackBuffers
from wsync_grpc.transports.sending import ONE_PROCESS, SendSite, TrainerPeers, TransportSender
from wsync_grpc.wire.keepalive import Keepalive


@dataclasses.dataclass(frozen=True)
class _Runs:
    """How a sync with deltas runs its updates (:class:`~wsync_grpc.trainer.delta.DeltaRuns`): the client's runner
    over the engines its roster lets take part."""

    runner: TransportRunner
    roster: Roster
    source: WeightSource

    def run(
        self, request: BroadcastRequest, payload: DeltaPayload, before_commit: Callable[[], None] | None
    ) -> SyncResult:
        return self.runner.run(dataclasses.replace(request, delta=payload), self.source, before_commit)

    def taking_part(self, targets: Collection[str]) -> contextlib.AbstractContextManager[None]:
        return self.roster.taking_part(targets)

    def fresh(self, request: BroadcastRequest) -> BroadcastRequest:
        return dataclasses.replace(request, update_id=uuid.uuid4().hex)


class ClientParts:
    """The parts of one trainer client, wired once: the fleet of channels, the leases, the transports' senders,
    the group membership, the update protocol and runner, the roster, the metrics; and the op lock.

    Args:
        targets: the engines' control addresses, in rank order.
        settings: the client's resolved settings (:func:`~wsync_grpc.trainer.settings.client_settings`).
        others: as :class:`~wsync_grpc.trainer.client.TrainerClient`'s keywords of the same names.

    Raises:
        ValueError: both ``peers`` and the deprecated ``sender``.
    """

    def __init__(
        self,
        targets: Sequence[str],
        settings: ClientSettings,
        *,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        channel_options: Sequence[tuple[str, Any]],
        keepalive: Keepalive | None,
        keep_buffers: bool | None,
        owner: str | None,
        metrics_registry: CollectorRegistry | None,
        sender: Callable[[PackBuffers], Sender] | None,
        policy: FleetPolicy | None,
        peers: TrainerPeers | None,
    ) -> None:
        self._settings = settings
        owner = owner if owner is not None else f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._fleet = Fleet(targets, self._settings, token, credentials, channel_options, owner, keepalive)
        self._op_lock = threading.Lock()
        self._cancel_event = CancelSignal()
        self._leases = Leases(self._fleet)
        given: dict[Transport, TransportSender] = {}
        if sender is not None:  # deprecated: one object, the ranks and the broadcast
            if peers is not None:
                raise ValueError("pass peers or the deprecated sender, not both")
            peers = given[Transport.BROADCAST] = sender(PackBuffers(keep_buffers, self._settings.device))
        peers = peers if peers is not None else ONE_PROCESS
        site = SendSite(peers, self._settings.device, keep_buffers, self._settings.group_timeout_s)
        self._senders = Senders(site, given)
        self._membership = Membership(self._fleet, self._settings, self._cancel_event, self._leases, peers)
        self._metrics = TrainerMetrics(metrics_registry)
        calls = UpdateProtocol(
            self._fleet,
            self._membership,
            self._settings,
            self._cancel_event,
            peers,
            self._senders.release,
            self._metrics,
        )
        runner = UpdateRunner(calls, self._settings, self._senders, self._cancel_event)
        self._policy = policy if policy is not None else FleetPolicy()
        self._roster = Roster(self._fleet, self._membership, self._settings, calls, self._leases, self._metrics)
        self._runner = TransportRunner(runner, self._roster, self._fleet)  # mixed transports
        self._deltas = DeltaTracker(self._settings.delta_anchor_every)

    @property
    def deltas(self) -> DeltaTracker:
        """What this client last sent with deltas on, and the identities its engines answered it with."""
        return self._deltas

    def _run_with_deltas(
        self,
        source: WeightSource,
        request: BroadcastRequest,
        dtype: torch.dtype | None,
        policy: FleetPolicy | None,
        timeout_s: float | None,
        encoded: DeltaPayload | None = None,
    ) -> SyncResult:
        """Run ``request`` with deltas on (:class:`~wsync_grpc.trainer.delta.DeltaSync`): a delta at each attempt
        whose engines all serve the client's base, else whole; the base moves on once it succeeded.

        ``encoded``: the payload encoded already (a sharded trainer's direct send, each rank its own pieces:
        ``source`` is then its :class:`~wsync_grpc.trainer.sharded.source.DirectSource`).

        Raises:
            ValueError: ``source`` is not ``(name, tensor)`` pairs (and nothing is encoded), the layout is not
                flattened, or the transport carries no delta (``cuda_ipc``).
            SyncError, RuntimeError, ClientError: as :meth:`TrainerClient.sync
                <wsync_grpc.trainer.client.TrainerClient.sync>`.
        """
        named = source if isinstance(source, WholeTensors) else None
        if (named is None and encoded is None) or request.layout is not Layout.FLATTENED:
            raise ValueError("deltas are sent from (name, tensor) pairs in the flattened layout")
        if request.transport not in DELTA_TRANSPORTS:  # e.g. CUDA IPC: refused here, before any call
            raise ValueError(f"deltas travel by broadcast or shared memory, not by {request.transport.value!r}")
        self._deltas.anchor_every = self._settings.delta_anchor_every
        plan = SyncPlan.DELTA  # a sharded trainer's ranks encode before this: always a delta where they can
        if named is not None and encoded is None and self._settings.delta_fallback:
            plan = self._deltas.costs.plan(has_base=bool(self._deltas.version))
        if plan is SyncPlan.PLAIN and named is not None:
            self._deltas.forget()  # nothing kept while deltas do not pay
            result = self._run_update(request, source, policy, timeout_s)
            result = dataclasses.replace(result, delta=fallen_back(named, dtype))
        else:
            deltas: DeltaSync[BroadcastRequest] = DeltaSync(
                self._deltas,
                named,
                dtype,
                lambda: [e.target for e in self._fleet.engines],  # those taking part, at each attempt
                _Runs(self._runner, self._roster, source),
                mixed=request.apply_mode is ApplyMode.STAGED,
                encoded=encoded,
                whole=plan is SyncPlan.KEEP,
            )
            with self._exclusive(timeout_s):
                result = deltas.applied(self._roster.run(policy or self._policy, request, deltas.attempt))
            if plan is SyncPlan.KEEP and result.delta is not None:
                result = dataclasses.replace(result, delta=dataclasses.replace(result.delta, fell_back=True))
        if named is not None and encoded is None and result.delta is not None:
            self._deltas.costs.record(plan, result.delta, result.total_seconds)
        return result

    def _run_update(
        self,
        request: UpdateRequest,
        source: WeightSource | None,
        policy: FleetPolicy | None,
        timeout_s: float | None = None,
    ) -> SyncResult:
        """Run ``request`` (of any kind; ``source``: the tensors the trainer sends, ``None`` where the engines read
        them) under the op lock, over the engines ``policy`` (``None``: the client's) lets take part, at most
        ``timeout_s`` seconds (``None``: no deadline of its own).

        Raises:
            SyncError, RuntimeError, ClientError, ValueError: as :meth:`TrainerClient.sync
                <wsync_grpc.trainer.client.TrainerClient.sync>`.
        """
        with self._exclusive(timeout_s):
            return self._roster.run(policy or self._policy, request, lambda r: self._runner.run(r, source))

    @contextlib.contextmanager
    def _exclusive(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the client's op lock for one sync (of ``timeout_s`` seconds at most, ``None``: no deadline of its
        own); a second concurrent one raises :class:`RuntimeError`.

        Raises:
            ValueError: ``timeout_s`` is not above 0.
        """
        check_timeout(timeout_s)  # before the lock: a bad timeout is refused whatever else runs
        if not self._op_lock.acquire(blocking=False):
            raise RuntimeError("another sync (or init/leave) is running on this client")
        try:
            self._cancel_event.start(timeout_s)
            try:
                yield
            finally:
                self._cancel_event.end()
        finally:
            self._op_lock.release()
