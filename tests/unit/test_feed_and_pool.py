"""The worker side's plumbing: the bucket feed (worker.feed) and the receive buffer pool (worker.buffers)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from wsync_grpc.core.errors import GroupTimeout
from wsync_grpc.core.layout import Bucket, TensorSlot
from wsync_grpc.worker.buffers import BufferPool
from wsync_grpc.worker.feed import BucketFeed

CPU = torch.device("cpu")


def bucket(i: int, size: int = 16) -> Bucket:
    return Bucket(i, size, (TensorSlot(f"t{i}", torch.uint8, (size,), 0, size, f"t{i}"),))


# ----------------------------------------------------------------------- feed


def test_get_without_waiting() -> None:
    feed = BucketFeed()
    feed.extend([bucket(0, 8), bucket(1, 32)])
    assert len(feed) == 2 and feed.max_size_bytes == 32
    assert feed.get(1, 0) == bucket(1, 32)
    with pytest.raises(LookupError):
        feed.get(2, 0)  # not declared yet, feed still open
    feed.close()
    assert feed.closed and feed.get(2, 0) is None
    assert feed.get(0, 0) == bucket(0, 8), "buckets declared before close stay readable"


def test_get_waits_for_a_bucket_declared_later() -> None:
    feed = BucketFeed()
    threading.Timer(0.05, feed.extend, args=([bucket(0)],)).start()
    t0 = time.monotonic()
    assert feed.get(0, 5.0) == bucket(0)
    assert time.monotonic() - t0 < 2.0


def test_get_times_out() -> None:
    feed = BucketFeed()
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"no bucket 0 was declared within 0\.1 s"):
        feed.get(0, 0.1)
    assert time.monotonic() - t0 >= 0.09


def test_close_wakes_a_waiting_reader() -> None:
    feed = BucketFeed()
    feed.extend([bucket(0)])
    threading.Timer(0.05, feed.close).start()
    t0 = time.monotonic()
    assert feed.get(1, 5.0) is None
    assert time.monotonic() - t0 < 2.0
    feed.close()  # idempotent
    assert feed.closed


def test_max_size_tracks_every_extend() -> None:
    feed = BucketFeed()
    assert feed.max_size_bytes == 0
    feed.extend([bucket(0, 100)])
    feed.extend([bucket(1, 10)])
    assert feed.max_size_bytes == 100
    feed.extend([])
    assert feed.max_size_bytes == 100 and len(feed) == 2


# ----------------------------------------------------------------------- pool


def base_ptr(t: torch.Tensor) -> int:
    return (t if t._base is None else t._base).data_ptr()


def test_take_gives_a_view_of_the_smallest_free_buffer_that_fits() -> None:
    pool = BufferPool(CPU, keep=True)
    small, large = pool.take(100), pool.take(1000)
    assert small.numel() == 100 and small.dtype == torch.uint8 and large.numel() == 1000
    pool.give(small)
    pool.give(large)
    assert pool.free_bytes == 1100
    got = pool.take(50)
    assert got.numel() == 50 and base_ptr(got) == small.data_ptr(), "the 100-byte buffer, not the 1000-byte one"
    assert pool.free_bytes == 1000


def test_take_allocates_capacity_for_larger_buckets_to_come() -> None:
    pool = BufferPool(CPU, keep=True)
    first = pool.take(10, capacity=500)
    assert first.numel() == 10 and first._base is not None and first._base.numel() == 500
    pool.give(first)
    assert pool.free_bytes == 500, "the whole buffer comes back, not the view"
    again = pool.take(400)
    assert base_ptr(again) == base_ptr(first)


def test_giving_the_same_buffer_twice_keeps_one_copy() -> None:
    pool = BufferPool(CPU, keep=True)
    buf = pool.take(64)
    pool.give(buf)
    pool.give(buf)
    assert pool.free_bytes == 64


def test_take_exact_is_a_buffer_of_its_own() -> None:
    pool = BufferPool(CPU, keep=True)
    big = pool.take(1000)
    pool.give(big)
    exact = pool.take_exact(10)
    assert exact.numel() == 10 and exact._base is None, "not a view of the 1000-byte buffer"
    assert pool.free_bytes == 1000
    pool.give(exact)
    assert pool.take_exact(10).data_ptr() == exact.data_ptr(), "an exact-size free buffer is reused"


def test_trim_without_keep_drops_every_free_buffer() -> None:
    pool = BufferPool(CPU, keep=False)
    pool.give(pool.take(100))
    pool.trim()
    assert pool.free_bytes == 0


def test_trim_with_keep_keeps_only_what_the_update_used() -> None:
    pool = BufferPool(CPU, keep=True)
    a, b = pool.take(100), pool.take(200)
    pool.give(a)
    pool.give(b)
    pool.trim()  # end of update 1: both were used
    assert pool.free_bytes == 300
    again = pool.take(150)  # update 2 uses only the 200-byte buffer
    pool.give(again)
    pool.trim()
    assert pool.free_bytes == 200


def test_memory_given_back_as_used_is_kept() -> None:
    pool = BufferPool(CPU, keep=True)
    pool.trim()
    served_before = torch.empty(64, dtype=torch.uint8)
    pool.give(served_before, used=True)  # what an engine gave back for a swapped-in buffer
    pool.give(torch.empty(32, dtype=torch.uint8))  # not used by this update
    pool.trim()
    assert pool.free_bytes == 64


def test_leftovers_too_small_are_released_before_allocating() -> None:
    pool = BufferPool(CPU, keep=True)
    pool.give(pool.take(100))
    pool.trim()  # a 100-byte buffer left from update 1
    assert pool.free_bytes == 100
    big = pool.take(1000)  # update 2 needs more: the unused leftover goes
    assert big.numel() == 1000 and pool.free_bytes == 0
    pool.give(big)
    pool.trim()
    assert pool.free_bytes == 1000


def test_a_delta_update_keeps_the_whole_updates_buffers_for_the_next_one() -> None:
    """A delta (``trim(keep_earlier=True)``) keeps what the whole update before it kept besides its own; the whole
    update after it uses those buffers again and keeps only what it used."""
    pool = BufferPool(CPU, keep=True)
    flat = pool.take(1000)
    pool.give(flat)
    pool.trim()  # a whole update: its 1000-byte receive buffer kept
    rebuilt = pool.take_exact(40)  # a delta: a rebuilt tensor; the served one it replaces given back
    pool.give(torch.empty(40, dtype=torch.uint8), used=True)
    pool.trim(keep_earlier=True)
    assert pool.free_bytes == 1040
    again = pool.take(900)  # the next whole update
    assert again.data_ptr() == flat.data_ptr(), "the whole update's buffer is taken again, memory already touched"
    pool.give(again)
    pool.trim()
    assert pool.free_bytes == 1000
    del rebuilt
