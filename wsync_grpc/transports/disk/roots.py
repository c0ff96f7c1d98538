"""Where an engine may read checkpoints: its operator's roots, and a caller's path placed beneath one of them.

The engine's operator allows a few directories (``wsync serve
--checkpoint-root DIR``, repeatable). A caller names a checkpoint by path:
relative paths lie beneath the first root, absolute ones must be spelled
beneath some root; ``..`` components and absolute paths elsewhere are
refused with PERMISSION_DENIED before anything is opened. The path is then
opened beneath its root, one component at a time, never through a symlink
(:mod:`~wsync_grpc.transports.disk.confined`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from wsync_grpc.core.errors import InvalidArgument, PermissionDenied
from wsync_grpc.transports.disk.confined import OpenDir, OpenFile, path_parts, shown


class CheckpointRoots:
    """The directories an engine may read checkpoints from (its operator's ``--checkpoint-root``).

    Args:
        roots: directories; each is resolved (symlinks followed) once, here: the operator chose them.

    Raises:
        ValueError: a root that is not an existing directory.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        self.roots: list[Path] = []
        self._spellings: list[tuple[PurePosixPath, Path]] = []
        for r in roots:
            real = Path(os.path.realpath(r))
            if not real.is_dir():
                raise ValueError(f"checkpoint root {str(r)!r} is not a directory")
            self.roots.append(real)
            self._spellings.append((PurePosixPath(real), real))
            given = PurePosixPath(os.path.abspath(r))
            if given != PurePosixPath(real):  # callers may spell the root as the operator did
                self._spellings.append((given, real))

    def __bool__(self) -> bool:
        return bool(self.roots)

    def locate(self, path: str) -> tuple[Path, tuple[str, ...]]:
        """The root ``path`` lies beneath (relative paths: the first root) and its components beneath it.

        Lexical only: nothing is opened (:meth:`open` walks the components).

        Raises:
            PermissionDenied: NO_CHECKPOINT_ROOT (the engine allows none), PATH_OUTSIDE_ROOTS (a ``..``
                component, or an absolute path beneath no root).
            InvalidArgument: BAD_CHECKPOINT_PATH (empty, a NUL byte, too many components).
        """
        if not self.roots:
            raise PermissionDenied(
                "NO_CHECKPOINT_ROOT",
                "this engine reads no checkpoint from disk: start it with --checkpoint-root DIR",
            )
        if not path or "\x00" in path:
            raise InvalidArgument("BAD_CHECKPOINT_PATH", "checkpoint_path is empty or holds a NUL byte")
        p = PurePosixPath(path)
        if ".." in p.parts:
            raise PermissionDenied(
                "PATH_OUTSIDE_ROOTS", f"checkpoint path {shown(path)!r} has a '..' component", path=shown(path)
            )
        if not p.is_absolute():
            return self.roots[0], path_parts(p)
        for spelled, real in self._spellings:
            if p == spelled or p.is_relative_to(spelled):
                return real, path_parts(p.relative_to(spelled))
        raise PermissionDenied(
            "PATH_OUTSIDE_ROOTS",
            f"checkpoint path {shown(path)!r} lies outside the engine's checkpoint roots "
            f"({', '.join(str(r) for r in self.roots)})",
            path=shown(path),
        )

    def open(self, path: str) -> OpenDir | OpenFile:
        """``path`` opened beneath its root, never through a symlink: a directory, or a regular file.

        Raises:
            PermissionDenied, InvalidArgument: see :meth:`locate`; SYMLINK_IN_PATH, NOT_A_REGULAR_FILE
                (see :meth:`~wsync_grpc.transports.disk.confined.OpenDir.open`).
            NotFound: CHECKPOINT_NOT_FOUND.
        """
        root, parts = self.locate(path)
        with OpenDir.root_of(root) as d:
            return d.open(parts)
