"""A worker's flat receive buffers, reused across buckets and updates."""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Flat ``uint8`` receive buffers of one worker, reused across buckets and updates.

    On CPU a fresh multi-MB buffer is fresh memory from the OS: the first
    write into it page-faults every 4 KiB, which makes receiving into it much
    slower than into memory already touched. The pool hands out the smallest
    free buffer that is large enough and takes buffers back after they were
    applied (streaming) or after Complete (staged).

    What it holds stays bounded by what the last update needed: at the end
    of an update (:meth:`trim`) it keeps only the buffers that update used
    (after a delta on CPU, also those the last whole update kept: then a
    whole update's buffers plus a delta's), and a buffer left over from an
    earlier update that is too small for a request is released before a new
    one is allocated. With streaming apply
    the receiver asks for buffers of the update's largest bucket
    (``capacity``), so that two buffers serve every bucket of the update
    however their sizes differ.

    Args:
        device: where buffers live.
        keep: keep the buffers an update used for the next one (True), or
            drop every free buffer when :meth:`trim` is called at the end of
            each update (False). Keeping costs memory between syncs: about
            two buckets with streaming apply, the update's size with staged
            apply.
    """

    def __init__(self, device: torch.device, keep: bool) -> None:
        self.device = device
        self.keep = keep
        self._free: dict[int, list[torch.Tensor]] = {}  # free buffers by size in bytes, oldest first
        self._free_ptrs: set[int] = set()  # data_ptr of every free buffer
        self._used: set[int] = set()  # data_ptr of every buffer handed out since the last trim
        self._kept: set[int] = set()  # data_ptr of every free buffer the last trim kept
        self._lock = threading.Lock()

    def _pop(self, nbytes: int) -> torch.Tensor:
        """Take the oldest free buffer of exactly ``nbytes`` bytes (one must be free); the caller holds the lock."""
        same = self._free[nbytes]
        buf = same.pop(0)
        if not same:
            del self._free[nbytes]
        self._free_ptrs.discard(buf.data_ptr())
        self._used.add(buf.data_ptr())
        return buf

    def _keep_only(self, keep: set[int] | None) -> None:
        """Drop the free buffers whose data_ptr is not in ``keep`` (``None``: every one); the caller holds the lock."""
        kept = {n: [b for b in bufs if keep is not None and b.data_ptr() in keep] for n, bufs in self._free.items()}
        self._free = {n: bufs for n, bufs in kept.items() if bufs}
        self._free_ptrs = {b.data_ptr() for bufs in self._free.values() for b in bufs}

    def take(self, nbytes: int, capacity: int = 0) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (its first ``nbytes`` are returned as a view).

        Args:
            nbytes: bytes needed, in bytes.
            capacity: when no free buffer is large enough, allocate
                ``max(nbytes, capacity)`` bytes, so that the buffer also
                fits the larger buckets still to come.
        """
        with self._lock:
            fits = [n for n in self._free if n >= nbytes]
            if fits:
                return self._pop(min(fits))[:nbytes]
            # Leftovers of an earlier update too small for this one: give their memory back first.
            self._keep_only(self._used)
        buf = torch.empty(max(nbytes, capacity), dtype=torch.uint8, device=self.device)
        with self._lock:
            self._used.add(buf.data_ptr())
        return buf[:nbytes]

    def take_exact(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` bytes, of its own (not a view of a larger one).

        For a tensor an engine will serve from the buffer itself
        (:class:`~wsync_grpc.core.engine.StorageSwap`): a larger buffer would stay
        allocated behind it.
        """
        with self._lock:
            if nbytes in self._free:
                return self._pop(nbytes)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            self._used.add(buf.data_ptr())
        return buf

    def give(self, buf: torch.Tensor, *, used: bool = False) -> None:
        """Return a buffer (or a view of one) for reuse.

        Args:
            used: count it as used by this update, so that :meth:`trim` keeps
                it (memory an engine gave back in exchange for a buffer).
        """
        base = buf if buf._base is None else buf._base
        ptr = base.data_ptr()
        with self._lock:
            if ptr not in self._free_ptrs:
                self._free.setdefault(base.numel(), []).append(base)
                self._free_ptrs.add(ptr)
            if used:
                self._used.add(ptr)

    def trim(self, keep_earlier: bool = False) -> None:
        """End of an update: keep only the free buffers it used (none unless the pool keeps them).

        Args:
            keep_earlier: also keep, in a CPU pool, the free buffers the last trim kept: at the end of a delta
                update, whose buckets and rebuilt tensors differ from a whole update's, the whole update's
                receive buffers stay for the next one (which would otherwise page-fault fresh memory of the
                update's size); what the pool holds is then bounded by a whole update's buffers plus a delta's.
        """
        with self._lock:
            keep = self._used if self.keep else None
            if keep is not None and keep_earlier and self.device.type == "cpu":
                keep = keep | self._kept
            self._keep_only(keep)
            self._kept = set(self._free_ptrs)
            self._used = set()

    @property
    def free_bytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(n * len(bufs) for n, bufs in self._free.items())
