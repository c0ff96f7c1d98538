"""Bounded waits on the weight-sync group's collectives.

Every wait ends by its deadline (:class:`~wsync_grpc.core.errors.GroupTimeout`),
when the collective fails (:class:`~wsync_grpc.core.errors.GroupError`), or
when its update is cancelled (:class:`~wsync_grpc.core.errors.Cancelled`);
none blocks forever.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from wsync_grpc.core.errors import Cancelled, GroupError, GroupTimeout
from wsync_grpc.group.process_group import error_summary

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
        GroupError: the collective failed (peer lost).
        Cancelled: ``cancelled`` was set.
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
                raise Cancelled("the update was cancelled")
    else:
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())
        while not done.wait(0.02):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("the update was cancelled")
            if time.monotonic() >= deadline:
                raise GroupTimeout("the collective did not finish before its deadline")
    try:
        work.wait()
    except RuntimeError as e:
        if "timed out" in str(e).lower():  # gloo's own per-collective timeout fired first
            raise GroupTimeout(f"the collective timed out: {error_summary(e)}") from e
        raise GroupError(f"collective failed: {error_summary(e)}") from e


def wait_all(
    works: Sequence[dist.Work], deadline: float, cancelled: threading.Event | None = None, *, sliced: bool = False
) -> None:
    """Wait for every work of ``works`` (posted in that order) until the monotonic ``deadline``.

    :func:`wait_work` hands each work a completion callback, which the
    collective's own thread must take the GIL to run: with thousands of small
    per-tensor collectives that stalled the wire between them. Here only the last work gets one; the
    earlier ones are checked once it has completed, and any that has not yet
    is waited for with :func:`wait_work` (``sliced`` as there).

    Raises:
        GroupTimeout: the deadline passed first.
        GroupError: a collective failed (peer lost).
        Cancelled: ``cancelled`` was set.
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
