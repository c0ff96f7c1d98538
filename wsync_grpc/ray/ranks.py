"""Trainer ranks as Ray actors: a sharded trainer forms its process group and its client through Ray.

A sharded trainer (FSDP2, ZeRO-3) runs one process per rank; on Ray, one actor per rank, owned by the driver
(or by the framework's own worker group). Its ranks need rank 0's address twice: to form their own
``torch.distributed`` group, and for the engines, which reach rank 0's store of the weight-sync group
(``master_address``). Here Ray carries it, not the user:

- the driver makes a :class:`TrainerRendezvous` (:meth:`TrainerRendezvous.create`: a small actor of its own)
  and passes it, pickled, to every rank's actor;
- each rank's actor calls :func:`join_trainer_group`: rank 0 opens a ``TCPStore`` listening on its node's IP
  alone (``ray.util.get_node_ip_address()``, never every interface) on a port the kernel picks (no race for a
  port chosen in advance), and publishes that address and port through the rendezvous; the other ranks wait
  for them there; every rank then initializes ``torch.distributed`` (gloo by default) over that store;
- each rank's actor builds its :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient` with
  :func:`sharded_trainer_client`, from the engines' handles (:class:`~wsync_grpc.ray.handles.EngineHandle`)
  and rank 0's address; rank 0's client follows engines that Ray restarts elsewhere
  (a :class:`~wsync_grpc.ray.handles.HandleResolver`), as :func:`~wsync_grpc.ray.handles.trainer_client` does.

The driver then runs "a train step on every rank, then a sync on every rank" by calling the actors' methods
together (``ray.get([r.step.remote() for r in ranks])``): the client's calls are collective.

What travels through Ray: the rendezvous handle, rank 0's address and port (a string and a number), the
engine handles. The weights travel over the weight-sync group and the ``wsync.v1`` calls over gRPC, never
through Ray.

Units: times in seconds.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore  # torch.distributed re-exports them untyped

from wsync_grpc.ray.handles import DEFAULT_RESOLVE_TIMEOUT_S, EngineHandle, HandleResolver, handles_token
from wsync_grpc.trainer.sharded import ShardedTrainerClient

__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "TrainerRendezvous", "join_trainer_group", "sharded_trainer_client"]

log = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 120.0
"""How long a rank waits for rank 0's address and for every rank to join the group, in seconds."""


class _Rendezvous:
    """The rendezvous actor (async: a rank waiting for rank 0's address blocks no other call)."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._address: tuple[str, int] | None = None
        self._published = asyncio.Event()

    def world_size(self) -> int:
        return self._world_size

    def publish(self, host: str, port: int) -> None:
        self._address = (host, port)
        self._published.set()

    async def address(self) -> tuple[str, int]:
        await self._published.wait()
        assert self._address is not None
        return self._address


@dataclass(frozen=True)
class TrainerRendezvous:
    """Where a trainer's ranks learn rank 0's address: a small Ray actor, and this picklable handle on it.

    Make one per trainer (per process group formed) on the driver, with :meth:`create`, and pass it to every
    rank's actor, which calls :func:`join_trainer_group` with it. A trainer formed again (new rank actors after
    one died) needs a new one: rank 0 publishes once.

    Attributes:
        actor: Ray's handle on the rendezvous actor (owned by the process that created it, and ending with it).
        world_size: how many ranks the trainer has.
    """

    actor: Any
    world_size: int

    @classmethod
    def create(cls, world_size: int, *, name: str | None = None) -> TrainerRendezvous:
        """A new rendezvous for ``world_size`` ranks (an actor taking no CPU; call where Ray is initialized).

        Args:
            world_size: the trainer's ranks.
            name: the actor's name (``None``: ``wsync-rendezvous-<random>``), in the caller's namespace.

        Raises:
            ValueError: ``world_size`` below 1.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        remote = ray.remote(_Rendezvous).options(num_cpus=0, name=name or f"wsync-rendezvous-{uuid.uuid4().hex[:12]}")
        return cls(remote.remote(world_size), world_size)

    def publish(self, host: str, port: int, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
        """Rank 0: say where its store serves (``host:port``).

        Raises:
            TimeoutError: the rendezvous actor did not answer within ``timeout_s`` seconds.
        """
        try:
            ray.get(self.actor.publish.remote(host, port), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"the trainer's rendezvous did not answer within {timeout_s:g} s") from exc

    def address(self, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> tuple[str, int]:
        """Rank 0's store, ``(host, port)``; waits until rank 0 published it.

        Raises:
            TimeoutError: rank 0 did not publish within ``timeout_s`` seconds.
        """
        try:
            host, port = ray.get(self.actor.address.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"trainer rank 0 did not publish its address within {timeout_s:g} s") from exc
        return str(host), int(port)


def join_trainer_group(
    rendezvous: TrainerRendezvous,
    rank: int,
    *,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
) -> str:
    """Form the trainer's default ``torch.distributed`` group from a rank's actor; return rank 0's address.

    Collective: every rank ``0..world_size-1`` calls it, each in its own actor. Rank 0 opens a ``TCPStore`` on
    a free port of its node (the kernel picks it) and publishes its node's IP and the port through
    ``rendezvous``; the other ranks wait for them. Every rank then calls
    ``torch.distributed.init_process_group(backend, store=..., rank=rank, world_size=...)``.

    Gloo picks the network interface of the host's name; where that is not the cluster's network, set
    ``GLOO_SOCKET_IFNAME`` in the actors' environment (``runtime_env``).

    Args:
        rendezvous: the trainer's rendezvous (the same for every rank).
        rank: this actor's rank.
        backend: ``torch.distributed``'s backend (``"gloo"``; ``"nccl"`` on GPUs).
        timeout_s: how long to wait for rank 0's address, and the process group's own timeout, in seconds.

    Returns:
        Rank 0's node IP: the ``master_address`` of :func:`sharded_trainer_client` (where the engines reach
        rank 0's store of the weight-sync group).

    Raises:
        ValueError: ``rank`` outside ``0..world_size-1``, or ``torch.distributed`` already initialized here.
        TimeoutError: rank 0 did not publish its address within ``timeout_s`` seconds.
        OSError: rank 0 cannot listen on its node's IP.
        RuntimeError, DistStoreError: the store or the group could not be formed (a rank that never joined
            fails the others after ``timeout_s``).
    """
    world = rendezvous.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process")
    timeout = datetime.timedelta(seconds=timeout_s)
    store: Store
    if rank == 0:
        host = str(ray.util.get_node_ip_address())
        fd, port = _listen(host)
        store = TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
        rendezvous.publish(host, port, timeout_s)
    else:
        host, port = rendezvous.address(timeout_s)
        store = TCPStore(host, port, None, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    log.info("trainer rank %d of %d joined the group of rank 0 at %s:%d (%s)", rank, world, host, port, backend)
    return host


def _listen(host: str) -> tuple[int, int]:
    """A socket listening on ``host`` alone, on a port the kernel picks: ``(descriptor, port)``; the descriptor is
    a duplicate, which the store owns once built.

    Raises:
        OSError: ``host`` is not an address of this node.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen(socket.SOMAXCONN)
        port: int = s.getsockname()[1]
        return os.dup(s.fileno()), port


def sharded_trainer_client(
    handles: Sequence[EngineHandle],
    *,
    master_address: str,
    resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
    **kwargs: Any,
) -> ShardedTrainerClient:
    """This rank's :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient` over the handles' engines.

    Collective, as the client is: every rank of the trainer's group calls it with the same handles, after its
    ``torch.distributed`` group is formed (:func:`join_trainer_group`, or the framework's own). The members are
    the handles' targets, in their order; on rank 0 (the engines' owner, where the roster lives) the client's
    :attr:`~wsync_grpc.trainer.client.TrainerClient.resolver` is a
    :class:`~wsync_grpc.ray.handles.HandleResolver`, so that an engine Ray restarted on a new port or node is
    found at the status probe of the next sync under ``FleetPolicy.exclude(...)`` or at ``catch_up``.

    Args:
        handles: the engines' handles (e.g. from :func:`~wsync_grpc.ray.placement.launch_engines`), the same on
            every rank.
        master_address: rank 0's address, which the engines reach (:func:`join_trainer_group` returns it; a
            framework that formed its group itself passes its rank 0's node IP, e.g. its ``MASTER_ADDR``).
        resolve_timeout_s: how long rank 0's resolver waits for restarting actors, in seconds.
        kwargs: :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient`'s keywords (``trainer_group``,
            ``policy``, the :class:`~wsync_grpc.trainer.client.TrainerClient` settings); ``token`` defaults to
            the handles' token.

    Raises:
        ValueError: no handles; handles with different tokens; as
            :class:`~wsync_grpc.trainer.sharded.ShardedTrainerClient` (``torch.distributed`` not initialized,
            a bad option).
    """
    kwargs.setdefault("token", handles_token(handles))
    client = ShardedTrainerClient([h.target for h in handles], master_address=master_address, **kwargs)
    if client.rank == 0:
        client.client.resolver = HandleResolver(handles, resolve_timeout_s)
    return client
