"""Threads that each run torch's CPU operations on one intra-op thread: parallel work by tensor, not inside one.

torch runs a large CPU operation on all of its intra-op threads (OpenMP), each taking a share and the operation
ending when the slowest share does. Where another process keeps one of those cores busy (an inference engine on
the same host, whose CPU backend pins its forward to cores of its own), every operation waits for the thread
that shares that core: a trainer's diff of a whole model took several times longer with one core of two busy
than with both free, and took the busy core's time from the engine. Work split by tensor over threads that each
run their operations on one thread has no such wait: a thread slowed by a busy core takes fewer tensors.

torch keeps its intra-op thread count per thread once a thread has run a parallel operation (``omp_set_num_threads``
through ``torch.set_num_threads``), seeded from a process-wide default that ``torch.set_num_threads`` also sets.
:func:`lanes` starts its threads, has each set its own count to one, then sets the caller's count back, so the
process-wide default and the caller's threads are as they were.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_width = 0
_pid = 0
"""The process that started ``_pool``: a forked child has none of its threads and starts its own."""

MAX_LANES = 8
"""The most threads :func:`lanes` starts."""

_START_S = 60.0
"""How long :func:`lanes` waits for its threads to start, in seconds (``threading.BrokenBarrierError`` then)."""


def _single() -> None:
    torch.get_num_threads()  # torch's per-thread set-up first (it would later reset the count from the default)
    torch.set_num_threads(1)


def lanes() -> tuple[ThreadPoolExecutor, int]:
    """This process's lanes (started at the first call) and how many threads they have.

    As many threads as torch's intra-op threads in the caller at the first call, at most :data:`MAX_LANES` and at
    most the cores this process may run on; each runs torch's CPU operations on one thread. Submit work that
    releases the GIL (torch operations on large tensors) and wrap it in ``torch.no_grad()`` where needed: grad
    mode is per thread. A process forked after the first call starts lanes of its own at its first call.

    Raises:
        threading.BrokenBarrierError: the threads did not start within a minute.
    """
    global _pool, _width, _pid
    with _lock:
        if _pool is None or _pid != os.getpid():
            width = max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)), MAX_LANES))
            before = torch.get_num_threads()
            started = threading.Barrier(width + 1)

            def start() -> None:
                try:
                    _single()
                finally:
                    started.wait(_START_S)

            pool = ThreadPoolExecutor(width, thread_name_prefix="wsync-lane", initializer=start)
            for _ in range(width):  # a new thread per submit while none is idle: each blocks in start until all run
                pool.submit(lambda: None)
            try:
                started.wait(_START_S)
            except threading.BrokenBarrierError:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            finally:
                torch.set_num_threads(before)  # the process-wide default and this thread's count, as they were
            _pool, _width, _pid = pool, width, os.getpid()
        return _pool, _width
