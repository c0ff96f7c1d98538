"""Lanes (:mod:`wsync_grpc.core.lanes`): threads that run torch's CPU operations on one intra-op thread each,
leaving the caller's and the process's thread counts as they were."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from wsync_grpc.core.delta import delta_of
from wsync_grpc.core.lanes import MAX_LANES, lanes
from wsync_grpc.trainer.delta import DeltaTracker


def test_each_lane_runs_torch_on_one_thread_and_the_callers_count_is_kept() -> None:
    before = torch.get_num_threads()
    pool, width = lanes()
    assert 1 <= width <= min(MAX_LANES, len(os.sched_getaffinity(0)))
    counts = [pool.submit(torch.get_num_threads).result() for _ in range(4 * width)]
    assert counts == [1] * len(counts)
    assert torch.get_num_threads() == before
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # a thread started afterwards
    t.start()
    t.join()
    assert seen == [before]
    assert lanes() == (pool, width)  # one set per process


def test_lanes_compute_what_the_caller_would() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    pool, _ = lanes()
    assert torch.equal(pool.submit(lambda: (x * 3).to(torch.bfloat16)).result(), (x * 3).to(torch.bfloat16))


def test_a_delta_diffed_on_lanes_is_the_one_diffed_on_this_thread() -> None:
    """:meth:`DeltaTracker.encode_tensors` diffs on the lanes, reading ahead or not: the same wires and entries as
    :func:`~wsync_grpc.core.delta.delta_of` on this thread, in the source's order, this thread's count kept."""
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(64 + i, 96, generator=g) for i in range(12)}
    weights["empty"] = torch.empty(0, 4)
    before = torch.get_num_threads()
    for read_ahead in (True, False):
        tracker = DeltaTracker()
        tracker.applied("v1", tracker.encode_tensors(weights, torch.bfloat16, read_ahead=read_ahead), {})
        moved = {n: w.clone() for n, w in weights.items()}
        for i, w in enumerate(moved.values()):
            w.view(-1)[:: 7 + i] += 0.5  # a few elements of every tensor change
        payload = tracker.encode_tensors(iter(list(moved.items())), torch.bfloat16, read_ahead=read_ahead)
        assert list(payload.wires) == list(weights)
        changed = 0
        for name, w in moved.items():
            wire = w.to(torch.bfloat16)
            assert torch.equal(payload.wires[name].view(torch.int16), wire.view(torch.int16))
            expected, k = delta_of(wire, weights[name].to(torch.bfloat16))
            changed += k
            entry = payload.entries.get(name)
            assert (entry is None) == (expected is None), name
            if entry is not None and expected is not None:
                assert entry.coding == expected.coding and torch.equal(entry.payload, expected.payload)
        assert payload.summary is not None and payload.summary.delta_tensors == len(payload.entries) > 0
        assert payload.summary.changed_elements == changed
    assert torch.get_num_threads() == before


def test_a_source_that_fails_mid_read_fails_the_encode_after_the_lanes_end() -> None:
    """A source that raises after some tensors (a sharded rank lost mid-gather) fails the call with its error;
    the tensors already on the lanes end first, and the next encode works."""
    weights = [(f"w{i}", torch.full((256, 256), float(i))) for i in range(6)]

    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        yield from weights[:3]
        raise RuntimeError("rank lost mid-gather")

    tracker = DeltaTracker()
    for read_ahead in (True, False):
        with pytest.raises(RuntimeError, match="rank lost"):
            tracker.encode_tensors(failing(), torch.bfloat16, read_ahead=read_ahead)
    payload = tracker.encode_tensors(dict(weights), torch.bfloat16)
    assert list(payload.wires) == [n for n, _ in weights]
