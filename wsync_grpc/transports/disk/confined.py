"""Files opened beneath a checkpoint root: never through a symlink, only regular files, read through that open file.

Checking a path and then opening it again by name lets whoever writes in the
root swap what the name points to in between: a symlink out of the root, or
a FIFO whose ``open`` blocks the opener for good. So nothing here checks a
path and opens it later. A file is reached by walking its path one component
at a time from an open directory: every directory with ``O_DIRECTORY |
O_NOFOLLOW``, the last component with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO then
opens at once instead of waiting for a writer), each relative to the
descriptor of the one before (``dir_fd``). A symlink anywhere on the way fails
the open itself (``ELOOP``, or ``ENOTDIR`` for a directory), and what was
opened is then checked with ``fstat``: a regular file, or it is refused. Every
later read (a side file's bytes, a safetensors header, a tensor's data) goes
through the same descriptor with ``pread``, which also releases the GIL.

``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` would do the walk in one
call, but Python's :mod:`os` does not offer it; the walk gives the same
guarantees for symlinks, and ``..`` components are refused before any open
(:func:`path_parts`). What neither refuses: a bind mount or a hard link placed
inside a root by someone allowed to do so (the operator's own choice).

Units: sizes and offsets in bytes.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path, PurePosixPath

from wsync_grpc.core.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from wsync_grpc.core.update import SourceFile

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How each directory on the way is opened: never through a symlink."""

_LAST_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
"""How the last component is opened: never through a symlink, and without waiting (a FIFO opens at once)."""

MAX_PATH_PARTS = 64
"""Most components a path beneath a root may have."""

SHOWN_CHARS = 200
"""Longest path echoed in an error message, in characters."""


def shown(text: str) -> str:
    """``text`` cut to :data:`SHOWN_CHARS` characters, for an error message."""
    return text[:SHOWN_CHARS]


def path_parts(path: str | PurePosixPath) -> tuple[str, ...]:
    """The components of the relative path ``path`` (``.`` and empty ones dropped).

    Raises:
        PermissionDenied: PATH_OUTSIDE_ROOTS (a ``..`` component, or an absolute path).
        InvalidArgument: BAD_CHECKPOINT_PATH (a NUL byte, or more than :data:`MAX_PATH_PARTS` components).
    """
    text = str(path)
    if "\x00" in text:
        raise InvalidArgument("BAD_CHECKPOINT_PATH", "a checkpoint path holds a NUL byte")
    p = PurePosixPath(text)
    if p.is_absolute():
        raise PermissionDenied("PATH_OUTSIDE_ROOTS", f"{shown(text)!r} is not a path beneath the checkpoint root")
    parts = tuple(c for c in p.parts if c not in ("", "."))
    if ".." in parts:
        raise PermissionDenied(
            "PATH_OUTSIDE_ROOTS", f"checkpoint path {shown(text)!r} has a '..' component", path=shown(text)
        )
    if len(parts) > MAX_PATH_PARTS:
        raise InvalidArgument("BAD_CHECKPOINT_PATH", f"a checkpoint path has more than {MAX_PATH_PARTS} components")
    return parts


def _refused(code: int, name: str, where: str, dir_fd: int, want_dir: bool) -> Exception:
    """The error of an ``open`` of ``name`` (beneath the directory ``dir_fd``, shown as ``where``) that failed."""
    if code == errno.ENOENT:
        return NotFound("CHECKPOINT_NOT_FOUND", f"no {shown(where)!r} beneath the checkpoint root", path=shown(where))
    try:
        kind = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode  # for the message only
    except OSError:
        kind = 0
    if code == errno.ELOOP or stat.S_ISLNK(kind):
        return PermissionDenied(
            "SYMLINK_IN_PATH",
            f"{shown(where)!r} is a symbolic link: the engine opens checkpoint files beneath its roots only, "
            "never through a symlink",
            path=shown(where),
        )
    if want_dir and code == errno.ENOTDIR:
        return NotFound("CHECKPOINT_NOT_FOUND", f"{shown(where)!r} is not a directory", path=shown(where))
    if code in (errno.EACCES, errno.EPERM):
        return PermissionDenied("UNREADABLE_CHECKPOINT", f"the engine may not read {shown(where)!r}", path=shown(where))
    return Unavailable("CHECKPOINT_READ_FAILED", f"opening {shown(where)!r} failed: {os.strerror(code)}")


class OpenFile:
    """A regular file opened beneath a root; read only through its descriptor (``pread``).

    Attributes:
        fd: the open descriptor (owned: :meth:`close` closes it).
        root: the root it lies beneath.
        path: its components beneath ``root``.
        size: its size when opened, in bytes.
        device, inode: its ``st_dev`` and ``st_ino``.
    """

    def __init__(self, fd: int, root: Path, path: tuple[str, ...], st: os.stat_result) -> None:
        self.fd = fd
        self.root = root
        self.path = path
        self.size = st.st_size
        self.device = st.st_dev
        self.inode = st.st_ino

    @property
    def name(self) -> str:
        """Its path beneath the root, ``/``-separated (what error messages show)."""
        return "/".join(self.path)

    def source(self, handle: object | None = None) -> SourceFile:
        """This file as a disk update's plan names it (``handle``: the shared open file, in this process)."""
        return SourceFile(str(self.root), self.name, self.device, self.inode, handle)

    def read_at(self, offset: int, n: int) -> bytes:
        """Exactly ``n`` bytes from ``offset``.

        Raises:
            InvalidArgument: BAD_CHECKPOINT_FILE (the file ends before).
            OSError: the read failed.
        """
        buf = bytearray(n)
        self.read_into(memoryview(buf), offset)
        return bytes(buf)

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` (a writable byte buffer) from ``offset``; ``pread`` releases the GIL.

        Raises:
            InvalidArgument: BAD_CHECKPOINT_FILE (the file ends before ``buf`` is full).
            OSError: the read failed.
        """
        done, n = 0, len(buf)
        while done < n:
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got == 0:
                raise InvalidArgument(
                    "BAD_CHECKPOINT_FILE", f"{shown(self.name)} ends before byte {offset + n}", path=shown(self.name)
                )
            done += got

    def read_all(self, limit: int, reason: str) -> bytes:
        """The whole file, if it holds at most ``limit`` bytes (a side file: an index, an adapter's config).

        Raises:
            InvalidArgument: ``reason`` (larger than ``limit``).
        """
        if self.size > limit:
            raise InvalidArgument(
                reason,
                f"{shown(self.name)} holds {self.size} bytes; at most {limit} are read",
                path=shown(self.name),
            )
        data = self.read_at(0, self.size)
        if os.pread(self.fd, 1, self.size):  # it grew since it was opened
            raise InvalidArgument(reason, f"{shown(self.name)} grew while it was read", path=shown(self.name))
        return data

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenDir:
    """A directory opened beneath a root (or the root itself), from which files beneath it are opened.

    Attributes:
        fd: the open descriptor (owned: :meth:`close` closes it).
        root: the root it lies beneath.
        path: its components beneath ``root`` (empty: the root).
    """

    def __init__(self, fd: int, root: Path, path: tuple[str, ...]) -> None:
        self.fd = fd
        self.root = root
        self.path = path

    @classmethod
    def root_of(cls, root: Path) -> OpenDir:
        """The root directory ``root`` (the operator's, resolved at start) opened.

        Raises:
            NotFound: CHECKPOINT_NOT_FOUND (the root is gone).
        """
        try:
            return cls(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), root, ())
        except OSError as e:
            raise NotFound(
                "CHECKPOINT_NOT_FOUND", f"checkpoint root {str(root)!r} cannot be opened: {e.strerror}"
            ) from None

    def _where(self, more: tuple[str, ...]) -> str:
        return "/".join(self.path + more) or "."

    def open(self, parts: tuple[str, ...]) -> OpenDir | OpenFile:
        """What ``parts`` (see :func:`path_parts`) names beneath this directory: a directory or a regular file.

        Raises:
            PermissionDenied: SYMLINK_IN_PATH (a symlink on the way), NOT_A_REGULAR_FILE (a FIFO, a device,
                a socket), UNREADABLE_CHECKPOINT.
            NotFound: CHECKPOINT_NOT_FOUND (missing, or a file where a directory was expected).
        """
        if not parts:
            return OpenDir(os.dup(self.fd), self.root, self.path)
        fd = self.fd
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise _refused(e.errno or 0, name, self._where(parts[: i + 1]), fd, True) from None
                if fd != self.fd:
                    os.close(fd)
                fd = nxt
            last = parts[-1]
            try:
                opened = os.open(last, _LAST_FLAGS, dir_fd=fd)
            except OSError as e:
                raise _refused(e.errno or 0, last, self._where(parts), fd, False) from None
        finally:
            if fd != self.fd:
                os.close(fd)
        st = os.fstat(opened)
        if stat.S_ISDIR(st.st_mode):
            return OpenDir(opened, self.root, self.path + parts)
        if not stat.S_ISREG(st.st_mode):
            os.close(opened)
            where = self._where(parts)
            raise PermissionDenied(
                "NOT_A_REGULAR_FILE",
                f"{shown(where)!r} is not a regular file (a FIFO, a device or a socket): the engine reads "
                "regular files only",
                path=shown(where),
            )
        return OpenFile(opened, self.root, self.path + parts, st)

    def open_file(self, parts: tuple[str, ...]) -> OpenFile:
        """The regular file ``parts`` names beneath this directory.

        Raises:
            NotFound: CHECKPOINT_NOT_FOUND (also: a directory there).
            PermissionDenied: see :meth:`open`.
        """
        opened = self.open(parts)
        if isinstance(opened, OpenDir):
            opened.close()
            where = self._where(parts)
            raise NotFound("CHECKPOINT_NOT_FOUND", f"{shown(where)!r} is a directory, not a file", path=shown(where))
        return opened

    def names(self, limit: int) -> list[str]:
        """The names in this directory, sorted; at most ``limit`` of them.

        Raises:
            InvalidArgument: TOO_MANY_FILES (more than ``limit`` entries).
        """
        out: list[str] = []
        with os.scandir(os.dup(self.fd)) as it:  # scandir closes the duplicate
            for entry in it:
                out.append(entry.name)
                if len(out) > limit:
                    raise InvalidArgument(
                        "TOO_MANY_FILES", f"{shown(self._where(()))!r} holds more than {limit} entries"
                    )
        return sorted(out)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedFile:
    """An :class:`OpenFile` shared by the readers of one update in this process, closed when the last lets go.

    The update's planning holds the first reference; every reader in this
    process takes its own (:meth:`acquire`) before the planning lets go, so the
    descriptor is closed only once no reader can still use it (never reused
    under a reader).
    """

    def __init__(self, file: OpenFile) -> None:
        self._file = file
        self._refs = 1
        self._lock = threading.Lock()

    def acquire(self) -> OpenFile | None:
        """A reference to the open file; ``None`` once it was closed. Pair with :meth:`release`."""
        with self._lock:
            if self._refs == 0:
                return None
            self._refs += 1
            return self._file

    def release(self) -> None:
        """Let go of one reference; the last closes the file."""
        with self._lock:
            self._refs -= 1
            if self._refs == 0:
                self._file.close()


def reopen(source: SourceFile) -> OpenFile:
    """``source`` opened again beneath its root, in a process that did not plan the update (an engine's worker).

    Walked as at Prepare (never through a symlink, a regular file only), and
    it must be the very file opened then: same ``(st_dev, st_ino)``.

    Raises:
        Unavailable: CHECKPOINT_CHANGED (another file is there now).
        PermissionDenied, NotFound: see :meth:`OpenDir.open`.
    """
    with OpenDir.root_of(Path(source.root)) as root:
        f = root.open_file(path_parts(source.path))
    if (f.device, f.inode) != (source.device, source.inode):
        f.close()
        raise Unavailable(
            "CHECKPOINT_CHANGED",
            f"{shown(source.path)} was replaced since the update was prepared: prepare it again",
            path=shown(source.path),
        )
    return f
