"""The standalone weight-sync process group, shared by the trainer and the engines.

The group is built from a ``TCPStore`` (served by the trainer, rank 0) under
a ``PrefixStore(group_name)``, with a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) constructed directly. It never creates, replaces
or needs the process's default ``torch.distributed`` group, so it can live
inside an engine that has its own. Collectives are issued on the process-group
object itself (``pg.broadcast``), which is why the group ranks here are group
ranks, never global ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_sync_group"
"""Group name used when the caller leaves it empty."""

DEFAULT_TIMEOUT_S = 120.0
"""Join and per-collective timeout when the caller gives none, in seconds."""


_PARKED: list[Any] = []
"""Process groups that were left while a collective was still posted on them.

Destroying a gloo process group joins its worker threads, which blocks until a
posted receive completes or times out; if that happened in whatever thread
dropped the last reference (a gRPC handler, garbage collection, shutdown), that
thread could stall for the whole group timeout. Such groups are parked here
and released by a reaper thread once their pending collectives have ended
(they end with an error as soon as the peer closes its side, at the latest at
the group timeout)."""


_PRUNE_MIN = 64
"""Completed works are dropped from a group's pending list once it holds this many (or twice the last survivors)."""


def _park(pg: Any, pending: list[dist.Work]) -> None:
    _PARKED.append(pg)

    def reap() -> None:
        for work in pending:
            with contextlib.suppress(Exception):
                work.get_future().wait()
        _PARKED.remove(pg)  # the destructor runs here, with nothing pending

    threading.Thread(target=reap, name="wsync-group-reaper", daemon=True).start()


class GroupError(RuntimeError):
    """A collective failed: a peer died, closed its connection, or the group broke."""


class GroupTimeout(TimeoutError):
    """A join or a collective did not finish by its deadline."""


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
        rank: this member's group rank (0 = trainer).
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
    _pg: Any  # ProcessGroupGloo / ProcessGroupNCCL backend object
    _store: Store
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _destroyed: bool = False
    _pending: list[dist.Work] = field(default_factory=list)
    _prune_at: int = 64

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Post a broadcast of ``tensor`` from group rank ``src``; returns the pending work.

        ``tensor`` must be contiguous and on :attr:`device`. Wait with
        :func:`wait_work`.

        Raises:
            GroupError: the group was destroyed or the broadcast could not be posted.
        """
        if self._destroyed:
            raise GroupError("the weight-sync group was left")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            work: dist.Work = self._pg.broadcast([tensor], opts)
        except RuntimeError as e:
            raise GroupError(f"broadcast could not be posted: {e}") from e
        with self._lock:
            self._pending.append(work)
            if len(self._pending) >= self._prune_at:
                # Amortized: thousands of per-tensor broadcasts may be posted back to back, and
                # scanning every pending one on each post made posting quadratic.
                self._pending = [w for w in self._pending if not w.is_completed()]
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._pending))
        return work

    def destroy(self) -> None:
        """Leave the group. Idempotent.

        Collectives still pending on other threads fail or time out on their
        own; until they have, the process group is parked (see ``_PARKED``).
        """
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            pending = [w for w in self._pending if not w.is_completed()]
            self._pending = []
            pg, self._pg = self._pg, None
        if self.backend == "nccl":
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError) as e:  # pragma: no cover - GPU only
                log.warning("NCCL shutdown: %s", e)
        if pending:
            _park(pg, pending)

    @property
    def sliced_waits(self) -> bool:
        """Whether waits on this group's collectives may be sliced (``wait_work(sliced=True)``): gloo."""
        return self.backend == "gloo"

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` was called."""
        return self._destroyed


WAIT_SLICE_S = 0.05
"""Length of each ``Work.wait`` slice of a sliced wait, in seconds; cancel and deadline are checked between."""


def wait_work(
    work: dist.Work, deadline: float, cancelled: threading.Event | None = None, *, sliced: bool = False
) -> None:
    """Wait for ``work`` until the monotonic ``deadline`` (seconds), or until ``cancelled`` is set.

    Two ways to wait without blocking past the deadline or a cancel:

    - default: a completion callback sets an event, polled every 20 ms. Any
      backend. The callback runs on the collective's own thread, which must
      take the GIL for it: with many collectives back to back that thread
      stalls between them.
    - ``sliced=True`` (gloo): ``Work.wait`` in slices of :data:`WAIT_SLICE_S`;
      a slice that ends first raises and leaves the collective running, and
      nothing runs on the collective's thread. Not for NCCL, whose timed
      wait may abort the communicator.

    Raises:
        GroupTimeout: the deadline passed first.
        GroupError: the collective failed (peer lost) or ``cancelled`` was set.
    """
    if sliced:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupTimeout("the collective did not finish before its deadline")
            try:
                work.wait(datetime.timedelta(seconds=min(WAIT_SLICE_S, left)))
                return
            except RuntimeError:
                if work.is_completed():
                    break  # it ended (perhaps just after the slice did): wait() below tells how
            if cancelled is not None and cancelled.is_set():
                raise GroupError("cancelled")
    else:
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())
        while not done.wait(0.02):
            if cancelled is not None and cancelled.is_set():
                raise GroupError("cancelled")
            if time.monotonic() >= deadline:
                raise GroupTimeout("the collective did not finish before its deadline")
    try:
        work.wait()
    except RuntimeError as e:
        if "timed out" in str(e).lower():  # gloo's own per-collective timeout fired first
            raise GroupTimeout(f"the collective timed out: {_short(e)}") from e
        raise GroupError(f"collective failed: {_short(e)}") from e


def wait_all(
    works: Sequence[dist.Work], deadline: float, cancelled: threading.Event | None = None, *, sliced: bool = False
) -> None:
    """Wait for every work of ``works`` (posted in that order) until the monotonic ``deadline``.

    :func:`wait_work` hands each work a completion callback, which the
    collective's own thread must take the GIL to run: with thousands of small
    per-tensor collectives that stalled the wire between them (measured 2x
    slower than waiting plainly). Here only the last work gets one; the
    earlier ones are checked once it has completed, and any that has not yet
    is waited for with :func:`wait_work` (``sliced`` as there).

    Raises:
        GroupTimeout: the deadline passed first.
        GroupError: a collective failed (peer lost) or ``cancelled`` was set.
    """
    if not works:
        return
    wait_work(works[-1], deadline, cancelled, sliced=sliced)
    for work in works[:-1]:
        if work.is_completed():
            try:
                work.wait()
                continue
            except RuntimeError:
                pass  # failed: let wait_work raise it as GroupError / GroupTimeout
        wait_work(work, deadline, cancelled, sliced=sliced)


def _short(e: BaseException) -> str:
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
    timeout_s: float = DEFAULT_TIMEOUT_S,
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

    Raises:
        ValueError: inconsistent rank/world size/backend/device.
        GroupTimeout: the group did not form within ``timeout_s``.
        GroupError: the store could not be reached or the group broke while forming.
    """
    device = device or torch.device("cpu")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    backend = resolve_backend(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    start = time.monotonic()
    try:
        store: Store = TCPStore(
            master_address,
            master_port,
            world_size if rank == 0 else None,
            rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except RuntimeError as e:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise GroupTimeout(f"no store at {master_address}:{master_port} within {timeout_s:g} s: {_short(e)}") from e
        raise GroupError(f"store at {master_address}:{master_port}: {_short(e)}") from e
    prefix = PrefixStore(group_name or DEFAULT_GROUP_NAME, store)
    remaining = datetime.timedelta(seconds=max(0.1, timeout_s - (time.monotonic() - start)))
    try:
        pg: Any
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix, rank, world_size, remaining)
        else:  # pragma: no cover - needs a GPU
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            # NCCL creates communicators lazily: one tiny collective forms it now,
            # so that Init means "joined".
            probe = torch.zeros(1, device=device)
            pg.broadcast([probe], _bcast_opts(0, timeout)).wait()
    except RuntimeError as e:
        msg = _short(e)
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
    return WeightSyncGroup(rank, world_size, backend, device, timeout_s, pg, store)


def _bcast_opts(src: int, timeout: datetime.timedelta) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = timeout
    return opts
