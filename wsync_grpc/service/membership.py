"""The engine's membership of the weight-sync group: Init's parameters, the join of every worker, leave.

Every worker of the engine joins the group at rank ``rank_offset + worker``
(``docs/architecture.md``, "Roles"); the joins run concurrently, because each
one blocks until the whole group has formed. The servicer's lock guards a
:class:`Membership`; :meth:`Membership.join` is called without it (it blocks
for up to the join timeout).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import socket
from collections.abc import Sequence

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import RemoteWorkers
from wsync_grpc.core.errors import GroupTimeout, InvalidArgument, PermissionDenied
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, JOIN_OVERRUN_S, Deadline
from wsync_grpc.group.process_group import DEFAULT_GROUP_NAME, WeightSyncGroup, join_group, resolve_backend
from wsync_grpc.wire.convert import backend_from_proto, backend_to_proto, duration, seconds

log = logging.getLogger(__name__)


def init_params(r: pb.InitRequest, devices: Sequence[torch.device]) -> GroupParams:
    """Validate an Init request for an engine whose workers run on ``devices``.

    Defaults: group name :data:`~wsync_grpc.group.process_group.DEFAULT_GROUP_NAME`,
    backend by device (gloo on CPU, NCCL on CUDA), timeout
    :data:`~wsync_grpc.core.timeouts.DEFAULT_GROUP_TIMEOUT_S`.

    Raises:
        InvalidArgument: MISSING_MASTER_ADDRESS, INVALID_PORT,
            INVALID_RANK_OFFSET, INVALID_WORLD_SIZE (the ranks of the engine's
            workers do not fit), UNKNOWN_ENUM_VALUE (backend), INVALID_BACKEND
            (the backend does not suit the devices, or they need different
            ones), NEGATIVE_TIMEOUT.
    """
    if not r.master_address:
        raise InvalidArgument("MISSING_MASTER_ADDRESS", "master_address is required")
    if not 1 <= r.master_port <= 65535:
        raise InvalidArgument("INVALID_PORT", f"master_port {r.master_port} is not in 1..65535")
    trainer_ranks = r.trainer_ranks or 1
    if r.rank_offset < trainer_ranks:
        raise InvalidArgument(
            "INVALID_RANK_OFFSET",
            f"rank_offset must be at least {trainer_ranks} (the trainer's ranks come first: trainer_ranks)",
        )
    workers = len(devices)
    if r.world_size < r.rank_offset + workers:
        raise InvalidArgument(
            "INVALID_WORLD_SIZE",
            f"world_size {r.world_size} cannot hold ranks {r.rank_offset}..{r.rank_offset + workers - 1} "
            f"of this engine's {workers} worker(s)",
        )
    backend = backend_from_proto(r.backend)
    try:
        backends = {resolve_backend(backend, d) for d in devices}
    except ValueError as e:
        raise InvalidArgument("INVALID_BACKEND", str(e)) from None
    if len(backends) != 1:
        raise InvalidArgument("INVALID_BACKEND", "the workers' devices need different backends")
    return GroupParams(
        master_address=r.master_address,
        master_port=r.master_port,
        rank_offset=r.rank_offset,
        world_size=r.world_size,
        group_name=r.group_name or DEFAULT_GROUP_NAME,
        backend=backends.pop(),
        timeout_s=seconds(r.timeout, DEFAULT_GROUP_TIMEOUT_S),
        trainer_ranks=trainer_ranks,
    )


IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class MasterAllowList:
    """The networks Init may name the trainer's store in (``wsync serve --allow-master CIDR``).

    Init makes the engine's workers connect to the ``master_address:master_port`` the caller names;
    an engine whose control port others reach would otherwise open connections to any host and port
    on their behalf. With networks given, the address (a host name: every address it resolves to)
    must lie in one of them, and the workers then connect to the address that was checked, not to a
    name that could resolve elsewhere by the time they connect.

    Args:
        networks: CIDR networks (``10.0.0.0/8``, ``fd00::/8``; a lone address is its own /32 or /128).
            Empty (the default): any address, as before an allow-list existed; an engine whose control
            port is exposed beyond loopback should name its trainers' networks.

    Raises:
        ValueError: a network that is not a CIDR network or address.
    """

    def __init__(self, networks: Sequence[str] = ()) -> None:
        parsed: list[IpNetwork] = []
        for n in networks:
            try:
                parsed.append(ipaddress.ip_network(n.strip(), strict=False))
            except ValueError as e:
                raise ValueError(f"allowed master network {n!r} is not a CIDR network: {e}") from None
        self.networks: tuple[IpNetwork, ...] = tuple(parsed)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def allows(self, address: str) -> bool:
        """Whether the IP address ``address`` lies in one of the networks (always, with none)."""
        if not self.networks:
            return True
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in self.networks)

    def check(self, params: GroupParams) -> GroupParams:
        """``params`` with the master address checked, resolved to the IP address to connect to.

        Nothing connects to the master here; a host name is resolved (DNS) to check its addresses.
        With no networks, ``params`` is returned as it is.

        Raises:
            PermissionDenied: MASTER_NOT_ALLOWED, the address (or one a name resolves to) is outside
                every network, or a name does not resolve.
        """
        if not self.networks:
            return params
        host = params.master_address.strip("[]")
        try:
            infos = socket.getaddrinfo(host, params.master_port, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        addresses = list(dict.fromkeys(str(i[4][0]) for i in infos))
        refused = [a for a in addresses if not self.allows(a)]
        if not addresses or refused:
            shown = repr(params.master_address[:200])
            if not addresses:
                what = f"master_address {shown} does not resolve to an address: it is outside the networks"
            elif refused[0] == host:
                what = f"master_address {shown} is outside the networks"
            else:
                what = f"master_address {shown} resolves to {refused[0]}, outside the networks"
            allowed = ", ".join(str(n) for n in self.networks)
            raise PermissionDenied(
                "MASTER_NOT_ALLOWED",
                f"{what} this engine may join a group in ({allowed}; wsync serve --allow-master)",
            )
        first = sorted(addresses, key=lambda a: ipaddress.ip_address(a).version)[0]
        return dataclasses.replace(params, master_address=first)


def group_info(params: GroupParams | None, devices: Sequence[str]) -> pb.GroupInfo:
    """The ``wsync.v1.GroupInfo`` of a group joined with ``params`` by workers on ``devices``; empty for ``None``."""
    if params is None:
        return pb.GroupInfo()
    return pb.GroupInfo(
        group_name=params.group_name,
        world_size=params.world_size,
        ranks=[params.rank_offset + i for i in range(len(devices))],
        backend=backend_to_proto(params.backend),
        master_address=params.master_address,
        master_port=params.master_port,
        devices=list(devices),
        timeout=duration(params.timeout_s),
        trainer_ranks=params.trainer_ranks,
    )


class Membership:
    """The engine's workers' memberships of one weight-sync group, at most one at a time.

    Not thread-safe: the servicer's lock guards it, except around :meth:`join`.

    Args:
        devices: the workers' devices, in worker order.
        remote: the engine, when its workers are other processes that join themselves
            (:class:`~wsync_grpc.core.engine.RemoteWorkers`); ``None`` to join from here.

    Attributes:
        params: the joined group's parameters; ``None`` when not a member.
        groups: one membership per worker, in worker order; empty when not a member.
    """

    def __init__(self, devices: Sequence[torch.device], remote: RemoteWorkers | None = None) -> None:
        self.devices = list(devices)
        self.remote = remote
        self.params: GroupParams | None = None
        self.groups: list[WeightSyncGroup] = []

    def params_of(self, request: pb.InitRequest) -> GroupParams:
        """Validate ``request`` for these workers (see :func:`init_params`)."""
        return init_params(request, self.devices)

    @property
    def group_timeout_s(self) -> float:
        """The joined group's per-collective timeout, in seconds; the default one when not a member."""
        return self.params.timeout_s if self.params is not None else DEFAULT_GROUP_TIMEOUT_S

    def info(self) -> pb.GroupInfo:
        """The ``wsync.v1.GroupInfo`` of the joined group (empty when not a member)."""
        return group_info(self.params, [str(d) for d in self.devices])

    def join(self, p: GroupParams) -> list[WeightSyncGroup]:
        """Join every worker concurrently; return their memberships (not yet recorded: see :meth:`joined`).

        Bounded by ``p.timeout_s`` plus :data:`~wsync_grpc.core.timeouts.JOIN_OVERRUN_S`
        even when a join overruns its own timeout (torch's store connect
        retries can): such a join is left to finish in the background, and
        the group it forms, if any, is destroyed. When one worker fails, the
        memberships of the others are destroyed.

        Raises:
            GroupTimeout: the group did not form in time.
            GroupError: the store could not be reached or the group broke while forming.
            ValueError: inconsistent ranks, backend or device.
        """
        if self.remote is not None:
            self.remote.join_workers(p)
            return []
        ex = concurrent.futures.ThreadPoolExecutor(len(self.devices), thread_name_prefix="wsync-join")
        deadline = Deadline(p.timeout_s + JOIN_OVERRUN_S)
        try:
            futures = [
                ex.submit(
                    join_group,
                    master_address=p.master_address,
                    master_port=p.master_port,
                    rank=p.rank_offset + i,
                    world_size=p.world_size,
                    group_name=p.group_name,
                    backend=p.backend,
                    device=d,
                    timeout_s=p.timeout_s,
                    trainer_ranks=p.trainer_ranks,
                )
                for i, d in enumerate(self.devices)
            ]
            return _collect(futures, deadline, p.timeout_s)
        finally:
            ex.shutdown(wait=False)

    def joined(self, p: GroupParams, groups: list[WeightSyncGroup]) -> None:
        """Record a successful :meth:`join`."""
        self.params = p
        self.groups = groups

    def leave(self) -> bool:
        """Destroy every worker's membership; return whether there was any. Idempotent."""
        was_member = self.params is not None
        for g in self.groups:
            g.destroy()
        if self.remote is not None and was_member:
            try:
                self.remote.leave_workers()
            except Exception as e:
                log.warning("the workers could not leave the group: %s", e)
        self.groups = []
        self.params = None
        return was_member


def _collect(
    futures: list[concurrent.futures.Future[WeightSyncGroup]], deadline: Deadline, timeout_s: float
) -> list[WeightSyncGroup]:
    """The groups of every join by ``deadline``, or the first error (the groups formed are destroyed)."""
    groups: list[WeightSyncGroup] = []
    error: BaseException | None = None
    for f in futures:
        try:
            groups.append(f.result(timeout=deadline.left()))
        except BaseException as e:
            failure: BaseException = e
            if not f.done():  # the join overran its own timeout: give up on it
                failure = GroupTimeout(f"the group did not form within {timeout_s:g} s")
                f.add_done_callback(_destroy_late_group)
            error = error or failure
    if error is not None:
        for g in groups:
            g.destroy()
        raise error
    return groups


def _destroy_late_group(f: concurrent.futures.Future[WeightSyncGroup]) -> None:
    """Leave a group whose join finished after Init gave up on it."""
    if not f.cancelled() and f.exception() is None:
        f.result().destroy()
