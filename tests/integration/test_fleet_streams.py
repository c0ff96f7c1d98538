"""The trainer's long-lived streams over a fleet: one thread for them all, leases that follow the fleet.

The trainer's threads do not grow with the fleet: its leases and held Watch calls share one thread.
A trainer process (a child of the test, so that nothing else runs in it) syncs a fleet of 1, then of
16 real engine processes serving the ``tiny`` synthetic model, and counts its OS threads (psutil's
``num_threads``, gRPC's native threads included): while it holds the 16 leases after the sync, and
while the update's 16 held ``Watch`` calls are open (from the sync's ``progress`` callback, during the
broadcast). Both counts must equal the 1-engine fleet's within :data:`SLACK` threads. It also records
the peak during the whole sync (sampled every millisecond), reported, not bounded: gRPC's synchronous
API runs a thread per channel while a fanned-out call (Prepare, Complete) is in flight.

The leases follow the fleet's engine list: an engine that leaves it is forgotten (its KeepAlive ends and
the engine is released at once), one that joins gets its call at the next start; closing ends the
stream loop's thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support import ENV, ROOT, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.testing import EngineProcess, spawn_engine, stop_all, wait_all
from wsync_grpc.trainer.fleet import Fleet
from wsync_grpc.trainer.lease import RETRY_S, Leases
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.streams import StreamClosed, StreamLoop

FLEET = 16
SLACK = 4
"""Threads the 16-engine trainer may have beyond the 1-engine one (gloo's and the store's own, say)."""

TRAINER = r"""
import gc, json, sys, threading, time
import psutil, torch
from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import TrainerClient

proc = psutil.Process()
weights = synthetic.build("tiny", seed=1, dtype=torch.bfloat16)


def settled() -> int:
    # gRPC's per-channel threads end a moment after their calls: the count once it stops changing.
    last, same = proc.num_threads(), 0
    for _ in range(100):
        time.sleep(0.05)
        now = proc.num_threads()
        same = same + 1 if now == last else 0
        last = now
        if same >= 10:
            break
    return last


def drained(to: int) -> int:
    # gRPC's process-wide threads (grpc.aio's poller, the event engine's) end once the last channel object
    # is collected, and a second or so later.
    deadline = time.monotonic() + 10
    while proc.num_threads() > to and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return proc.num_threads()


counts = {"before": proc.num_threads()}
for targets in json.loads(sys.argv[1]):
    n = len(targets)
    with TrainerClient(targets, group_timeout_s=60, rpc_timeout_s=60, bucket_bytes=64 << 10) as c:
        during = []
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.num_threads())
                time.sleep(0.001)

        def progress(p) -> None:
            if not during:
                during.append(settled())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            c.sync(weights.items(), f"v{n}", progress=progress)
        finally:
            stop.set()
            sampler.join()
        counts[f"holding_{n}"] = during[0]
        counts[f"peak_{n}"] = peak[0]
        counts[f"leased_{n}"] = settled()
    counts[f"closed_{n}"] = drained(counts["before"])
print(json.dumps(counts), flush=True)
"""


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    procs = [
        spawn_engine(
            ["--synthetic", "tiny", "--dtype", "bfloat16", "--grace", "1"],
            port_file=tmp_path / f"engine{i}.port",
            log=tmp_path / f"engine{i}.log",
            env=ENV,
            cwd=ROOT,
            wait=False,
            name=f"engine{i}",
        )
        for i in range(FLEET)
    ]
    try:
        wait_all(procs, timeout_s=300)
        yield procs
    finally:
        stop_all(procs, grace_s=2)


@pytest.mark.timeout(900)
def test_the_trainers_threads_are_the_same_for_1_and_16_engines(fleet: list[EngineProcess]) -> None:
    targets = [e.target for e in fleet]
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, json.dumps([targets[:1], targets])],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"trainer threads: {counts}")
    assert counts[f"leased_{FLEET}"] - counts["leased_1"] <= SLACK, counts
    assert counts[f"holding_{FLEET}"] - counts["holding_1"] <= SLACK, counts
    # Closing the client ends its stream loop, channels and threads: nothing left per engine.
    assert max(counts[f"closed_{FLEET}"], counts["closed_1"]) <= counts["before"] + SLACK, counts


def eventually(check: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not true within {within_s} s"
        time.sleep(0.02)


def claim(fleet: Fleet, target: str) -> None:
    """Give the fleet's member ``target`` its lease credential, as Init (or a disk Prepare) would: a KeepAlive
    on the member's own channel claims the free engine, and its first message hands the channel the credential."""
    call = fleet.member(target).stub.KeepAlive(pb.KeepAliveRequest(owner="lessee"), timeout=10)
    next(call)
    call.cancel()
    assert fleet.member(target).lease.credential


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wsync-streams"]


@pytest.mark.timeout(120)
def test_leases_follow_the_fleet_and_a_forgotten_engine_is_released_at_once() -> None:
    with tensor_server() as (a, _, stub_a), tensor_server() as (b, _, stub_b):
        targets = [a.address, b.address]
        settings = ClientSettings("127.0.0.1", None, "g", torch.device("cpu"), "gloo", None, 30, 60, 1 << 20, 64, 0, 0)
        fleet = Fleet(targets, settings, None, None, (), "lessee")
        leases = Leases(fleet)
        before = len(stream_threads())
        try:
            for t in targets:
                claim(fleet, t)
            leases.start()
            eventually(lambda: all(status(s).owner.keepalive_calls == 1 for s in (stub_a, stub_b)), 5)
            assert status(stub_b).owner.owner == "lessee"

            leases.forget(b.address)  # the engine leaves the fleet
            fleet.remove(b.address)
            eventually(lambda: not status(stub_b).HasField("owner"), 1)  # no ttl: released at once
            leases.start()  # reads the fleet as it is now: not reopened
            time.sleep(RETRY_S * 1.5)
            assert not status(stub_b).HasField("owner") and status(stub_a).owner.keepalive_calls == 1

            fleet.add(b.address)  # it joins again
            claim(fleet, b.address)
            leases.start()
            eventually(lambda: status(stub_b).owner.keepalive_calls == 1, 5)

            fleet.reconnect(fleet.member(a.address))  # fresh channels: the lease moves to the new one
            eventually(lambda: status(stub_a).owner.keepalive_calls == 1 and status(stub_a).owner.owner == "lessee", 5)
            time.sleep(RETRY_S * 1.5)
            assert status(stub_a).owner.keepalive_calls == 1 and not leases.lost
            assert len(stream_threads()) == before + 1
        finally:
            leases.close()
            fleet.close()
        eventually(lambda: not status(stub_a).HasField("owner") and not status(stub_b).HasField("owner"), 1)
        assert len(stream_threads()) == before
        leases.close()  # idempotent
        fleet.close()
        leases.start()  # a no-op once closed


def test_a_stream_loop_runs_on_one_thread_from_its_first_use_to_its_close() -> None:
    before = len(stream_threads())
    loop = StreamLoop((), None)
    assert len(stream_threads()) == before  # nothing started until used

    async def where() -> str:
        return threading.current_thread().name

    assert loop.run(where()) == loop.run(where()) == "wsync-streams"
    assert len(stream_threads()) == before + 1
    loop.close()
    loop.close()  # idempotent
    assert len(stream_threads()) == before and loop.closed
    with pytest.raises(StreamClosed):
        loop.run(where())
    loop.drop("127.0.0.1:1")  # nothing to drop once closed
