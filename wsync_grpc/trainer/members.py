"""A trainer client's members: who they are, the group they form, adding and removing them between syncs and
bringing those behind to the fleet's version (by broadcast, through shared memory or from the fleet's checkpoint):
:class:`MemberCalls`.

Which engines take part in each update, and why one is left out, is the roster's
(:mod:`wsync_grpc.trainer.roster`); forming their group is the membership's (:mod:`wsync_grpc.trainer.membership`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.topology import SendTopology
from wsync_grpc.group.process_group import WeightSyncGroup
from wsync_grpc.trainer.options import ApplyMode, TransportName, apply_mode_of, transport_of
from wsync_grpc.trainer.parts import ClientParts
from wsync_grpc.trainer.request import DiskRequest, catch_up_request
from wsync_grpc.trainer.results import SyncResult
from wsync_grpc.trainer.roster import FleetPolicy, Member, TargetResolver
from wsync_grpc.trainer.source import NamedTensors, WeightSource
from wsync_grpc.trainer.views import LeaveResult


class MemberCalls(ClientParts):
    """The members of a :class:`~wsync_grpc.trainer.client.TrainerClient` (one of its bases): what they are, and
    the calls that change them between syncs."""

    @property
    def targets(self) -> list[str]:
        """Every engine's address (the client's members, excluded ones too), in rank order."""
        return [e.target for e in self._fleet.members]

    @property
    def policy(self) -> FleetPolicy:
        """The client's fleet policy (each sync may pass its own); assignable."""
        return self._policy

    @policy.setter
    def policy(self, value: FleetPolicy) -> None:
        self._policy = value

    @property
    def resolver(self) -> TargetResolver | None:
        """Where members that stop answering serve now (:data:`~wsync_grpc.trainer.roster.TargetResolver`);
        assignable; ``None`` (default): nowhere else.

        Asked at the status probe before an update under the ``exclude`` policy and at :meth:`catch_up`,
        for the members that did not answer: one found at another address is replaced there, in its rank
        order, behind until it catches up (:mod:`wsync_grpc.trainer.roster`). Set by
        :func:`wsync_grpc.ray.trainer_client` to follow engines that Ray restarts on other ports or nodes.
        """
        return self._roster.resolver

    @resolver.setter
    def resolver(self, value: TargetResolver | None) -> None:
        self._roster.resolver = value

    def members(self) -> dict[str, Member]:
        """target -> :class:`~wsync_grpc.trainer.roster.Member` (in sync, behind or excluded, and why), in
        rank order, as of the last update or status probe; no call is made."""
        return self._roster.members()

    @property
    def owner(self) -> str:
        """The client's name as the engines' owner."""
        return self._fleet.owner

    @property
    def stubs(self) -> dict[str, weight_sync_pb2_grpc.WeightSyncServiceStub]:
        """target -> the generated stub on the client's channel, for calls the client does not wrap (raw protobuf)."""
        return {e.target: e.stub for e in self._fleet.members}

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
        """target -> workers, for the engines taking part, as of the last :meth:`init` (0 before it)."""
        return {e.target: e.workers for e in self._fleet.engines}

    @property
    def rank_offsets(self) -> dict[str, int]:
        """target -> group rank of the first worker of each engine taking part, as of the last :meth:`init`
        (0 before it)."""
        return {e.target: e.rank_offset for e in self._fleet.engines}

    @property
    def world_size(self) -> int:
        """The trainer's rank (1) plus every engine's workers, as of the last :meth:`init` (1 before it)."""
        return self._membership.world_size

    @property
    def port(self) -> int | None:
        """The TCP port of the trainer's store in the current group; ``None`` when not joined."""
        return self._membership.port

    # ------------------------------------------------------------------ membership between syncs

    def add_engine(self, target: str, *, workers: int | None = None) -> Member:
        """Make the engine at ``target`` a member, after every other one (it gets the highest ranks).

        It takes part from the next update (the group is re-formed for it), and is ``"behind"`` until
        then: the next :meth:`sync` of the whole model brings it to the new version with every other
        engine, or :meth:`catch_up` to the current one at once. Its lease is taken with the group.

        Args:
            target: its ``host:port``.
            workers: its worker count; ``None`` asks it at the next init.

        Returns:
            Its :class:`~wsync_grpc.trainer.roster.Member` entry.

        Raises:
            ValueError: it is a member already, or ``workers`` is below 1.
            RuntimeError: a sync is running on this client.
        """
        with self._exclusive():
            return self._roster.add(target, workers)

    def remove_engine(self, target: str) -> LeaveResult | None:
        """Forget the member at ``target`` (e.g. one the fleet policy excluded for good).

        It leaves the client's group (best effort, within 5 s) and its lease is released; the next
        update re-forms the group without it.

        Returns:
            Its :class:`~wsync_grpc.trainer.views.LeaveResult`; ``None`` when it did not answer.

        Raises:
            KeyError: it is not a member.
            RuntimeError: a sync is running on this client.
        """
        with self._exclusive():
            reply = self._roster.remove(target)
        return LeaveResult.from_proto(reply) if reply is not None else None

    def catch_up(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | WeightSource | None = None,
        *,
        apply_mode: ApplyMode = "staged",
        topology: SendTopology | None = None,
        transport: TransportName = "broadcast",
    ) -> SyncResult | None:
        """Bring every member that answers but serves another version than the fleet's to the fleet's version.

        Such members were excluded from earlier updates, restarted with their base weights, or were
        added. They are found by asking every member for its status. When the fleet's version came
        from a checkpoint (:meth:`sync_from_disk`, :meth:`save_and_sync`), they read that checkpoint;
        otherwise ``named_tensors`` (the tensors of the fleet's current version) are sent to them
        alone, by ``transport``: broadcast in a group formed for them (the next :meth:`sync` re-forms it
        over everyone), or through shared memory (no group formed). The others keep serving, untouched.

        Args:
            named_tensors: the current version's tensors, as for :meth:`sync`; needed only when the
                current version was not read from a checkpoint.
            apply_mode: as for :meth:`sync`.
            topology: which trainer ranks send the tensors (``None``: this process); a sharded trainer's
                rank 0 passes its own (:meth:`ShardedTrainerClient.catch_up
                <wsync_grpc.trainer.sharded.ShardedTrainerClient.catch_up>`; shared memory carries its
                ``gather`` topology, not ``direct``).
            transport: how ``named_tensors`` travel, as for :meth:`sync`: ``"broadcast"`` (default) or
                ``"shared_memory"`` (members behind on this host: :mod:`wsync_grpc.transports.shared_memory`) or
                ``"cuda_ipc"`` (tensors on a GPU, members behind on that GPU: :mod:`wsync_grpc.transports.cuda_ipc`).
                Unused when the members read the fleet's checkpoint. Never chosen by the client itself.

        Returns:
            The catch-up's :class:`SyncResult` (over the members that caught up); ``None`` when no
            member was behind (or nothing was published yet).

        Raises:
            ValueError: an unknown ``transport`` or ``apply_mode`` (before any call); members are behind,
                the current version came from no checkpoint, and no ``named_tensors`` were given.
            SyncError: the catch-up failed (the fleet's other engines are untouched).
            RuntimeError: a sync is running on this client.
        """
        sent_by = transport_of(transport)  # the caller's options are refused before any call
        apply_mode_of(apply_mode)
        with self._exclusive():
            late = self._roster.behind()
            version = self._roster.version
            if not late or version is None:
                return None
            checkpoint = self._roster.checkpoint
            if checkpoint is not None:
                disk = DiskRequest.create(checkpoint, version, apply_mode)
                return self._roster.only(late, lambda: self._runner.run(disk))
            if named_tensors is None:
                behind = ", ".join(e.target for e in late)
                raise ValueError(
                    f"{behind} serve(s) another version than {version!r}, which came from no checkpoint: "
                    "pass its tensors to catch_up"
                )
            source = named_tensors if isinstance(named_tensors, WeightSource) else NamedTensors(named_tensors)
            request = catch_up_request(version, apply_mode, self._settings.bucket_bytes, topology, sent_by)
            return self._roster.only(late, lambda: self._runner.run(request, source))
