"""When a client with deltas on falls back to whole syncs (:class:`~wsync_grpc.trainer.delta.DeltaCosts`): the plan
that follows from the times its syncs of either kind took, per byte of the whole update."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from wsync_grpc.trainer.delta import DeltaCosts, SyncPlan
from wsync_grpc.trainer.results import DeltaSummary

WHOLE_BYTES = 1000


def summary(delta: bool, diff_s: float = 0.0, whole_targets: tuple[str, ...] = ()) -> DeltaSummary:
    """A sync's ``SyncResult.delta``: a delta against "v0", or whole."""
    return DeltaSummary("v0" if delta else "", 3, 3 if delta else 0, 10, 100, diff_s, WHOLE_BYTES, 5, 5, whole_targets)


def run(costs: DeltaCosts, delta_s: float, whole_s: Callable[[int], float], syncs: int) -> list[SyncPlan]:
    """``syncs`` syncs as ``costs`` plans them, a delta taking ``delta_s`` (half of it the diff) and whole sync i
    ``whole_s(i)``; the client keeps a base after every sync but a plain one."""
    plans: list[SyncPlan] = []
    has_base = False
    for i in range(syncs):
        plan = costs.plan(has_base)
        plans.append(plan)
        is_delta = plan is SyncPlan.DELTA and has_base
        seconds = delta_s / 2 if is_delta else whole_s(i)
        costs.record(plan, summary(is_delta, delta_s / 2 if is_delta else 0.0), seconds)
        has_base = plan is not SyncPlan.PLAIN
    return plans


D, K, P = SyncPlan.DELTA, SyncPlan.KEEP, SyncPlan.PLAIN


def test_deltas_that_cost_more_than_whole_syncs_fall_back_and_are_tried_again_every_probe_every_syncs() -> None:
    """First whole (timed), then a delta (the client's first, not counted) and another (timed); the delta lost:
    plain whole syncs, one that keeps its tensors, then a delta again, every probe_every syncs."""
    plans = run(DeltaCosts(probe_every=4), delta_s=2.0, whole_s=lambda i: 1.0, syncs=14)
    assert plans == [D, D, D, P, P, K, D, P, P, K, D, P, P, K]


def test_deltas_that_cost_less_go_on_and_a_whole_sync_is_timed_again_now_and_then() -> None:
    """Deltas win by less than half: a whole sync again after probe_every deltas; by more: after four times as many."""
    close = run(DeltaCosts(probe_every=3), delta_s=0.8, whole_s=lambda i: 1.0, syncs=10)
    assert close == [D, D, D, D, D, K, D, D, D, K]  # the first delta (sync 1) not counted
    far = run(DeltaCosts(probe_every=2), delta_s=0.1, whole_s=lambda i: 1.0, syncs=12)
    assert far == [D, D, D, D, D, D, D, D, D, D, K, D]


def test_a_slow_first_whole_sync_is_outvoted_once_whole_syncs_are_timed_again() -> None:
    """The first sync, slowed by the engines' first touch of their memory, makes deltas look 4x faster; whole syncs
    timed again later take the median below the deltas' time, and the client falls back."""
    costs = DeltaCosts(probe_every=2, window=3)
    plans = run(costs, delta_s=1.2, whole_s=lambda i: 5.0 if i == 0 else 1.0, syncs=23)
    assert plans[:12] == [D] * 10 + [K, D]  # 9 deltas (8 counted), then a whole sync timed: median 3.0 s
    assert plans[12:20] == [D] * 7 + [K]  # 8 more, timed again: median 1.0 s, deltas lose
    assert plans[20:] == [D, K, D]  # the delta that was due; then every probe_every syncs
    delta, whole = costs.seconds_per_byte()
    assert whole == pytest.approx(1.0 / WHOLE_BYTES) and delta == pytest.approx(1.2 / WHOLE_BYTES)


def test_mixed_syncs_are_not_counted_and_bad_settings_are_refused() -> None:
    costs = DeltaCosts()
    costs.record(SyncPlan.DELTA, summary(True, 0.1, whole_targets=("b:1",)), 0.1)
    assert costs.seconds_per_byte() == (None, None)
    for probe_every, window in ((1, 5), (8, 0)):
        with pytest.raises(ValueError, match="probe_every"):
            DeltaCosts(probe_every, window)
