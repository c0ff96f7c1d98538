"""The shared-memory transport's zero-copy buckets: the trainer's own shared-memory storages, read by the engines.

A trainer whose tensors already live in shared memory (``Module.share_memory()``, ``Tensor.share_memory_()``:
torch's ``file_descriptor`` sharing strategy, the default on Linux) need not pack them into the ring: when every
tensor of a bucket is such a tensor (CPU, contiguous, already in the wire dtype and planned shape, whole, no delta
entry), the trainer hands each engine worker read-only descriptors of those storages and, per tensor, where its
bytes are (:class:`StorageRead`: which storage, the byte offset in it, the byte offset in the bucket, the length);
each worker reads them straight into its own receive buffer at the bucket's flattened offsets and zeroes the padding
between them, so what it holds is byte for byte what a packed bucket holds, and the digest is the same. One copy in
all instead of two. Buckets that do not qualify go through the ring as before, in the same update.

Safety. Such a storage is not one of the transport's sealed memfds: its owner may truncate it at any time. The
engine therefore never maps it (a page vanishing under a mapping is a ``SIGBUS``: a crash), it reads it with
:func:`os.preadv` after checking the descriptor is a regular file (a ``/dev/shm`` file or a memfd) of at least
``offset + length`` bytes (:func:`os.fstat`); a read that comes short (the storage shrank meanwhile) or fails is an
error (DATA_LOSS SHARED_MEMORY_STORAGE), never a crash, and the update is abandoned as for any transport error.
The descriptors are read-only: torch's own descriptor of a storage is read-write, so the trainer re-opens it
through ``/proc/self/fd/N`` with ``O_RDONLY`` and hands over only that one (closed once sent); an engine that
receives a descriptor open for writing anyway re-opens it read-only the same way and closes the other. An engine
worker holds at most :data:`MAX_FDS` of them at a time, and closes them once its bucket is read.

Which storages qualify (:meth:`StorageFds.plan`): ``tensor.is_shared()`` with torch's sharing strategy
``file_descriptor``; torch gives its descriptor (``UntypedStorage._share_fd_cpu_()``, which for a storage already
in shared memory only returns the descriptor and the size it keeps: it is called only on such storages, and only
under that strategy, since on others it would move the storage); the storage's bytes start at byte 0 of that file,
which the trainer checks by comparing the first bytes read through the descriptor with its memory. Anything else
(a ``file_system``-strategy storage, a file-backed ``from_file`` storage, a check that fails) makes the bucket go
through the ring.

Wire messages, after the bucket's
:data:`~wsync_grpc.transports.shared_memory.protocol.BUCKET` message naming slot :data:`STORAGE_SLOT`: one or more
groups, each :data:`STORAGES` (bucket index, descriptors, reads, last) with the descriptors attached
(``SCM_RIGHTS``), then that many :data:`READ` records. The reads of every group, in order, are the bucket's tensors
of at least one byte, in bucket order, exactly (the engine checks it). Offered only when the Prepare's handle says
so (``SharedMemoryHandle.storages``; the grant's magic then is
:data:`~wsync_grpc.transports.shared_memory.protocol.MAGIC_STORAGES`, so an engine that does not know it refuses
the grant before any byte is read).

Units: sizes and offsets in bytes, times in seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from wsync_grpc.core.digests import BucketHasher, Digest
from wsync_grpc.core.errors import DataLoss, InvalidArgument
from wsync_grpc.core.layout import Bucket, TensorSlot
from wsync_grpc.transports.shared_memory.protocol import Closed, recv_exact, recv_fds

log = logging.getLogger(__name__)

STORAGE_SLOT = 0xFFFFFFFF
"""The slot a :data:`~wsync_grpc.transports.shared_memory.protocol.BUCKET` message names for a bucket sent as
storage reads (no slot of the ring)."""

MAX_FDS = 64
"""The most descriptors one :data:`STORAGES` group carries (and an engine worker holds at a time)."""

STORAGES = struct.Struct("<QIII")
"""trainer -> engine worker, with the group's descriptors attached: (bucket index, descriptors, reads, last: 1 on
the bucket's last group, else 0)."""

READ = struct.Struct("<IQQQ")
"""trainer -> engine worker, after :data:`STORAGES`: (descriptor index in the group, byte offset in that storage,
byte offset in the bucket, length in bytes)."""

READ_THREADS = 2
"""Threads an engine worker reads a bucket's storages with (a kernel copy runs on the reading thread: one thread
reads about 3.5 GB/s from shared memory on the benchmark's host, two about twice that)."""

CHUNK_BYTES = 8 << 20
"""Reads are cut in pieces of at most this many bytes, shared out between the :data:`READ_THREADS` threads."""

CHECK_BYTES = 64
"""How many first bytes of a storage the trainer reads back through its descriptor to check they are its memory."""


@dataclass(frozen=True)
class StorageRead:
    """Where one tensor's bytes are: ``nbytes`` bytes at ``storage_offset`` of storage ``storage`` go to
    ``bucket_offset`` of the bucket.

    Attributes:
        storage: the storage's index (in :attr:`StorageBucket.fds`, or in a group on the wire).
        storage_offset: where the bytes start in the storage, in bytes.
        bucket_offset: where they go in the bucket's flat buffer, in bytes.
        nbytes: how many, in bytes (at least 1).
    """

    storage: int
    storage_offset: int
    bucket_offset: int
    nbytes: int


@dataclass
class StorageBucket:
    """A bucket the trainer sends as storage reads (see the module).

    Attributes:
        bucket: the bucket.
        fds: the storages' descriptors, torch's own (read-write; never closed here: torch keeps them).
        reads: one per tensor of the bucket of at least one byte, in bucket order.
        tensors: the tensors by slot name (hashed from the trainer's memory when digests follow).
    """

    bucket: Bucket
    fds: list[int]
    reads: list[StorageRead]
    tensors: Mapping[str, torch.Tensor] = field(repr=False)

    def digest(self) -> Digest:
        """The bucket's digest, hashed from the tensors' memory with zero padding: that of the packed bucket."""
        h = BucketHasher()
        end = 0
        for t in self.bucket.tensors:
            if t.offset > end:
                h.zeros(t.offset - end)
            if t.nbytes and t.end > end:
                h.update(self.tensors[t.name])
            end = max(end, t.end)
        return h.digest()

    def groups(self) -> Iterator[tuple[list[int], list[StorageRead]]]:
        """The wire groups, in bucket order: (at most :data:`MAX_FDS` descriptors, the reads that use them, with
        storage indices into that list); a storage used again after a group was cut is sent again."""
        fds: list[int] = []
        local: dict[int, int] = {}
        reads: list[StorageRead] = []
        for r in self.reads:
            if r.storage not in local:
                if len(fds) == MAX_FDS:
                    yield fds, reads
                    fds, local, reads = [], {}, []
                local[r.storage] = len(fds)
                fds.append(self.fds[r.storage])
            reads.append(StorageRead(local[r.storage], r.storage_offset, r.bucket_offset, r.nbytes))
        yield fds, reads


# ----------------------------------------------------------------------------- the trainer's half


def _plain(src: torch.Tensor, t: TensorSlot) -> bool:
    """Whether ``src`` is slot ``t``'s bytes as they lie: a whole tensor on CPU, strided, contiguous, in the wire
    dtype and the planned shape, in shared memory."""
    return (
        t.delta is None
        and t.piece is None
        and src.device.type == "cpu"
        and src.dtype == t.dtype
        and tuple(src.shape) == t.shape
        and src.layout == torch.strided
        and not src.is_quantized
        and not src.is_conj()
        and not src.is_neg()
        and src.is_contiguous()
        and bool(src.is_shared())  # type: ignore[no-untyped-call]
    )


def may_read(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``bucket`` (of ``tensors``, by slot name) lies in shared memory as the bucket carries
    it (:func:`_plain`), with at least one byte to read: a cheap look, no descriptor asked for
    (:meth:`StorageFds.plan` checks the descriptors).

    Raises:
        KeyError: a slot missing from ``tensors``.
    """
    return all(_plain(tensors[t.name].detach(), t) for t in bucket.tensors) and any(t.nbytes for t in bucket.tensors)


class StorageFds:
    """One update's trainer-side look-up of storages' descriptors (torch's, kept by torch), checked once each.

    :meth:`plan` tells whether a bucket goes as storage reads.
    """

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int], int | None] = {}  # (data pointer, bytes) -> torch's descriptor, or None

    def fd_of(self, storage: torch.UntypedStorage) -> int | None:
        """Torch's descriptor of ``storage`` (a CPU storage in shared memory), once checked; ``None`` when it has
        none that holds its bytes from byte 0 (see the module): the bucket then goes through the ring."""
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._fds:
            self._fds[key] = self._check(storage)
        return self._fds[key]

    @staticmethod
    def _check(storage: torch.UntypedStorage) -> int | None:
        strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
        if strategy != "file_descriptor" or not storage.is_shared():
            return None  # under another strategy, _share_fd_cpu_ would move the storage into a new segment
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        try:
            fd, size = storage._share_fd_cpu_()  # type: ignore[attr-defined]
        except (RuntimeError, OSError) as e:
            log.debug("a shared storage gives no descriptor (%s): its bucket goes through the ring", e)
            return None
        if storage.data_ptr() != ptr:  # torch moved it after all: still shared, but its descriptor is new
            log.warning("torch moved a shared storage into a new segment while its descriptor was asked for")
        fd = int(fd)
        try:
            st = os.fstat(fd) if fd >= 0 else None
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < nbytes or int(size) < nbytes:
            return None
        k = min(CHECK_BYTES, nbytes)
        try:
            ok = os.pread(fd, k, 0) == ctypes.string_at(storage.data_ptr(), k)
        except OSError:
            ok = False
        return fd if ok else None

    def plan(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> StorageBucket | None:
        """``bucket`` as storage reads, when every one of its tensors qualifies (see the module); ``None``
        otherwise (it is packed into the ring).

        Raises:
            KeyError: a slot missing from ``tensors``.
        """
        fds: list[int] = []
        index: dict[int, int] = {}
        reads: list[StorageRead] = []
        for t in bucket.tensors:
            src = tensors[t.name].detach()
            if not _plain(src, t):
                return None
            if not t.nbytes:
                continue
            storage = src.untyped_storage()
            fd = self.fd_of(storage)
            start = int(src.storage_offset()) * src.element_size()
            if fd is None or start + t.nbytes > storage.nbytes():
                return None
            if fd not in index:
                index[fd] = len(fds)
                fds.append(fd)
            reads.append(StorageRead(index[fd], start, t.offset, t.nbytes))
        if not reads:
            return None  # nothing to read: the ring's zero-filled slot is as cheap
        return StorageBucket(bucket, fds, reads, tensors)


def read_only(fd: int) -> int:
    """A new read-only descriptor of what ``fd`` names (``/proc/self/fd/N`` opened ``O_RDONLY``; the caller closes
    it).

    Raises:
        OSError: it cannot be opened (no ``/proc``, or the file is gone).
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


@contextlib.contextmanager
def opened_read_only(fds: Sequence[int]) -> Iterator[list[int]]:
    """Read-only descriptors of ``fds`` (see :func:`read_only`), closed on leaving.

    Raises:
        OSError: one cannot be opened (those opened are closed).
    """
    opened: list[int] = []
    try:
        for fd in fds:
            opened.append(read_only(fd))
        yield opened
    finally:
        for fd in opened:
            os.close(fd)


def send_group(
    sock: socket.socket, index: int, fds: Sequence[int], reads: Sequence[StorageRead], last: bool, timeout_s: float
) -> None:
    """Send one group of bucket ``index``'s reads on ``sock``, with ``fds`` (read-only ones) attached.

    Raises:
        OSError: the socket failed, or did not take the group within ``timeout_s`` seconds.
    """
    head = STORAGES.pack(index, len(fds), len(reads), int(last))
    body = b"".join(READ.pack(r.storage, r.storage_offset, r.bucket_offset, r.nbytes) for r in reads)
    old = sock.gettimeout()
    sock.settimeout(timeout_s)  # a large group may wait for room in the worker's socket buffer
    try:
        sent = socket.send_fds(sock, [head], list(fds))
        sock.sendall(head[sent:] + body)
    finally:
        sock.settimeout(old)


# ----------------------------------------------------------------------------- the engine's half


@dataclass
class StorageReader:
    """An engine worker's reads of the trainer's storages into its receive buffers (see the module).

    Args:
        sock: the connection to the trainer (a timeout of at most ``POLL_S`` set).
        cancel: the update's cancel signal, looked at between two waits.
        timeout_s: the bound of one wait for the trainer's messages, in seconds.
        worker: the worker's index (for the log).
    """

    sock: socket.socket
    cancel: threading.Event
    timeout_s: float
    worker: int = 0
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _staging: torch.Tensor | None = field(default=None, init=False, repr=False)

    def read_bucket(self, bucket: Bucket, flat: torch.Tensor | None, parts: Sequence[torch.Tensor] = ()) -> None:
        """Receive bucket ``bucket``'s groups and read its bytes into ``flat`` (its ``bucket.size_bytes`` bytes,
        ``uint8``, contiguous; read in place on CPU, through a staging buffer on another device), padding zeroed;
        or, with ``flat`` ``None``, each tensor's bytes into its own of ``parts`` (one per tensor of the bucket, in
        bucket order, each 1-D ``uint8`` of exactly its bytes, on CPU: a receiver splitting the bucket).

        Raises:
            Closed: the trainer closed its socket.
            DataLoss: SHARED_MEMORY_PROTOCOL (a message that is not the bucket's next group, or reads that are not
                its tensors), SHARED_MEMORY_STORAGE (a storage smaller than a read needs, or that shrank while
                read, or a read failing).
            InvalidArgument: SHARED_MEMORY_STORAGE, a descriptor that is not a regular file.
            Cancelled, GroupTimeout.
        """
        due = [(t.offset, t.nbytes) for t in bucket.tensors if t.nbytes]
        if flat is None:
            if len(parts) != len(due) or any(not p.is_cpu for p in parts):
                raise ValueError(f"bucket {bucket.index}: one CPU part per tensor of at least one byte is needed")
            dst = None
            view = memoryview(b"")
            targets: list[memoryview | None] = [memoryview(p.numpy()) for p in parts]  # type: ignore[arg-type]
        else:
            dst = flat if flat.is_cpu else self._staging_for(flat.numel())
            view = memoryview(dst.numpy())  # type: ignore[arg-type]
            targets = [None] * len(due)
        done = 0
        end = 0
        last = False
        while not last:
            head, fds = self._group(bucket.index)
            try:
                n, m, last_flag = head
                last = bool(last_flag)
                if not 1 <= m <= len(due) - done:  # bounded before anything is received
                    raise _protocol(bucket, f"a group of {m} reads after {done} of its {len(due)} tensors")
                body = recv_exact(self.sock, m * READ.size, self.cancel, self.timeout_s, "the storage reads")
                reads = [StorageRead(*r) for r in READ.iter_unpack(body)]
                for r in reads:
                    if done >= len(due) or (r.bucket_offset, r.nbytes) != due[done] or r.storage >= n:
                        want = f"tensor bytes {due[done]}" if done < len(due) else "no further read"
                        raise _protocol(
                            bucket, f"a read of {r.nbytes} bytes to offset {r.bucket_offset}; {want} was due"
                        )
                    done += 1
                for i, fd in enumerate(fds):
                    fds[i] = -1  # closed by _read_only, whatever it answers
                    fds[i] = self._read_only(fd)
                self._check(bucket, fds, reads)
                into = targets[done - len(reads) : done]
                for r in reads:
                    if flat is not None and r.bucket_offset > end:
                        view[end : r.bucket_offset] = bytes(r.bucket_offset - end)
                    end = r.bucket_offset + r.nbytes
                self._read(bucket, fds, reads, view, into)
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
        if done != len(due):
            raise _protocol(bucket, f"the last group came after {done} of its {len(due)} tensors")
        if flat is None:
            return
        if end < flat.numel():
            view[end:] = bytes(flat.numel() - end)
        if dst is not flat:
            assert dst is not None
            flat.copy_(dst[: flat.numel()])

    def _group(self, index: int) -> tuple[tuple[int, int, int], list[int]]:
        """The next group's header (descriptors, reads, last) and descriptors (the caller closes them).

        Raises:
            Closed, DataLoss, Cancelled, GroupTimeout: see :meth:`read_bucket`.
        """
        what = f"bucket {index}'s storages"
        try:
            msg, fds, flags = recv_fds(self.sock, STORAGES.size, MAX_FDS, self.cancel, self.timeout_s, what)
        except OSError as e:
            raise Closed(f"the socket failed: {e}") from e
        try:
            if not msg:
                raise Closed("the peer closed the socket before a group of storages")
            if len(msg) < STORAGES.size:
                msg += recv_exact(self.sock, STORAGES.size - len(msg), self.cancel, self.timeout_s, "a group")
            got, n, m, last = STORAGES.unpack(msg)
            if got != index or n != len(fds) or flags & socket.MSG_CTRUNC or n > MAX_FDS or last > 1:
                raise DataLoss(
                    "SHARED_MEMORY_PROTOCOL",
                    f"the trainer sent a group of bucket {got} with {len(fds)} descriptor(s) (said {n}, flags "
                    f"{flags:#x}); a group of bucket {index} with at most {MAX_FDS} was due",
                    bucket=str(index),
                )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return (n, m, last), fds

    def _read_only(self, fd: int) -> int:
        """``fd`` itself when it is open read-only; else a read-only one of the same file, ``fd`` closed."""
        if fcntl_mode(fd) == os.O_RDONLY:
            return fd
        log.warning("shared-memory worker %d: a storage came open for writing: re-opened read-only", self.worker)
        try:
            return read_only(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _check(bucket: Bucket, fds: Sequence[int], reads: Sequence[StorageRead]) -> None:
        """Each descriptor a regular file (shared memory) of at least the bytes its reads need.

        Raises:
            InvalidArgument, DataLoss: SHARED_MEMORY_STORAGE.
        """
        need = [0] * len(fds)
        for r in reads:
            need[r.storage] = max(need[r.storage], r.storage_offset + r.nbytes)
        for i, fd in enumerate(fds):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(
                    "SHARED_MEMORY_STORAGE",
                    f"storage {i} of bucket {bucket.index} is not a shared-memory file (mode {st.st_mode:#o})",
                    bucket=str(bucket.index),
                )
            if st.st_size < need[i]:
                raise _short(bucket, f"storage {i} holds {st.st_size} bytes; its reads need {need[i]}")

    def _read(
        self,
        bucket: Bucket,
        fds: Sequence[int],
        reads: Sequence[StorageRead],
        view: memoryview,
        into: Sequence[memoryview | None] = (),
    ) -> None:
        """Every read, cut in pieces of :data:`CHUNK_BYTES`, on :data:`READ_THREADS` threads: into ``view`` at its
        offset in the bucket, or into its own of ``into`` (same order as ``reads``; empty: every one into ``view``)
        from its start.

        Raises:
            DataLoss: SHARED_MEMORY_STORAGE, a piece came short or failed.
        """
        pieces = [
            (
                view if own is None else own,
                fds[r.storage],
                r.storage_offset + k,
                (r.bucket_offset if own is None else 0) + k,
                min(CHUNK_BYTES, r.nbytes - k),
            )
            for r, own in zip(reads, into or [None] * len(reads), strict=True)
            for k in range(0, r.nbytes, CHUNK_BYTES)
        ]
        total = sum(p[4] for p in pieces)
        if READ_THREADS < 2 or total < 2 * CHUNK_BYTES:
            for p in pieces:
                _pread(bucket, *p)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"wsync-shm-read-{self.worker}")
        share = [pieces[i::READ_THREADS] for i in range(READ_THREADS)]
        futures = [self._pool.submit(_pread_all, bucket, s) for s in share[1:]]
        errors: list[BaseException] = []
        try:
            _pread_all(bucket, share[0])
        except BaseException as e:
            errors.append(e)
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    def close(self) -> None:
        """Stop the reading threads and drop the staging buffer (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._staging = None


def fcntl_mode(fd: int) -> int:
    """``fd``'s access mode (``os.O_RDONLY``, ``os.O_WRONLY`` or ``os.O_RDWR``)."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


def _protocol(bucket: Bucket, what: str) -> DataLoss:
    return DataLoss(
        "SHARED_MEMORY_PROTOCOL",
        f"the trainer's storages of bucket {bucket.index}: {what} (the reads must be its tensors, in order)",
        bucket=str(bucket.index),
    )


def _short(bucket: Bucket, what: str) -> DataLoss:
    return DataLoss(
        "SHARED_MEMORY_STORAGE",
        f"bucket {bucket.index}: {what}: the trainer's shared-memory storage shrank or is not what it named",
        bucket=str(bucket.index),
    )


def _pread(bucket: Bucket, view: memoryview, fd: int, offset: int, at: int, nbytes: int) -> None:
    """Read ``nbytes`` bytes at ``offset`` of ``fd`` into ``view[at:]``.

    Raises:
        DataLoss: SHARED_MEMORY_STORAGE, the file ended first (it shrank) or the read failed.
    """
    got = 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [view[at + got : at + nbytes]], offset + got)
        except OSError as e:
            raise _short(bucket, f"reading {nbytes} bytes at offset {offset} failed ({e})") from e
        if n <= 0:
            raise _short(bucket, f"only {got} of {nbytes} bytes at offset {offset} could be read")
        got += n


def _pread_all(bucket: Bucket, pieces: Sequence[tuple[memoryview, int, int, int, int]]) -> None:
    """:func:`_pread` of each ``(view, fd, offset, at, nbytes)``."""
    for p in pieces:
        _pread(bucket, *p)


@dataclass
class SendCounts:
    """What one shared-memory send did with its buckets (:attr:`SharedMemorySender.last_send
    <wsync_grpc.transports.shared_memory.sender.SharedMemorySender.last_send>`).

    Attributes:
        packed_buckets: buckets packed into the ring.
        packed_bytes: their bytes, in bytes.
        storage_buckets: buckets the engines read from the trainer's own storages (no packing).
        storage_bytes: their bytes, in bytes.
    """

    packed_buckets: int = 0
    packed_bytes: int = 0
    storage_buckets: int = 0
    storage_bytes: int = 0
