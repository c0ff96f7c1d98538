"""Leaving the weight-sync group while another thread is posting a broadcast into it.

An engine's Cancel (or a receiver's failure) destroys the group while a
receiver thread may be posting the next bucket's broadcast. Dropping a gloo
process group with a collective still queued runs its destructor, which joins
the group's worker threads, i.e. waits for that receive to time out, holding
the GIL: the whole engine, gRPC server included, froze for the group timeout.
Real gloo groups of two ranks in this process; the trainer rank never sends.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Any

import pytest
import torch

from wsync_grpc.core.errors import GroupError
from wsync_grpc.group import process_group
from wsync_grpc.group.process_group import WeightSyncGroup, free_port, join_group

# Wall-clock bounds (a destroy or post within 1 s): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

TIMEOUT_S = 3.0


def pair() -> tuple[WeightSyncGroup, WeightSyncGroup]:
    """Rank 0 (trainer) and rank 1 of a fresh gloo group over loopback."""
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        f0 = ex.submit(
            join_group, master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=TIMEOUT_S
        )
        g1 = join_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S)
        return f0.result(), g1


class SlowReturn:
    """Torch's own process group whose ``broadcast`` posts for real, then returns only when told to.

    Holds the posting thread where the race was: the collective is queued in
    gloo, the caller has not yet recorded it.
    """

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.posted = threading.Event()
        self.release = threading.Event()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        work = self.pg.broadcast(tensors, opts)
        self.posted.set()
        self.release.wait(30)
        return work


def test_leaving_while_a_broadcast_is_being_posted_never_freezes_the_process() -> None:
    trainer, member = pair()
    try:
        slow = SlowReturn(member._pgs[0][0])
        member._pgs = {0: (slow, 0)}
        ticks: list[float] = []
        stop = threading.Event()

        def ticker() -> None:  # needs the GIL every 10 ms: a gap means the process froze
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        threading.Thread(target=ticker, daemon=True).start()
        posted: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def post() -> None:
            try:
                posted.set_result(member.broadcast(torch.zeros(8), src=0))
            except BaseException as e:
                posted.set_exception(e)

        threading.Thread(target=post, daemon=True).start()
        assert slow.posted.wait(10)
        del slow
        t0 = time.monotonic()
        member.destroy()
        assert time.monotonic() - t0 < 1.0, "destroy blocked on a collective"
        parked = [pg for pgs in process_group._PARKED for pg in pgs if isinstance(pg, SlowReturn)]
        assert parked, "the group was dropped with a broadcast being posted into it"
        t1 = time.monotonic()
        member_pg_wrapper = parked[0]
        member_pg_wrapper.release.set()
        work = posted.result(timeout=5)
        assert time.monotonic() - t1 < 1.0, "the post returned late"
        assert work is not None and not work.is_completed()  # the receive still waits for the trainer
        # The queued receives time out on their own; the reaper drops the group only then.
        deadline = time.monotonic() + TIMEOUT_S + 10
        while any(member_pg_wrapper in pgs for pgs in process_group._PARKED) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(member_pg_wrapper in pgs for pgs in process_group._PARKED), "the parked group was never released"
        assert work.is_completed()
        # Let the ticker tick once after the receive ended, so that its span covers the whole timeout
        # (otherwise the last tick may fall up to one tick interval before it).
        ended = time.monotonic()
        while ticks[-1] < ended and time.monotonic() < ended + 1.0:
            time.sleep(0.005)
        stop.set()
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert ticks[-1] - ticks[0] > TIMEOUT_S  # the ticker ran through the receive's timeout
        assert max(gaps) < 1.0, f"the process froze for {max(gaps):.1f} s"
    finally:
        trainer.destroy()
        member.destroy()


def test_a_broadcast_after_leaving_is_refused() -> None:
    trainer, member = pair()
    member.destroy()
    member.destroy()  # idempotent
    try:
        with pytest.raises(GroupError, match="left"):
            member.broadcast(torch.zeros(4), src=0)
    finally:
        trainer.destroy()
