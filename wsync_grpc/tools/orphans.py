"""No orphans: the processes an engine forks end with it, even when it is SIGKILLed.

vLLM starts its engine core from the API server's main thread, and the engine core its workers from its own
main thread, with ``multiprocessing`` (``VLLM_WORKER_MULTIPROC_METHOD``: ``spawn`` under vLLM's API server
entry point, which ``wsync serve --engine vllm`` runs; ``fork`` if set so). A SIGKILLed server leaves them
running (the engine core ignores SIGTERM, and each holds its model's memory). On Linux, a parent-death
signal (SIGKILL once the parent is gone) ends them with it:

- forked children: :func:`end_forked_children_with_this_process` arms every child forked from the main
  thread of this process, and of each such child in turn (the hooks are inherited by a fork);
- spawned children: :func:`end_spawned_children_with_this_process` marks this process in the environment
  (:data:`ENV`); a ``multiprocessing`` spawned child of it calls :func:`end_with_parent_if_spawned` as it
  imports its parent's main module (``wsync_grpc.tools.cli``, which imports ``wsync_grpc.tools.engines``),
  arms itself and marks itself for its own spawned children in turn.

Limits: Linux only (elsewhere nothing is armed); a child started from another thread is not armed by a fork
(a parent-death signal fires when the *thread* that forked ends, not the process), and a spawned one cannot
tell which thread started it (vLLM starts them all from main threads); a spawned child is armed once it has
imported the main module (well under a second; if its parent died before, it exits then); other
``subprocess`` children and ``forkserver`` ones are not armed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = [
    "ENV",
    "end_forked_children_with_this_process",
    "end_spawned_children_with_this_process",
    "end_with_parent_if_spawned",
    "set_parent_death_signal",
]

ENV = "WSYNC_END_WITH_PARENT"
"""The environment variable naming the pid whose ``multiprocessing`` spawned children end with it."""

PR_SET_PDEATHSIG = 1
"""``prctl``'s option that sets the calling process's parent-death signal (``<linux/prctl.h>``)."""

_armed = False
_lock = threading.Lock()
_forking: dict[int, int] = {}
"""Forking thread's id -> the pid it forks from, while a fork from the main thread is under way."""


def set_parent_death_signal(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the thread that forked it) ends.

    Args:
        expected_parent: the pid this process was forked from; if the parent is already gone
            (``os.getppid()`` differs: adopted before the signal was armed), this process exits at once
            (``os._exit(1)``), as it would have been killed.
        sig: the signal (SIGKILL: nothing to catch or ignore).

    Returns:
        Whether the signal is armed (``False`` off Linux, or if ``prctl`` failed).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed: bool = libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if armed and expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    return armed


def _before_fork() -> None:
    if threading.current_thread() is threading.main_thread():
        _forking[threading.get_ident()] = os.getpid()


def _after_fork_in_parent() -> None:
    _forking.pop(threading.get_ident(), None)


def _after_fork_in_child() -> None:
    # The forking thread is the child's only one, with the same id (pthread_self survives a fork).
    parent = _forking.pop(threading.get_ident(), None)
    _forking.clear()
    if parent is not None and set_parent_death_signal(parent) and ENV in os.environ:
        os.environ[ENV] = str(os.getpid())  # what this child spawns ends with it in turn


def end_forked_children_with_this_process() -> bool:
    """From now on, every child this process forks from its main thread gets SIGKILL when this process ends.

    Children forked that way get the same hooks, so their own children (forked from their main thread) end
    with them in turn: a chain ends from the top. Call it once, from the main thread, before the children
    are forked; later calls do nothing.

    Returns:
        Whether the hooks are registered (``False`` off Linux).
    """
    global _armed
    if not sys.platform.startswith("linux"):
        return False
    with _lock:
        if not _armed:
            os.register_at_fork(
                before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
            )
            _armed = True
    return True


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (not ended, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def end_spawned_children_with_this_process() -> bool:
    """From now on, a ``multiprocessing`` child this process spawns (from its main thread) ends with it.

    Sets :data:`ENV` to this pid; the child acts on it in :func:`end_with_parent_if_spawned`, which it runs
    when it imports ``wsync_grpc.tools.engines`` (as the main module of ``wsync serve``, ``wsync_grpc.tools.cli``,
    does).

    Returns:
        Whether this platform has a parent-death signal (Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    os.environ[ENV] = str(os.getpid())
    return True


def end_with_parent_if_spawned() -> bool:
    """In a ``multiprocessing`` spawned child of a process marked by :func:`end_spawned_children_with_this_process`:
    end with that parent (a parent-death signal), and mark this process for its own children, forked or spawned.

    Does nothing in any other process. A child whose marked parent is already gone exits (``os._exit(1)``).

    Returns:
        Whether this process was armed.
    """
    marked = os.environ.get(ENV, "")
    # A spawned child's command line (``python -c 'from multiprocessing.spawn import spawn_main; ...'
    # --multiprocessing-fork ...``); its sys.argv is already its parent's when the main module is imported.
    if not marked.isdigit() or "--multiprocessing-fork" not in sys.orig_argv:
        return False
    parent = int(marked)
    if os.getppid() != parent:
        if not _running(parent):
            os._exit(1)  # the marked parent is gone (before this child armed): it would have been killed with it
        return False  # spawned by another process, below the marked one
    if not set_parent_death_signal(parent):
        return False
    end_spawned_children_with_this_process()
    end_forked_children_with_this_process()
    return True
