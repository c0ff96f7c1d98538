"""The standalone weight-sync process group, shared by the trainer and the engines.

The group is built from a ``TCPStore`` (served by the trainer, rank 0) under
a ``PrefixStore(group_name)``, with a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) constructed directly. It never creates, replaces
or needs the process's default ``torch.distributed`` group, so it can live
inside an engine that has its own. Collectives are issued on the process-group
object itself (``pg.broadcast``), which is why the group ranks here are group
ranks, never global ranks.

A trainer of several ranks (``trainer_ranks`` M > 1, each sending its own
buckets) makes the group M broadcast groups, one per trainer rank: trainer
rank r and every worker (group ranks M ..), under the store prefix
``<group_name>/src<r>``, in which trainer rank r is rank 0 and group rank g
of a worker is ``g - M + 1``. A worker is a member of all of them, a trainer
rank of its own only, so no trainer rank ever receives another's bytes and
each sends on its own communicator. With M = 1 the group is one, as it always
was (``wsync.v1.InitRequest.trainer_ranks``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from wsync_grpc.core.errors import GroupError, GroupTimeout
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, Deadline
from wsync_grpc.group.routes import gloo_listen_address

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_sync_group"
"""Group name used when the caller leaves it empty."""


_PARKED: list[list[Any]] = []
"""Process groups (a member's broadcast groups, as one list) that were left while a collective was still posted.

Destroying a gloo process group joins its worker threads, which blocks until a
posted receive completes or times out; if that happened in whatever thread
dropped the last reference (a gRPC handler, garbage collection, shutdown), that
thread could stall for the whole group timeout. Such groups are parked here
and released by a reaper thread once their pending collectives have ended
(they end with an error as soon as the peer closes its side, at the latest at
the group timeout)."""


_PRUNE_MIN = 64
"""Completed works are dropped from a group's pending list once it holds this many (or twice the last survivors)."""


def _park(pgs: list[Any], drain: Callable[[], list[dist.Work]]) -> None:
    """Keep ``pgs`` alive until the works ``drain`` returns (once no post is in progress) have ended."""
    _PARKED.append(pgs)

    def reap() -> None:
        for work in drain():
            with contextlib.suppress(Exception):
                work.get_future().wait()
        _PARKED.remove(pgs)  # the destructors run here, with nothing pending

    threading.Thread(target=reap, name="wsync-group-reaper", daemon=True).start()


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on ``host`` (all interfaces by default): for the trainer's store.

    A ``host`` this process cannot bind to gives a port free on every interface (the store's own
    listen then reports the bad address).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return ``"gloo"`` or ``"nccl"`` for ``backend`` (``""`` = choose by ``device``).

    Raises:
        ValueError: NCCL asked for a non-CUDA device, or gloo for a CUDA one,
            or an unknown backend name.
    """
    if backend == "":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend nccl needs a CUDA device, this worker is on {device}")
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(f"backend gloo receives into CPU tensors, this worker is on {device}")
    return backend


@dataclass
class WeightSyncGroup:
    """One rank's membership of the weight-sync group.

    Attributes:
        rank: this member's group rank (the trainer's ranks first).
        world_size: number of ranks in the group.
        backend: ``"gloo"`` or ``"nccl"``.
        device: the device collectives run on.
        timeout_s: per-collective timeout, in seconds.
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    _pgs: dict[int, tuple[Any, int]]  # sending group rank -> (ProcessGroupGloo/NCCL, its root there)
    _store: Store
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _destroyed: bool = False
    _pending: list[dist.Work] = field(default_factory=list)
    _prune_at: int = 64
    _posting: int = 0  # broadcasts being posted right now (outside the lock)
    _idle: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self._idle = threading.Condition(self._lock)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Post a broadcast of ``tensor`` from group rank ``src`` (a trainer rank); returns the pending work.

        ``tensor`` must be contiguous and on :attr:`device`. Wait with
        :func:`wsync_grpc.group.waits.wait_work`. Safe to call while another
        thread calls :meth:`destroy`: the work posted then is waited for by the
        reaper, never dropped with its process group.

        Raises:
            GroupError: the group was destroyed, this member shares no broadcast group with ``src``,
                or the broadcast could not be posted.
        """
        with self._lock:
            if self._destroyed:
                raise GroupError("the weight-sync group was left")
            if src not in self._pgs:
                raise GroupError(f"group rank {self.rank} receives nothing from group rank {src}")
            (pg, root), self._posting = self._pgs[src], self._posting + 1
        opts = _bcast_opts(root, datetime.timedelta(seconds=self.timeout_s))
        work: dist.Work | None = None
        try:
            work = pg.broadcast([tensor], opts)  # outside the lock: NCCL may block here
        except RuntimeError as e:
            raise GroupError(f"broadcast could not be posted: {e}") from e
        finally:
            del pg  # never the last reference: destroy parks the group until posting is 0
            with self._lock:
                self._posting -= 1
                if work is not None:
                    self._record(work)
                self._idle.notify_all()
        return work

    def forget_completed(self) -> None:
        """Drop the completed broadcasts this member still keeps (and the tensors they hold)."""
        with self._lock:
            self._pending = [w for w in self._pending if not w.is_completed()]

    def _drain(self) -> list[dist.Work]:
        """Once no broadcast is being posted, the works posted so far (forgotten here): for the reaper."""
        with self._idle:
            self._idle.wait_for(lambda: self._posting == 0)
            pending, self._pending = self._pending, []
        return pending

    def _record(self, work: dist.Work) -> None:
        """Add ``work`` to the pending list, dropping the completed ones at its head. Lock held.

        A work holds its tensor until it is dropped, so completed ones go at once: a sender's
        bucket (or a sharded trainer's gathered tensor) must not outlive its broadcast.
        """
        pending = self._pending
        head = 0
        while head < len(pending) and pending[head].is_completed():
            head += 1
        if head:
            del pending[:head]
        pending.append(work)
        if len(self._pending) >= self._prune_at:
            # Amortized: thousands of per-tensor broadcasts may be posted back to back, and
            # scanning every pending one on each post made posting quadratic.
            self._pending = [w for w in self._pending if not w.is_completed()]
            self._prune_at = max(_PRUNE_MIN, 2 * len(self._pending))

    def destroy(self) -> None:
        """Leave the group. Idempotent; never blocks on a collective.

        Collectives still pending (or being posted) on other threads fail or
        time out on their own; until they have, the process group is parked
        (see ``_PARKED``).
        """
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            busy = self._posting > 0 or any(not w.is_completed() for w in self._pending)
            if not busy:
                self._pending = []
            pgs, self._pgs = [pg for pg, _root in self._pgs.values()], {}
        if self.backend == "nccl":
            for pg in pgs:
                try:
                    pg.shutdown()
                except (RuntimeError, AttributeError) as e:  # pragma: no cover - GPU only
                    log.warning("NCCL shutdown: %s", e)
        if busy:
            _park(pgs, self._drain)

    @property
    def sliced_waits(self) -> bool:
        """Whether waits on this group's collectives may be sliced (``waits.wait_work(sliced=True)``): gloo."""
        return self.backend == "gloo"

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` was called."""
        return self._destroyed


def error_summary(e: BaseException) -> str:
    """The first line of ``e``'s message (its type name when empty), at most 400 characters."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:400]


def join_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "",
    device: torch.device | None = None,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    trainer_ranks: int = 1,
) -> WeightSyncGroup:
    """Join (rank > 0) or create (rank 0, which serves the TCP store) the weight-sync group.

    Blocks until every rank has joined, at most ``timeout_s`` seconds. On
    CUDA, the device is made current before the communicator is created (the
    classic deadlock is a worker joining from the wrong device).

    Args:
        master_address: host of the store (the trainer's address).
        master_port: port of the store.
        rank: this member's group rank.
        world_size: number of ranks, trainer included.
        group_name: store prefix, so several groups can share one store.
        backend: ``"gloo"``, ``"nccl"`` or ``""`` (choose by device).
        device: where this member's collectives run; default CPU.
        timeout_s: join deadline and per-collective timeout, in seconds.
        trainer_ranks: how many group ranks the trainer holds (``0 .. trainer_ranks - 1``), each
            sending on its own broadcast group (see the module's docstring); 1: one group.

    Raises:
        ValueError: inconsistent rank/world size/trainer ranks/backend/device.
        GroupTimeout: the group did not form within ``timeout_s``.
        GroupError: the store could not be reached or the group broke while forming.
    """
    device = device or torch.device("cpu")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if not 1 <= trainer_ranks < world_size:
        raise ValueError(f"{trainer_ranks} trainer rank(s) leave no worker in world size {world_size}")
    backend = resolve_backend(backend, device)
    deadline = Deadline(timeout_s)
    start = time.monotonic()
    store = _connect_store(master_address, master_port, rank, world_size, timeout_s)
    name = group_name or DEFAULT_GROUP_NAME
    gloo_address = gloo_listen_address(master_address) if backend == "gloo" else None
    pgs: dict[int, tuple[Any, int]] = {}
    try:
        for src, sub_rank, sub_world, prefix in _broadcast_groups(name, rank, world_size, trainer_ranks):
            pg = _create_backend(
                PrefixStore(prefix, store),
                sub_rank,
                sub_world,
                backend,
                device,
                timeout_s,
                deadline.left(minimum=0.1),
                gloo_address,
            )
            pgs[src] = (pg, 0 if trainer_ranks > 1 else src)
    except RuntimeError as e:
        for pg, _root in pgs.values():
            with contextlib.suppress(Exception):
                if backend == "nccl":
                    pg.shutdown()
        msg = error_summary(e)
        if "timeout" in msg.lower() or "timed out" in msg.lower():
            raise GroupTimeout(
                f"group {group_name!r} did not form within {timeout_s:g} s "
                f"(world size {world_size}; did every rank join?): {msg}"
            ) from e
        raise GroupError(f"group {group_name!r} could not form: {msg}") from e
    log.info(
        "joined weight-sync group %r as rank %d/%d (%s on %s) in %.2f s",
        group_name,
        rank,
        world_size,
        backend,
        device,
        time.monotonic() - start,
    )
    return WeightSyncGroup(rank, world_size, backend, device, timeout_s, pgs, store)


def _broadcast_groups(name: str, rank: int, world_size: int, trainer_ranks: int) -> list[tuple[int, int, int, str]]:
    """The broadcast groups group rank ``rank`` is a member of: ``(sending rank, own rank there, size, prefix)``.

    One trainer rank: the whole group under ``name``. Several: trainer rank r's group (r first,
    then every worker) under ``name/src<r>``; a worker is in every one, in trainer rank order (the
    order in which every worker creates them), a trainer rank in its own.
    """
    if trainer_ranks == 1:
        return [(0, rank, world_size, name)]
    size = world_size - trainer_ranks + 1
    if rank < trainer_ranks:
        return [(rank, 0, size, f"{name}/src{rank}")]
    return [(src, rank - trainer_ranks + 1, size, f"{name}/src{src}") for src in range(trainer_ranks)]


def _connect_store(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float) -> Store:
    """The group's TCP store: served by rank 0 on ``master_address`` only, reached by the others within ``timeout_s`` s.

    Rank 0 listens on ``master_address`` alone (:func:`_listen`), never on every interface, which is
    what ``TCPStore`` does with a port of its own choosing: the store, which would let anyone who
    reaches it join the group, is then only as reachable as the address the trainer chose.

    Raises:
        GroupTimeout: no store answered within ``timeout_s``.
        GroupError: the store could not be reached, or rank 0 cannot listen on ``master_address``. The
            message never repeats what a peer that is not a store answered (Init could otherwise read
            a few bytes of whatever listens at an address of the caller's choosing).
    """
    where = f"{master_address}:{master_port}"
    listen_fd: int | None = None
    inode = 0
    if rank == 0:
        listen_fd = _listen(master_address, master_port)
        inode = os.fstat(listen_fd).st_ino
    try:
        return TCPStore(
            master_address,
            master_port,
            world_size if rank == 0 else None,
            rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
            use_libuv=True,
        )
    except RuntimeError as e:
        if listen_fd is not None:
            _close_unowned(listen_fd, inode)
        log.info("store at %s: %s", where, error_summary(e))  # the details stay in the log of who joins
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise GroupTimeout(
                f"no torch.distributed store answered at {where} within {timeout_s:g} s "
                "(is the trainer running, and is master_address/master_port its store?)"
            ) from e
        raise GroupError(
            f"no torch.distributed store at {where} (the connection failed, or what answered is not a store)"
        ) from e


def _listen(address: str, port: int) -> int:
    """A socket listening on ``address:port`` only (port 0: any free one), as a descriptor for ``TCPStore``.

    ``address`` may be a host name: its first IPv4 address is taken, else its first IPv6 one. The
    descriptor is a duplicate: the store owns it (and closes it) once it was built.

    Raises:
        GroupError: ``address`` does not resolve, is not an address of this host, or the port is taken.
    """
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise GroupError(f"the trainer's store cannot listen on {address}:{port}: {e}") from e
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    error: OSError | None = None
    for family, kind, proto, _name, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
                s.listen(socket.SOMAXCONN)
            except OSError as e:
                error = error or e
                continue
            return os.dup(s.fileno())
    raise GroupError(
        f"the trainer's store cannot listen on {address}:{port} ({error}): master_address must be an address "
        "of the trainer's host that the engines can reach"
    )


def _close_unowned(fd: int, inode: int) -> None:
    """Close ``fd`` after a store failed to start, unless the store closed it already (socket ``inode`` gone)."""
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_ino == inode:
            os.close(fd)


def _create_backend(
    prefix: Store,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    timeout_s: float,
    join_s: float,
    gloo_address: str | None = None,
) -> Any:
    """The ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over ``prefix``, formed within ``join_s`` seconds.

    ``timeout_s`` is the per-collective timeout, in seconds. NCCL creates its
    communicator lazily: one tiny collective forms it here, so that Init means
    "joined". Gloo listens on ``gloo_address`` (:func:`gloo_listen_address`;
    ``None``: torch's default device).

    Raises:
        RuntimeError: the backend did not form (torch's own error).
    """
    if backend == "gloo":
        if gloo_address is None:
            return dist.ProcessGroupGloo(prefix, rank, world_size, datetime.timedelta(seconds=join_s))
        gloo: Any = dist.ProcessGroupGloo  # torch's stubs lack ``_Options`` and the constructor taking it
        opts = gloo._Options()
        opts._devices = [gloo.create_device(hostname=gloo_address)]
        opts._timeout = datetime.timedelta(seconds=join_s)
        return gloo(prefix, rank, world_size, opts)
    return _create_nccl(prefix, rank, world_size, device, datetime.timedelta(seconds=timeout_s))


def _create_nccl(
    prefix: Store, rank: int, world_size: int, device: torch.device, timeout: datetime.timedelta
) -> Any:  # pragma: no cover - needs a GPU
    """A ``ProcessGroupNCCL`` on ``device`` (made current first), its communicator formed by one tiny broadcast."""
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg: Any = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    probe = torch.zeros(1, device=device)
    pg.broadcast([probe], _bcast_opts(0, timeout)).wait()
    return pg


def _bcast_opts(src: int, timeout: datetime.timedelta) -> dist.BroadcastOptions:
    """Options of a broadcast from group rank ``src`` of one tensor, failing after ``timeout``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = timeout
    return opts
