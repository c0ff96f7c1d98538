"""The shared-memory transport's handover: the trainer's segment (:class:`Segment`) and, per update, the socket
its engine workers take it from (:class:`Handover`).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from wsync_grpc.core.errors import Cancelled, GroupTimeout
from wsync_grpc.core.header import CudaIpcMemory, SharedMemoryHandle
from wsync_grpc.core.layout import Bucket
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.transports.shared_memory.backing import HOST, RingMemory, slot_view
from wsync_grpc.transports.shared_memory.protocol import (
    GRANT,
    MAGIC,
    MAGIC_CUDA,
    MAGIC_STORAGES,
    POLL_S,
    SOCKET_PREFIX,
    TOKEN_BYTES,
    Closed,
    address,
    own_uid,
    peer_credentials,
    recv_exact,
)

log = logging.getLogger(__name__)

SEGMENT_NAME = "wsync-shm"
"""The memfd's name (shown as ``/memfd:wsync-shm`` in ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``)."""

HANDSHAKE_TIMEOUT_S = 10.0
"""The longest a connection may take to send its token, in seconds."""

BIND_TRIES = 8
"""Random socket names tried before giving up (a name already taken is tried again with another)."""


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole page (at least one), in bytes."""
    return max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE


class Segment:
    """One shared-memory segment: a memfd of ``slots * slot_bytes`` bytes, sealed against resizing, mapped
    read-write in this process (pages populated at once).

    The ring's memory on the host (a :class:`~wsync_grpc.transports.shared_memory.backing.RingMemory`). The
    engines get :attr:`read_only_fd`, a read-only descriptor of the same memory: they can map it read-only, never
    write it. Seals ``F_SEAL_SHRINK`` and ``F_SEAL_GROW``: its size is fixed for life, so
    that no mapping of it can lose pages under a reader (a ``SIGBUS``).

    Args:
        slot_bytes: one slot's size, in bytes (a multiple of the page size).
        slots: how many slots.

    Raises:
        OSError: the memfd could not be made, sized, sealed or mapped (out of memory, no ``/proc``).
    """

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        size = slot_bytes * slots
        fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        read_only = -1
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            mapping = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            if read_only >= 0:
                os.close(read_only)
            raise
        finally:
            os.close(fd)  # the mapping and the read-only descriptor hold the memory
        self.read_only_fd = read_only
        """A read-only descriptor of the segment, handed to the engines' workers; -1 once closed."""
        self._bytes: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)
        # The tensor holds the mapping: it is unmapped once the tensor and its last view are gone.

    place = HOST
    """A memfd lives on the host."""
    cuda_ipc: CudaIpcMemory | None = None
    """Nothing of GPU memory: the grant carries the descriptor."""

    @property
    def nbytes(self) -> int:
        """The segment's size, in bytes."""
        return self.slot_bytes * self.slots

    def grant_fds(self) -> list[int]:
        """The read-only descriptor, sent with each grant."""
        return [self.read_only_fd]

    def packed(self, slot: int) -> None:
        """Nothing: the CPU wrote the slot's bytes into the shared pages before the packing returned."""

    def slot(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of slot ``slot``, as a writable ``uint8`` tensor over the segment.

        Raises:
            ValueError: the segment was closed, or ``nbytes`` exceeds a slot.
        """
        return slot_view(self._bytes, slot, nbytes, self.slots, self.slot_bytes)

    def close(self) -> None:
        """Close the read-only descriptor and drop the mapping (unmapped once no view of it is left)."""
        if self.read_only_fd >= 0:
            os.close(self.read_only_fd)
            self.read_only_fd = -1
        self._bytes = None


class Handover:
    """One update's handover of a ring (a :class:`Segment`, or GPU memory: any
    :class:`~wsync_grpc.transports.shared_memory.backing.RingMemory`): a listening abstract Unix socket and a token.

    Each connection is served on a short thread of its own: the peer must be this process's user
    (``SO_PEERCRED``) and send the token (compared in constant time) within :data:`HANDSHAKE_TIMEOUT_S`;
    it then gets :data:`~wsync_grpc.transports.shared_memory.protocol.GRANT` with the ring's descriptors (a
    segment's read-only one; none for GPU memory, which the handle names), and becomes a reader.
    Refused connections are closed and logged.

    Args:
        segment: the ring's memory handed over (it outlives the handover).
        update_id: the update it serves.
        storages: buckets may also go as reads of the trainer's storages (the handle says so and the grant's
            magic is :data:`~wsync_grpc.transports.shared_memory.protocol.MAGIC_STORAGES`).

    Raises:
        OSError: no socket could be bound (:data:`BIND_TRIES` names taken, or no Unix sockets).
    """

    def __init__(self, segment: RingMemory, update_id: str, *, storages: bool = False) -> None:
        self.segment = segment
        self.update_id = update_id
        self.storages = storages
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._lock = threading.Lock()
        self._readers: list[socket.socket] = []
        self._closed = False
        self._stopping = threading.Event()  # handshakes still waiting for a token give up
        self._listener, self.name = self._bind()
        self._listener.listen(64)
        self._accepting = threading.Thread(target=self._accept, name="wsync-shm-accept", daemon=True)
        self._accepting.start()

    @staticmethod
    def _bind() -> tuple[socket.socket, str]:
        for _ in range(BIND_TRIES):
            name = SOCKET_PREFIX + secrets.token_hex(8)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(address(name))
            except OSError as e:
                sock.close()
                if e.errno == errno.EADDRINUSE:
                    continue
                raise
            return sock, name
        raise OSError(errno.EADDRINUSE, f"{BIND_TRIES} random abstract socket names were all taken")

    def handle(self, host: str) -> SharedMemoryHandle:
        """The header's handle of this handover (``host``: this host's boot id)."""
        return SharedMemoryHandle(
            self.name,
            self.token,
            host,
            self.segment.slot_bytes,
            self.segment.slots,
            storages=self.storages,
            cuda_ipc=self.segment.cuda_ipc,
        )

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # shut down by take_readers or close
                return
            threading.Thread(target=self._serve, args=(conn,), name="wsync-shm-handshake", daemon=True).start()

    def _refuse(self, conn: socket.socket, pid: int, why: str) -> None:
        log.warning("shared-memory handover of update %s: refused pid %d: %s", self.update_id, pid, why)
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        pid = -1
        try:
            conn.settimeout(POLL_S)
            pid, uid = peer_credentials(conn)
            if uid != own_uid():
                self._refuse(conn, pid, f"its user {uid} is not this trainer's ({own_uid()})")
                return
            token = recv_exact(conn, TOKEN_BYTES, self._stopping, HANDSHAKE_TIMEOUT_S, "the token")
            if not hmac.compare_digest(token, self.token):
                self._refuse(conn, pid, "a wrong token")
                return
            with self._lock:  # the descriptor is only sent while the handover (and the segment) is open
                if self._closed:
                    self._refuse(conn, pid, "the send had begun (or the handover was closed)")
                    return
                magic = MAGIC_CUDA if self.segment.cuda_ipc is not None else MAGIC_STORAGES if self.storages else MAGIC
                grant = GRANT.pack(magic, self.segment.slots, self.segment.slot_bytes)
                fds = self.segment.grant_fds()
                if fds:
                    socket.send_fds(conn, [grant], fds)
                else:  # GPU memory: the handle names it, nothing is attached
                    conn.sendall(grant)
                self._readers.append(conn)
            log.debug("shared-memory handover of update %s: worker pid %d connected", self.update_id, pid)
        except (Closed, GroupTimeout, Cancelled, OSError) as e:
            self._refuse(conn, pid, str(e) or type(e).__name__)

    def _stop(self) -> list[socket.socket]:
        """Stop accepting; the readers connected so far (the caller owns them)."""
        self._stopping.set()
        with self._lock:
            self._closed = True
            readers, self._readers = self._readers, []
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._accepting.join(5)
        self._listener.close()
        return readers

    def take_readers(self) -> list[socket.socket]:
        """The send begins: stop accepting, close the listener; every worker connected so far, in connection
        order (the caller closes them)."""
        return self._stop()

    def close(self) -> None:
        """Stop accepting and close every connection (an update that never sent, or the client closing)."""
        for conn in self._stop():
            conn.close()


class MemfdKind:
    """The memfd ring (:class:`Segment`): always on the host. A
    send's CUDA tensors are copied to it as they are packed (device to host)."""

    storages = True
    """The zero-copy path may be offered."""

    def place_of(
        self,
        buckets: Sequence[Bucket],
        tensors: Callable[[Bucket], Mapping[str, torch.Tensor]],
        topology: SendTopology,
        device: torch.device,
    ) -> str:
        """:data:`HOST`, whatever the tensors."""
        return HOST

    def allocate(self, slot_bytes: int, slots: int, place: str) -> RingMemory:
        """A fresh :class:`Segment`.

        Raises:
            OSError: see :class:`Segment`.
        """
        return Segment(slot_bytes, slots)


MEMFD = MemfdKind()
"""The one :class:`MemfdKind`."""
