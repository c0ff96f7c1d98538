""":class:`ShardedTrainerClient`: every rank of a sharded trainer (FSDP2, ZeRO-3) syncs collectively.

Every rank of the trainer's process group builds one and calls the same methods in the same order
with the same arguments (its own shards of the same parameters). Trainer rank 0 holds the engines'
ownership and talks to them through a :class:`~wsync_grpc.trainer.client.TrainerClient`; the other
ranks follow it round by round (:mod:`wsync_grpc.trainer.sharded.rounds`, every round's two halves, over
:class:`~wsync_grpc.trainer.sharded.ranks.TrainerRanks`), each with its settings, its membership of the
weight-sync group and its buffers (:class:`~wsync_grpc.trainer.sharded.follower.Follower`), so that:

- the ranks agree on the call before anything moves: different names, dtypes, global shapes,
  versions, options or call order raise :class:`~wsync_grpc.trainer.sharded.ranks.RanksDisagree` on
  every rank, within one round;
- planning uses global shapes and gathers nothing (:class:`~wsync_grpc.trainer.sharded.source.ShardedTensors`);
- every rank is a member of the weight-sync group (one broadcast group per trainer rank), joined
  while rank 0 forms it (:mod:`wsync_grpc.trainer.sharded.peers`);
- in the ``"gather"`` mode each bucket is materialised on every rank at once (``full_tensor()`` of its
  ``DTensor`` s) and rank 0 sends it; no rank holds more than the buckets in flight beyond its shards;
- in the ``"direct"`` mode nothing is gathered: every rank sends the buckets of its own shards
  (:class:`~wsync_grpc.trainer.sharded.source.DirectSource`), the engines assemble each tensor;
- through shared memory (``transport="shared_memory"``, engines on the ranks' host) no weight-sync group is formed:
  in the ``"gather"`` mode rank 0 packs each gathered bucket into its ring
  (:mod:`wsync_grpc.transports.shared_memory`) instead of broadcasting it, the other ranks only gather in
  lockstep; in the ``"direct"`` mode every rank packs its own buckets into a ring of its own (the
  :data:`~wsync_grpc.trainer.sharded.rounds.RINGS` round exchanges their handles before Prepare) and the engines'
  workers read each bucket from the ring of the rank that sends it;
- with deltas on, the gather mode gathers its buckets the same way before Prepare and rank 0 diffs them as a
  single process does (:meth:`~wsync_grpc.trainer.sharded.source.LockstepSource.whole_tensors`); the direct mode's
  ranks each diff their own shards;
- a rank that dies stops the others at the next round (:class:`~wsync_grpc.trainer.sharded.ranks.TrainerRankLost`),
  rank 0 then cancels the update everywhere as for any failed send, and every surviving rank raises;
- every rank returns the same :class:`~wsync_grpc.trainer.results.SyncResult` or raises the same
  :class:`~wsync_grpc.trainer.results.SyncError` (:mod:`wsync_grpc.trainer.sharded.outcome`).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from wsync_grpc.core.layout import Bucket, Transport
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, Timeouts
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.trainer.client import TrainerClient
from wsync_grpc.trainer.delta import DeltaPayload
from wsync_grpc.trainer.options import ApplyMode, Layout, TransportName, transport_of
from wsync_grpc.trainer.planning import Planner
from wsync_grpc.trainer.request import BroadcastRequest, catch_up_request, sent_kind
from wsync_grpc.trainer.results import SyncProgress, SyncResult
from wsync_grpc.trainer.roster import FleetPolicy, Member
from wsync_grpc.trainer.settings import AUTO_MASTER_ADDRESS
from wsync_grpc.trainer.sharded.follower import Follower
from wsync_grpc.trainer.sharded.peers import SEND_MODES, SendMode, ShardedPeers
from wsync_grpc.trainer.sharded.ranks import TrainerRanks
from wsync_grpc.trainer.sharded.rounds import OUTCOME, follow
from wsync_grpc.trainer.sharded.source import DirectSource, LockstepSource, ShardedTensors
from wsync_grpc.trainer.source import WeightSource
from wsync_grpc.trainer.views import Checksums, EngineStatus, LeaveResult

__all__ = ["SendMode", "ShardedTrainerClient"]

log = logging.getLogger(__name__)


def _sent_by(transport: str, mode: str, layout: str) -> Transport:
    """The transport a sharded trainer's sync in ``mode`` and ``layout`` sends by, named ``transport``.

    Raises:
        ValueError: an unknown ``transport``; ``"shared_memory"`` with the individual layout.
    """
    sent_by = transport_of(transport)
    if sent_by is Transport.SHARED_MEMORY and layout != "flattened":
        raise ValueError("shared memory carries the flattened layout only: bucket by bucket through its ring")
    return sent_by


class ShardedTrainerClient:
    """One rank's handle of a sharded trainer's weight sync; every rank calls it collectively.

    ::

        dist.init_process_group("gloo")            # or nccl; the trainer's own group
        model = ...; fully_shard(model)            # FSDP2: parameters are DTensors
        with ShardedTrainerClient(["10.0.0.2:50051"], master_address="10.0.0.1") as c:
            for step in range(steps):
                train_step()
                c.sync(model.named_parameters(), f"step-{step}")   # on every rank

    Args:
        targets: the engines' control addresses, as for :class:`TrainerClient`.
        trainer_group: the trainer's process group (every rank of it calls this client);
            ``None`` = the default group. ``torch.distributed`` must be initialized.
        client_options: the keyword arguments of :class:`TrainerClient` (``master_address`` is
            trainer rank 0's address, where the engines reach its store; ``"auto"`` only with one rank).

    Raises:
        ValueError: ``torch.distributed`` not initialized, a bad client option, or ``master_address="auto"``
            with several trainer ranks.
    """

    def __init__(
        self, targets: Sequence[str], *, trainer_group: dist.ProcessGroup | None = None, **client_options: Any
    ) -> None:
        timeouts = Timeouts(
            rpc_s=float(client_options.get("rpc_timeout_s", DEFAULT_RPC_TIMEOUT_S)),
            group_s=float(client_options.get("group_timeout_s", DEFAULT_GROUP_TIMEOUT_S)),
        )
        # A round outlasts rank 0's waits on the engines between two rounds (a follower that timed out first
        # would break the control group under a sync that was going to succeed, or run again).
        self._ranks = TrainerRanks(trainer_group, timeouts.round_s)
        if client_options.get("master_address") == AUTO_MASTER_ADDRESS and self._ranks.size > 1:
            raise ValueError(
                "master_address='auto' is this rank's own route: every trainer rank needs rank 0's address "
                "(e.g. wsync_grpc.group.routes.route_address(targets[0]) on rank 0, shared with the others)"
            )
        self._peers = ShardedPeers(self._ranks)
        self._client = TrainerClient(targets, peers=self._peers, **client_options)
        self._follower: Follower | None = None
        """A rank other than 0: its settings, membership of the weight-sync group and pack buffers (rank 0's
        are its client's). The rounds it follows read these, never the client: they share its settings."""
        if not self._ranks.leader:
            self._follower = Follower(self._ranks, self._client._settings, client_options.get("keep_buffers"))
        self._calls = 0
        self._planner = Planner(self._client)
        """Rank 0 in the gather mode with deltas: the buckets it gathers to diff, planned as the others plan them."""

    @property
    def rank(self) -> int:
        """This process's trainer rank (0 talks to the engines)."""
        return self._ranks.rank

    @property
    def trainer_ranks(self) -> int:
        """How many ranks the trainer has."""
        return self._ranks.size

    @property
    def client(self) -> TrainerClient:
        """The :class:`TrainerClient` of this rank: on rank 0 the engines' owner, whose ``pause``, ``resume``
        and ``cancel`` are called there; on every rank the read-only calls (:meth:`status`, :meth:`checksums`)."""
        return self._client

    # ------------------------------------------------------------------ read-only operator calls (any rank)

    def status(self) -> dict[str, EngineStatus]:
        """``GetStatus`` on every engine, through this rank's :class:`TrainerClient` (:meth:`TrainerClient.status`):
        target -> :class:`~wsync_grpc.trainer.views.EngineStatus`.

        Read-only and not collective: any rank may call it, at any time, from any thread. It asks every
        engine of this rank's client, each call bounded by the client's ``rpc_timeout_s`` (seconds): the
        ``targets`` it was built with (engines added or removed through rank 0's :attr:`client` are rank
        0's alone). The calls that change the engines (``pause``, ``resume``, ``cancel``) are the owner's:
        rank 0's :attr:`client`.

        Raises:
            EngineCallError: some engine did not answer.
        """
        return self._client.status()

    def checksums(self, names: Iterable[str] = ()) -> dict[str, Checksums]:
        """``GetWeightChecksums`` on every engine, through this rank's :class:`TrainerClient`
        (:meth:`TrainerClient.checksums`): target -> :class:`~wsync_grpc.trainer.views.Checksums` (the
        SHA-256 of each served tensor).

        Read-only and not collective: any rank may call it, at any time, from any thread; it asks the
        engines :meth:`status` asks, each call bounded by the client's ``rpc_timeout_s`` (seconds).

        Args:
            names: tensors to digest; empty (default) = every tensor.

        Raises:
            EngineCallError: some engine failed (e.g. INVALID_ARGUMENT UNKNOWN_TENSOR).
        """
        return self._client.checksums(names)

    def _agree(self, call: str, parts: dict[str, Any]) -> None:
        self._calls += 1
        self._ranks.agree(f"{call} #{self._calls}", parts)

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str,
        *,
        mode: SendMode = "gather",
        layout: Layout = "flattened",
        apply_mode: ApplyMode = "staged",
        bucket_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        flush_cache: bool = False,
        progress: Callable[[SyncProgress], None] | None = None,
        on_phase: Callable[[str], None] | None = None,
        delta: bool | None = None,
        transport: TransportName = "broadcast",
    ) -> SyncResult:
        """Push this trainer's weights to every engine as ``weight_version``: collective, on every rank.

        Steps: every rank reads its tensors' metadata (global shapes; nothing gathered) and the
        ranks agree on the call; rank 0 runs :meth:`TrainerClient.sync` (Prepare, send, the
        two-phase Complete) while the others follow it bucket by bucket; every rank returns rank
        0's result or raises its error.

        Args:
            named_tensors: ``(name, tensor)`` pairs, plain tensors or ``DTensor`` s (e.g. an FSDP2
                model's ``named_parameters()``): the same names, dtypes and global shapes in the
                same order on every rank.
            weight_version, layout, apply_mode, bucket_bytes, dtype, flush_cache: as for
                :meth:`TrainerClient.sync`, the same on every rank.
            mode: ``"gather"``: per bucket, every rank materialises the bucket's tensors
                (``full_tensor()``, collectively) and rank 0 sends it; ``"direct"``: every rank
                sends its own shards (each ``DTensor``'s local shard, placed by its offsets), no
                all-gather, the engines assemble each tensor from its pieces.
            progress, on_phase: as for :meth:`TrainerClient.sync`; called on rank 0 only.
            delta: as for :meth:`TrainerClient.sync` (``None``: rank 0's client's ``delta`` setting). In the
                ``"gather"`` mode: before Prepare every rank gathers the buckets in lockstep as for a send, and rank
                0 diffs each gathered tensor against its copy of what it last sent (2 bytes per parameter of the
                whole model for bfloat16, on rank 0 alone; at most one gathered bucket held at a time), then runs
                the sync as a single process does (engines behind take it whole, in the same commit; the
                ``delta_fallback`` rules; :attr:`SyncResult.delta` on every rank) and sends from that copy. In the
                ``"direct"`` mode: every rank encodes its own pieces against its own copy of what it last sent
                (2 bytes per parameter of its shards for bfloat16), the ranks exchange the entries' sizes, and each
                sends its own; a rank without that copy (a new process) makes the sync whole. Flattened layout.
            transport: how the bytes travel, the same on every rank: ``"broadcast"`` (default: over the weight-sync
                group, every rank a member) or ``"shared_memory"`` (engines on the ranks' host; no group is formed:
                :mod:`wsync_grpc.transports.shared_memory`): in the ``"gather"`` mode rank 0 packs each gathered
                bucket into its ring of shared memory, which the engines' workers map read-only; in the ``"direct"``
                mode every rank packs its own buckets into a ring of its own (every trainer rank on the engines'
                host) and the workers read each bucket from its sender's ring. Flattened layout only. Never chosen
                by the client itself.

        Returns:
            Rank 0's :class:`SyncResult`, on every rank.

        Raises:
            RanksDisagree: the ranks made different calls (raised on every rank).
            TrainerRankLost: a trainer rank died or became unreachable (on the surviving ranks).
            SyncError: the update failed (on every rank; a failure of a trainer rank is named
                under ``TRAINER`` in ``failures``); rank 0 cancelled it on every engine.
            ValueError: a bad argument (``delta`` with the individual layout; an unknown ``transport``, or
                ``"shared_memory"`` with the individual layout), or (direct mode) shards that do not tile a tensor
                (on every rank).
        """
        c = self._client
        source = ShardedTensors(named_tensors)
        problem, metas, request = "", [], None
        deltas = c.delta if delta is None else delta
        try:  # a bad argument is agreed on too: it fails every rank, not this one alone
            if mode not in SEND_MODES:
                raise ValueError(f"unknown send mode {mode!r}; use one of {', '.join(SEND_MODES)}")
            if deltas and layout != "flattened":
                raise ValueError("a sharded trainer sends deltas in the flattened layout")
            kind = sent_kind(_sent_by(transport, mode, layout))
            topology = SendTopology(mode, self._ranks.size)
            request = kind.create(
                weight_version,
                layout,
                apply_mode,
                bucket_bytes or c.bucket_bytes,
                dtype=dtype,
                flush_cache=flush_cache,
                progress=progress,
                on_phase=on_phase,
                topology=topology,
            )
            metas = [(m.name, str(m.dtype), list(m.shape)) for m in source.metadata()]
        except ValueError as e:
            problem = str(e)
        self._agree(
            "sync",
            {
                "weight version": weight_version,
                "options": [
                    mode,
                    layout,
                    apply_mode,
                    bucket_bytes or c.bucket_bytes,
                    str(dtype),
                    flush_cache,
                    deltas,
                    transport,
                ],
                "client settings": [c.alignment, c.ramp_bytes, c.solo_bytes],
                "tensors (names, dtypes, global shapes)": metas,
                "argument checks": problem,
            },
        )
        if problem or request is None:
            raise ValueError(problem)
        sending: WeightSource = source
        payload: DeltaPayload | None = None  # a direct send's, with deltas on: this rank's pieces, encoded
        if mode == "direct":  # collective: the ranks' pieces (and, with deltas, their entries' sizes), exchanged
            direct = DirectSource(source, self._ranks, self._client.deltas if deltas else None, dtype)
            sending, payload = direct, direct.delta
        elif self._ranks.leader:  # with deltas, rank 0 diffs the buckets every rank gathers with it (their plan)
            sending = LockstepSource(source, self._ranks, lambda: self._whole_plan(source, request))
        if self._follower is None:
            diffed = payload if payload is not None else deltas  # gather mode: diffed by rank 0's client
            result = self._lead(lambda: self._client.run_update(sending, request, delta=diffed))
        else:
            result = follow(self._follower.call(sending, request))  # every round, until rank 0's outcome
            if payload is not None and result is not None:  # rank 0's client moved its own base on
                self._client.deltas.applied(result.weight_version, payload, {})
        assert result is not None  # a sync always has an outcome
        return result

    def _whole_plan(self, source: ShardedTensors, request: BroadcastRequest) -> list[Bucket]:
        """Rank 0: the whole buckets of ``request`` as every other rank plans them (:meth:`Follower.call
        <wsync_grpc.trainer.sharded.follower.Follower.call>`), to gather them in the same order.

        Raises:
            ValueError: a planning error.
        """
        return self._planner.plan(
            source.metadata(), request.bucket_bytes, request.dtype, request.layout, request.topology
        )[0]

    def catch_up(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        mode: SendMode = "gather",
        apply_mode: ApplyMode = "staged",
        transport: TransportName = "broadcast",
    ) -> SyncResult | None:
        """Bring every engine behind (excluded from earlier syncs, restarted, added) to the fleet's version:
        collective, on every rank, as :meth:`sync` is; rank 0's :meth:`TrainerClient.catch_up`.

        Rank 0 finds the engines behind; when the fleet's version came from no checkpoint, the ranks send
        them ``named_tensors`` (this trainer's current weights, as for :meth:`sync`, in ``mode``) in a group
        formed for them alone; the others keep serving, untouched.

        Args:
            named_tensors: as for :meth:`sync`, the same on every rank; ``None`` when the fleet's version
                came from a checkpoint.
            mode, apply_mode, transport: as for :meth:`sync` (``transport``: how ``named_tensors`` travel to the
                engines behind; unused when they read the fleet's checkpoint).

        Returns:
            Rank 0's :class:`SyncResult` of the catch-up, on every rank; ``None`` when no engine was behind.

        Raises:
            as :meth:`sync`; ValueError (on every rank): a bad ``mode``, ``apply_mode`` or ``transport`` (as for
            :meth:`sync`), or engines are behind, the fleet's version came from
            no checkpoint and no ``named_tensors`` were given.
        """
        source = ShardedTensors(named_tensors if named_tensors is not None else [])
        problem, metas, request = "", [], None
        try:
            if mode not in SEND_MODES:
                raise ValueError(f"unknown send mode {mode!r}; use one of {', '.join(SEND_MODES)}")
            sent_by = _sent_by(transport, mode, "flattened")
            topology = SendTopology(mode, self._ranks.size)
            # The fleet's version is rank 0's to know: every rank plans with this request, whose version only
            # rank 0's own request (built by TrainerClient.catch_up) sends.
            request = catch_up_request("catch-up", apply_mode, self._client.bucket_bytes, topology, sent_by)
            metas = [(m.name, str(m.dtype), list(m.shape)) for m in source.metadata()]
        except ValueError as e:
            problem = str(e)
        self._agree(
            "catch_up",
            {
                "options": [mode, apply_mode, transport],
                "tensors (names, dtypes, global shapes)": metas,
                "checks": problem,
            },
        )
        if problem or request is None:
            raise ValueError(problem)
        sending: WeightSource = source
        if mode == "direct" and metas:
            sending = DirectSource(source, self._ranks)  # collective: the ranks' pieces, exchanged
        elif self._ranks.leader:
            sending = LockstepSource(source, self._ranks)
        if self._follower is None:
            given = sending if named_tensors is not None else None
            return self._lead(
                lambda: self._client.catch_up(given, apply_mode=apply_mode, topology=topology, transport=transport)
            )
        return follow(self._follower.call(sending, request))

    def _lead(self, update: Callable[[], SyncResult | None]) -> SyncResult | None:
        """Rank 0: the call itself (its buckets gathered in lockstep, or sent by every rank, as its request's
        topology says); then the outcome to every rank."""
        try:
            result = update()
        except BaseException as e:
            try:
                self._settle()
                OUTCOME.lead(self._ranks, e)
            except Exception as share_error:  # a rank is gone: the update's own error says more
                log.warning("could not tell the other trainer ranks that the sync failed: %s", share_error)
            raise
        OUTCOME.lead(self._ranks, result)
        return result

    def _settle(self) -> None:
        """Rank 0, after a failed sync: wait for the other ranks' direct sends to end (their error is logged)."""
        try:
            self._peers.settle()
        except Exception as e:
            log.warning("another trainer rank's sends failed too: %s", e)

    # ------------------------------------------------------------------ the fleet (rank 0's)

    @property
    def policy(self) -> FleetPolicy:
        """The fleet policy of every sync (rank 0's :attr:`TrainerClient.policy`; under ``exclude`` an engine
        that fails before the commit decision is left out and every rank runs the update again over the
        others); assignable, the same on every rank."""
        return self._client.policy

    @policy.setter
    def policy(self, value: FleetPolicy) -> None:
        self._client.policy = value

    def members(self) -> dict[str, Member]:
        """Rank 0: target -> :class:`~wsync_grpc.trainer.roster.Member` (in sync, behind or excluded), as
        :meth:`TrainerClient.members`. No call is made.

        Raises:
            RuntimeError: on another rank (the roster is rank 0's).
        """
        return self._rank_zero("members").members()

    def add_engine(self, target: str, *, workers: int | None = None) -> Member:
        """Rank 0: make the engine at ``target`` a member from the next sync (:meth:`TrainerClient.add_engine`;
        every rank joins the group re-formed for it at that sync); :meth:`catch_up` brings it to the
        fleet's version at once.

        Raises:
            RuntimeError: on another rank (the roster is rank 0's), or a sync is running.
            ValueError: it is a member already.
        """
        return self._rank_zero("add_engine").add_engine(target, workers=workers)

    def remove_engine(self, target: str) -> LeaveResult | None:
        """Rank 0: forget the member at ``target`` (:meth:`TrainerClient.remove_engine`).

        Raises:
            RuntimeError: on another rank (the roster is rank 0's), or a sync is running.
            KeyError: it is not a member.
        """
        return self._rank_zero("remove_engine").remove_engine(target)

    def _rank_zero(self, call: str) -> TrainerClient:
        if not self._ranks.leader:
            raise RuntimeError(f"{call}() is rank 0's: the fleet's roster lives on trainer rank 0")
        return self._client

    def close(self) -> None:
        """Close this rank's client (rank 0: the engines and the trainer leave the group), its membership
        of the weight-sync group and the control group. Not collective; idempotent."""
        self._client.close()
        if self._follower is not None:
            self._follower.close()
        self._ranks.close()

    def __enter__(self) -> ShardedTrainerClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
