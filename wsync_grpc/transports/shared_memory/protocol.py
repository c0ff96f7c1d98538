"""The shared-memory transport's socket protocol, spoken by both halves over one abstract Unix socket.

Every message has a fixed size and a fixed layout (:mod:`struct`, little endian); nothing is pickled.
On each connection, in order:

1. engine worker -> trainer: the update's token (:data:`TOKEN_BYTES` bytes, ``SharedMemoryHandle.token``);
2. trainer -> engine worker: :data:`GRANT` (magic, slots, slot size in bytes) with the segment's file
   descriptor attached (``SCM_RIGHTS``, :func:`socket.send_fds`); a refused connection is closed instead. A ring in
   GPU memory (``TRANSPORT_CUDA_IPC``): magic :data:`MAGIC_CUDA` and nothing attached (the handle names the memory);
3. per bucket, in index order: trainer -> engine worker :data:`BUCKET` (bucket index, slot, size in bytes,
   once the bucket is packed in that slot); engine worker -> trainer :data:`ACK` (the bucket index, once it
   copied the slot out: the trainer may pack another bucket there). With the handle's ``storages`` (grant magic
   :data:`MAGIC_STORAGES`), a bucket may name slot
   :data:`~wsync_grpc.transports.shared_memory.storages.STORAGE_SLOT` instead: groups of storage descriptors and
   reads follow (:mod:`wsync_grpc.transports.shared_memory.storages`), and the ACK says the worker read them.

Either side closing its end ends the update's transfer on the other (a trainer or an engine that died).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from wsync_grpc.core.errors import Cancelled, GroupTimeout

SOCKET_PREFIX = "wsync-shm-"
"""The start of every socket name a wsync trainer chooses (then 16 random hex digits)."""

TOKEN_BYTES = 32
"""Length of the token an engine worker sends first, in bytes."""

MAGIC = b"WSYNCSHM"
"""The first bytes of :data:`GRANT`: the trainer speaks this protocol."""

MAGIC_STORAGES = b"WSYNCSH2"
"""The first bytes of :data:`GRANT` when the handle says ``storages``: buckets may also come as reads of the
trainer's own storages (:mod:`wsync_grpc.transports.shared_memory.storages`); an engine that does not know them
refuses this grant before any byte is read."""

MAGIC_CUDA = b"WSYNCCUD"
"""The first bytes of :data:`GRANT` when the ring is GPU memory (``TRANSPORT_CUDA_IPC``): no descriptor comes with
it; the engine worker opens the memory the handle's ``cuda_ipc`` names (:mod:`wsync_grpc.transports.cuda_ipc`)."""

GRANT = struct.Struct("<8sIQ")
"""trainer -> engine worker, with the segment's descriptor: (:data:`MAGIC`, slots, slot size in bytes)."""

BUCKET = struct.Struct("<QIQ")
"""trainer -> engine worker: (bucket index, slot, the bucket's size in bytes): the bucket is in that slot."""

ACK = struct.Struct("<Q")
"""engine worker -> trainer: (bucket index,): the worker copied it out, its slot may be reused."""

POLL_S = 0.05
"""How often a wait on the socket looks at the update's cancel signal, in seconds."""

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""Where Linux tells this boot's id (the same for every process of the host until it reboots)."""

MAX_NAME_CHARS = 100
"""The longest socket name accepted, in characters (an abstract address holds 107 bytes after its NUL)."""


class Closed(Exception):
    """The peer closed its end of the socket (or it failed) before a whole message came."""


def boot_id() -> str:
    """This host's boot id (:data:`BOOT_ID_PATH`), stripped; ``""`` where it cannot be read."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def address(name: str) -> str:
    """The abstract Unix socket address of ``name`` (a leading NUL byte: no file in any directory)."""
    return "\0" + name


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of the connected Unix socket ``sock`` (``SO_PEERCRED``: as
    the kernel recorded them at its ``connect`` or ``listen``; the peer cannot forge them)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def own_uid() -> int:
    """This process's effective user id."""
    return os.geteuid()


def recv_fds(
    sock: socket.socket, size: int, max_fds: int, cancel: threading.Event, timeout_s: float, what: str
) -> tuple[bytes, list[int], int]:
    """One message of at most ``size`` bytes from ``sock`` (which has a timeout of :data:`POLL_S` or less set) with
    the descriptors that came with it (``SCM_RIGHTS``, at most ``max_fds``; the caller closes them) and its flags,
    looking at ``cancel`` between two looks. An empty message without descriptors: the peer closed its end.

    Raises:
        Cancelled: ``cancel`` was set meanwhile.
        GroupTimeout: ``timeout_s`` seconds passed without a message (``what`` says which).
        OSError: the socket failed (the caller says what that means).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if cancel.is_set():
            raise Cancelled("the update was cancelled")
        try:
            msg, fds, flags, _ = socket.recv_fds(sock, size, max_fds)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise GroupTimeout(f"{what} did not come within {timeout_s:g} s") from None
            continue
        return msg, [int(fd) for fd in fds], flags


def recv_exact(sock: socket.socket, n: int, cancel: threading.Event | None, timeout_s: float, what: str) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (which has a timeout of :data:`POLL_S` or less set), looking at ``cancel``
    between two looks.

    Raises:
        Closed: the peer closed its end (or the socket failed) before ``n`` bytes came.
        Cancelled: ``cancel`` was set meanwhile.
        GroupTimeout: ``timeout_s`` seconds passed without the whole message (``what`` says which).
    """
    deadline = time.monotonic() + timeout_s
    got = bytearray()
    while len(got) < n:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the update was cancelled")
        try:
            chunk = sock.recv(n - len(got))
        except TimeoutError:
            if time.monotonic() > deadline:
                raise GroupTimeout(f"{what} did not come within {timeout_s:g} s") from None
            continue
        except OSError as e:
            raise Closed(f"the socket failed: {e}") from e
        if not chunk:
            raise Closed(f"the peer closed the socket after {len(got)} of {n} bytes of {what}")
        got += chunk
    return bytes(got)
