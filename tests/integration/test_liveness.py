"""Failures noticed within about a second, whatever the group timeout (the held Watch of each update).

- A real ``TrainerClient`` process is SIGKILLed at random points of the broadcast of a 0.25 GB model
  (mid-collective, not only between buckets): the engine reaches FAILED with PEER_LOST within 2 s
  (staged: the old weights, clean; streaming: dirty and paused), and a later sync succeeds.
- An engine is SIGKILLed mid-broadcast: the trainer's ``SyncError`` names it within 2 s, and the
  other engine's update is cancelled with its weights intact.
- A trainer process is SIGKILLed at a random point of an engine's read of a 0.25 GB checkpoint (chosen by
  the bytes read): staged, the engine abandons the update within 2 s; streaming, it finishes the read.
- A trainer process stopped (SIGSTOP) for 3 s mid-broadcast, then continued: a stall below the
  keepalive's tolerance (20 s by default) is not a death, and the sync completes.
- The trainer's held Watch ends while it lives on (a dropped connection): the engine keeps the broadcast
  update while buckets arrive and once the trainer re-attaches a held Watch; with neither, it declares
  the trainer lost within two periods of ``REATTACH_S``.
- A frozen trainer or engine (SIGSTOP for good) is dropped by HTTP/2 keepalive, configured here to a
  ping every second with 2 s to answer (``--keepalive-interval``/``--keepalive-timeout``, and
  ``TrainerClient(keepalive=...)``), within their sum plus a margin.
The group timeout is 60 s, so nothing here can pass by waiting for it.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support import ENV, ROOT, join_as_trainer, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.group.waits import wait_work
from wsync_grpc.service.watch import REATTACH_S
from wsync_grpc.testing import EngineProcess, spawn_engine
from wsync_grpc.trainer import EngineStatus, Keepalive, SyncError, SyncProgress, TrainerClient

# Wall-clock bounds (deaths and stalls noticed within seconds): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

GROUP_TIMEOUT_S = 60.0
BOUND_S = 2.0
PRESET = "0.25gb"

TRAINER = r"""
import sys, time, torch
from wsync_grpc.engines import synthetic
from wsync_grpc.group.waits import wait_work
from wsync_grpc.service.watch import REATTACH_S
from wsync_grpc.trainer import TrainerClient

target, mode = sys.argv[1], sys.argv[2]
old = synthetic.build("0.25gb", seed=1, dtype=torch.bfloat16)
new = synthetic.build("0.25gb", seed=2, dtype=torch.bfloat16)
with TrainerClient([target], group_timeout_s=60, rpc_timeout_s=30, bucket_bytes=8 << 20, solo_bytes=0) as c:
    c.sync(old.items(), "old", apply_mode=mode)
    print("synced old", flush=True)
    def progress(p):
        print(f"bucket {p.buckets_sent}/{p.bucket_count}", flush=True)
    c.sync(new.items(), "new", apply_mode=mode, progress=progress)
    print("synced new", flush=True)
    time.sleep(120)
"""


def wait_for(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    """The first line of ``proc``'s stdout that starts with ``prefix``."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError(f"no {prefix!r} line within {timeout_s} s")


def kill_and_wait_for_the_end(trainer: subprocess.Popen[str], stub: Any) -> tuple[pb.GetStatusResponse, float]:
    """SIGKILL ``trainer``; the engine's status once the update failed or applied ``new`` (at most ``BOUND_S``)."""
    try:
        trainer.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        trainer.wait(10)
    finally:
        trainer.kill()
    st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    while st.state != pb.LIFECYCLE_STATE_FAILED and st.weight_version != "new":
        assert time.monotonic() - killed < BOUND_S, f"engine still {pb.LifecycleState.Name(st.state)}"
        time.sleep(0.02)
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    return st, time.monotonic() - killed


def served(target: str) -> tuple[EngineStatus, dict[str, str]]:
    with TrainerClient([target], rpc_timeout_s=30) as c:
        return c.status()[target], {x.name: x.sha256 for x in c.checksums()[target].checksums}


def spawn(tmp_path: Path, *args: str, name: str = "engine") -> EngineProcess:
    """An engine process serving the synthetic model, with ``args`` added to ``wsync serve``'s."""
    return spawn_engine(
        ["--synthetic", PRESET, "--dtype", "bfloat16", "--grace", "1", *args],
        port_file=tmp_path / f"{name}.port",
        log=tmp_path / f"{name}.log",
        env=ENV,
        cwd=ROOT,
        name=name,
    )


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EngineProcess]:
    e = spawn(tmp_path)
    yield e
    e.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_a_killed_trainer_is_noticed_within_two_seconds(engine: EngineProcess, mode: str) -> None:
    old = {n: tensor_sha256(t) for n, t in synthetic.build(PRESET, seed=1, dtype=torch.bfloat16).items()}
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(engine.target))
    rng = random.Random(f"kills-{mode}")
    mid_broadcast = 0
    for _ in range(4):
        cmd = [sys.executable, "-c", TRAINER, engine.target, mode]
        trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        try:
            wait_for(trainer, "synced old", 120)
            wait_for(trainer, "bucket 1/", 60)
            time.sleep(rng.uniform(0.0, 0.1))  # somewhere in the broadcast, between or inside collectives
        except BaseException:
            trainer.kill()
            raise
        st, noticed = kill_and_wait_for_the_end(trainer, stub)
        if st.weight_version == "new":
            continue  # the kill came after the last byte: nothing to notice
        mid_broadcast += 1
        print(f"{mode}: the engine noticed the dead trainer after {noticed:.2f} s")
        assert st.last_error.reason == "PEER_LOST", st.last_error
        assert st.weight_version == "old"
        status, sums = served(engine.target)
        if mode == "staged":
            assert sums == old and not status.dirty and not status.paused, "staged: the old weights, clean"
        else:
            assert status.dirty and status.paused, "streaming: half-updated weights are flagged and not served"
    assert mid_broadcast >= 2, f"only {mid_broadcast} of 4 kills landed before the last byte"
    # The engine takes the next trainer: a complete sync clears everything.
    fresh = synthetic.build(PRESET, seed=3, dtype=torch.bfloat16)
    with TrainerClient([engine.target], group_timeout_s=GROUP_TIMEOUT_S, rpc_timeout_s=30) as c:
        c.sync(fresh.items(), "after", apply_mode=mode)
    status, sums = served(engine.target)
    assert status.weight_version == "after" and not status.dirty and not status.paused
    assert sums == {n: tensor_sha256(t) for n, t in fresh.items()}


def spawn_pair(tmp_path: Path) -> list[EngineProcess]:
    """Two engines serving the same synthetic model: ``survivor`` and ``victim``."""
    return [spawn(tmp_path, name=name) for name in ("survivor", "victim")]


@pytest.mark.timeout(300)
def test_a_killed_engine_is_named_within_two_seconds(tmp_path: Path) -> None:
    engines = survivor, victim = spawn_pair(tmp_path)
    try:
        before = served(survivor.target)[1]
        killed: list[float] = []

        def kill_after_first(p: SyncProgress) -> None:
            if p.buckets_sent == 1:
                victim.process.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())

        targets = [survivor.target, victim.target]
        with TrainerClient(targets, group_timeout_s=GROUP_TIMEOUT_S, rpc_timeout_s=30, solo_bytes=0) as client:
            tensors = synthetic.build(PRESET, seed=9, dtype=torch.bfloat16)
            with pytest.raises(SyncError) as info:
                client.sync(tensors.items(), "doomed", bucket_bytes=8 << 20, progress=kill_after_first)
            noticed = time.monotonic() - killed[0]
            print(f"the trainer named the dead engine after {noticed:.2f} s")
            err = info.value
            assert noticed < BOUND_S, f"the trainer took {noticed:.2f} s"
            assert victim.target in err.failures and victim.target in str(err), err
            assert err.failures[victim.target].code is not None
            assert err.cancelled.get(survivor.target) is True
        status, sums = served(survivor.target)
        assert status.last_error.reason in ("UPDATE_CANCELLED", "PEER_LOST"), status.last_error
        assert sums == before and status.weight_version == "", "staged: the survivor's weights are intact"
    finally:
        for e in engines:
            e.stop()


SLOW_TRAINER = r"""
import sys, time, torch
from wsync_grpc.engines import synthetic
from wsync_grpc.group.waits import wait_work
from wsync_grpc.service.watch import REATTACH_S
from wsync_grpc.trainer import TrainerClient

target = sys.argv[1]
old = synthetic.build("0.25gb", seed=1, dtype=torch.bfloat16)
new = synthetic.build("0.25gb", seed=2, dtype=torch.bfloat16)
with TrainerClient([target], group_timeout_s=60, rpc_timeout_s=30, bucket_bytes=8 << 20, solo_bytes=0) as c:
    c.sync(old.items(), "old")
    print("synced old", flush=True)
    def progress(p):
        print(f"bucket {p.buckets_sent}/{p.bucket_count}", flush=True)
        time.sleep(0.2)  # a broadcast of several seconds: the stall lands inside it
    c.sync(new.items(), "new", progress=progress)
    print("synced new", flush=True)
    time.sleep(120)
"""

STALL_S = 3.0
"""A stall of the trainer's whole process (garbage collection, a loaded host), in seconds: below the tolerance."""


@pytest.mark.timeout(300)
def test_a_trainer_stalled_for_three_seconds_mid_broadcast_completes_its_sync(engine: EngineProcess) -> None:
    """SIGSTOP for 3 s then SIGCONT: keepalive tolerates 20 s without an answer, so the stall is no death."""
    new = {n: tensor_sha256(t) for n, t in synthetic.build(PRESET, seed=2, dtype=torch.bfloat16).items()}
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(engine.target))
    cmd = [sys.executable, "-c", SLOW_TRAINER, engine.target]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        wait_for(trainer, "synced old", 120)
        wait_for(trainer, "bucket 2/", 60)
        trainer.send_signal(signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
            during = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        finally:
            trainer.send_signal(signal.SIGCONT)
        assert during.state == pb.LIFECYCLE_STATE_RECEIVING, "the stall landed inside the broadcast"
        assert during.update.buckets_received < during.update.buckets_expected, during.update
        wait_for(trainer, "synced new", 120)
    finally:
        trainer.kill()
        trainer.wait(10)
    status, sums = served(engine.target)
    assert status.weight_version == "new" and status.last_error is None, status
    assert sums == new


FAST_KEEPALIVE = Keepalive(interval_s=1.0, timeout_s=2.0)
"""Keepalive of the frozen-peer tests: a ping every second, 2 s to answer (the defaults take 10 s + 20 s)."""

FROZEN_BOUND_S = 8.0
"""A frozen peer announces nothing: HTTP/2 keepalive (here a ping every 1 s, 2 s to answer) notices it."""


@pytest.fixture
def fast_keepalive_engine(tmp_path: Path) -> Iterator[EngineProcess]:
    """An engine whose server pings every second and drops a connection after 2 s without an answer."""
    e = spawn(tmp_path, "--keepalive-interval", "1", "--keepalive-timeout", "2")
    yield e
    e.stop()


@pytest.mark.timeout(300)
def test_a_frozen_trainer_is_noticed_by_keepalive_long_before_the_group_timeout(
    fast_keepalive_engine: EngineProcess,
) -> None:
    """SIGSTOP, not SIGKILL: no FIN or RST reaches the engine, only its keepalive pings go unanswered."""
    engine = fast_keepalive_engine
    old = {n: tensor_sha256(t) for n, t in synthetic.build(PRESET, seed=1, dtype=torch.bfloat16).items()}
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(engine.target))
    cmd = [sys.executable, "-c", TRAINER, engine.target, "staged"]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        wait_for(trainer, "synced old", 120)
        wait_for(trainer, "bucket 1/", 60)
        trainer.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        while st.state != pb.LIFECYCLE_STATE_FAILED and st.weight_version != "new":
            assert time.monotonic() - frozen < FROZEN_BOUND_S, f"engine still {pb.LifecycleState.Name(st.state)}"
            time.sleep(0.05)
            st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        noticed = time.monotonic() - frozen
    finally:
        trainer.kill()
        trainer.wait(10)
    if st.weight_version == "new":
        pytest.skip("the broadcast ended before the trainer froze")
    print(f"the engine noticed the frozen trainer after {noticed:.2f} s")
    assert st.last_error.reason == "PEER_LOST", st.last_error
    assert served(engine.target)[1] == old


@pytest.mark.timeout(300)
def test_a_frozen_engine_is_named_by_keepalive_long_before_the_group_timeout(tmp_path: Path) -> None:
    """SIGSTOP of one engine mid-broadcast: the trainer's keepalive drops it, and the sync fails naming it."""
    engines = survivor, victim = spawn_pair(tmp_path)
    try:
        before = served(survivor.target)[1]
        frozen: list[float] = []

        def freeze_after_first(p: SyncProgress) -> None:
            if p.buckets_sent == 1:
                victim.process.send_signal(signal.SIGSTOP)
                frozen.append(time.monotonic())

        targets = [survivor.target, victim.target]
        with TrainerClient(
            targets, group_timeout_s=GROUP_TIMEOUT_S, rpc_timeout_s=30, solo_bytes=0, keepalive=FAST_KEEPALIVE
        ) as client:
            tensors = synthetic.build(PRESET, seed=9, dtype=torch.bfloat16)
            with pytest.raises(SyncError) as info:
                client.sync(tensors.items(), "doomed", bucket_bytes=8 << 20, progress=freeze_after_first)
            noticed = time.monotonic() - frozen[0]
            victim.kill()
            print(f"the trainer named the frozen engine after {noticed:.2f} s")
            assert noticed < FROZEN_BOUND_S, f"the trainer took {noticed:.2f} s"
            assert victim.target in info.value.failures, info.value
        status, sums = served(survivor.target)
        assert sums == before and status.weight_version == "", "staged: the survivor's weights are intact"
    finally:
        victim.kill()
        for e in engines:
            e.stop()


DISK_TRAINER = r"""
import sys, time
from wsync_grpc.trainer import TrainerClient

target, mode, root = sys.argv[1], sys.argv[2], sys.argv[3]
with TrainerClient([target], group_timeout_s=60, rpc_timeout_s=30) as c:
    print("synced old", flush=True)
    c.sync_from_disk(root + "/new", "new", apply_mode=mode, on_phase=lambda p: print(p, flush=True))
    print("synced new", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_a_trainer_killed_while_the_engine_reads_a_checkpoint(tmp_path: Path, mode: str) -> None:
    """The trainer's process SIGKILLed at a random point of the engine's read (by bytes read) of a 0.25 GB file.

    Staged: the trainer had only asked to verify (the fleet commit's first
    phase), so the engine abandons the update within 2 s (PEER_LOST) and
    serves the old weights, clean. Streaming: the trainer's Complete was
    already sent (a streaming update has no verify phase): the engine
    finishes reading on its own and serves the whole new checkpoint.
    """
    from wsync_grpc.transports.disk.writer import save_checkpoint

    root = tmp_path / "root"
    old_tensors = synthetic.build(PRESET, seed=1, dtype=torch.bfloat16)
    new_tensors = synthetic.build(PRESET, seed=2, dtype=torch.bfloat16)
    save_checkpoint(old_tensors.items(), root / "old")
    save_checkpoint(new_tensors.items(), root / "new")
    old = {n: tensor_sha256(t) for n, t in old_tensors.items()}
    new = {n: tensor_sha256(t) for n, t in new_tensors.items()}
    engine = spawn_engine(
        ["--synthetic", PRESET, "--dtype", "bfloat16", "--grace", "1", "--checkpoint-root", str(root)],
        port_file=tmp_path / "engine.port",
        log=tmp_path / "engine.log",
        env=ENV,
        cwd=ROOT,
    )
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(engine.target))
    rng = random.Random(f"disk-kills-{mode}")
    mid_read = 0
    try:
        with TrainerClient([engine.target], rpc_timeout_s=30) as c:
            c.sync_from_disk(root / "old", "old", apply_mode=mode)
        for _ in range(4):
            cmd = [sys.executable, "-c", DISK_TRAINER, engine.target, mode, str(root)]
            pipe = subprocess.PIPE
            trainer = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=ENV, cwd=ROOT)
            fraction = rng.uniform(0.05, 0.8)
            inside = False
            try:
                wait_for(trainer, "synced old", 120)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # poll the engine's read until it passed the chosen fraction
                    u = stub.GetStatus(pb.GetStatusRequest(), timeout=10).update
                    if u.weight_version == "new" and u.bytes_received >= fraction * u.bytes_expected > 0:
                        inside = u.bytes_received < u.bytes_expected
                        break
            except BaseException:
                trainer.kill()
                raise
            st, noticed = kill_and_wait_for_the_end(trainer, stub)
            status, sums = served(engine.target)
            mid_read += inside
            print(f"{mode}: killed inside the read: {inside}; the engine ended it after {noticed:.2f} s")
            if mode == "staged" and inside:
                assert st.last_error.reason == "PEER_LOST", st.last_error
                assert st.weight_version == "old" and sums == old and not status.dirty and not status.paused
            elif mode == "streaming":
                assert st.weight_version == "new" and sums == new and not status.dirty and not status.paused
            # Back to the old checkpoint for the next round, without a group.
            with TrainerClient([engine.target], rpc_timeout_s=30) as c:
                c.sync_from_disk(root / "old", "old", apply_mode=mode)
        assert mid_read >= 2, f"only {mid_read} of 4 kills landed inside the read"
        status, sums = served(engine.target)
        assert status.weight_version == "old" and not status.dirty and not status.paused and sums == old
        assert status.state is State.UNINITIALIZED
    finally:
        engine.stop()


PREPARED_TRAINER = r"""
import sys, time, grpc
from wsync.v1 import weight_sync_pb2 as pb, weight_sync_pb2_grpc
from wsync_grpc.wire.lease import lease_channel

target, root = sys.argv[1], sys.argv[2]
stub = weight_sync_pb2_grpc.WeightSyncServiceStub(lease_channel(grpc.insecure_channel(target))[0])
header = pb.PrepareHeader(weight_version="new", transport=pb.TRANSPORT_DISK, checkpoint_path=root + "/new")
stub.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)  # claims the lease: the credential is kept
keepalive = stub.KeepAlive(pb.KeepAliveRequest())
next(keepalive)
print("prepared", flush=True)  # and never a held Watch: a trainer caught between Prepare's reply and its Watch
time.sleep(120)
"""


def test_a_trainer_killed_before_its_held_watch_is_noticed_by_its_keepalive(tmp_path: Path) -> None:
    """A trainer SIGKILLed after Prepare's reply and before it opened its held Watch (the engine reads the
    checkpoint on its own from Prepare on): the end of its KeepAlive call stands for it, and the staged update is
    abandoned within 2 s (PEER_LOST) with the old weights served, clean."""
    from wsync_grpc.transports.disk.writer import save_checkpoint

    root = tmp_path / "root"
    old_tensors = synthetic.build("tiny", seed=1, dtype=torch.bfloat16)
    save_checkpoint(old_tensors.items(), root / "old")
    save_checkpoint(synthetic.build("tiny", seed=2, dtype=torch.bfloat16).items(), root / "new")
    old = {n: tensor_sha256(t) for n, t in old_tensors.items()}
    engine = spawn_engine(
        ["--synthetic", "tiny", "--dtype", "bfloat16", "--checkpoint-root", str(root)],
        port_file=tmp_path / "engine.port",
        log=tmp_path / "engine.log",
        env=ENV,
        cwd=ROOT,
    )
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(engine.target))
    try:
        with TrainerClient([engine.target], rpc_timeout_s=30) as c:
            c.sync_from_disk(root / "old", "old")
        cmd = [sys.executable, "-c", PREPARED_TRAINER, engine.target, str(root)]
        pipe = subprocess.PIPE
        trainer = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=ENV, cwd=ROOT)
        try:
            wait_for(trainer, "prepared", 60)
        except BaseException:
            trainer.kill()
            raise
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).update.weight_version == "new"
        st, noticed = kill_and_wait_for_the_end(trainer, stub)
        print(f"the engine ended it {noticed:.2f} s after the kill")
        assert st.state == pb.LIFECYCLE_STATE_FAILED and st.last_error.reason == "PEER_LOST", st
        assert "KeepAlive" in st.last_error.message
        status, sums = served(engine.target)
        assert status.weight_version == "old" and sums == old and not status.dirty and not status.paused
    finally:
        engine.stop()


NAMES = ("model.norm.weight", "model.layers.1.input_layernorm.weight")


def two_buckets(version: str) -> list[pb.PrepareRequest]:
    """A Prepare stream of two one-tensor buckets (64 bfloat16 each) of the tiny synthetic model."""
    stream = [pb.PrepareRequest(header=pb.PrepareHeader(weight_version=version, bucket_count=2, total_bytes=256))]
    for i, name in enumerate(NAMES):
        spec = pb.BucketSpec(index=i, size_bytes=128)
        spec.tensors.add(name=name, dtype="bfloat16", shape=[64], offset_bytes=0)
        stream.append(pb.PrepareRequest(bucket=spec))
    return stream


def held(stub: weight_sync_pb2_grpc.WeightSyncServiceStub, update_id: str) -> Any:
    """A held Watch on ``update_id``, its first message read."""
    call = stub.Watch(pb.WatchRequest(update_id=update_id, hold=True))
    next(call)
    return call


@pytest.mark.timeout(120)
def test_a_dropped_watch_is_no_death_while_buckets_arrive_or_the_trainer_reattaches() -> None:
    with tensor_server("tiny") as (_srv, _engine, stub):
        trainer = join_as_trainer(stub)
        try:
            bucket = torch.zeros(128, dtype=torch.uint8)
            update = stub.Prepare(iter(two_buckets("kept")), timeout=30).update_id
            held(stub, update).cancel()  # the connection dropped; the trainer lives on
            time.sleep(REATTACH_S * 0.6)
            wait_work(trainer.broadcast(bucket), time.monotonic() + 30)  # type: ignore[attr-defined]
            time.sleep(REATTACH_S * 0.6)
            again = held(stub, update)  # the trainer re-attaches
            time.sleep(REATTACH_S * 3)
            st = status(stub)
            assert st.state == pb.LIFECYCLE_STATE_RECEIVING and st.last_error.reason == "", st
            wait_work(trainer.broadcast(bucket), time.monotonic() + 30)  # type: ignore[attr-defined]
            done = stub.Complete(pb.CompleteRequest(update_id=update), timeout=30)
            assert done.weight_version == "kept"
            again.cancel()

            # Neither a bucket nor a new held Watch: the trainer is declared lost.
            update = stub.Prepare(iter(two_buckets("lost")), timeout=30).update_id
            call = held(stub, update)
            call.cancel()
            dropped = time.monotonic()
            st = status(stub)
            while st.state != pb.LIFECYCLE_STATE_FAILED:
                assert time.monotonic() - dropped < REATTACH_S * 2 + 1.0, pb.LifecycleState.Name(st.state)
                time.sleep(0.02)
                st = status(stub)
            lost_after = time.monotonic() - dropped
            print(f"the engine declared the trainer lost {lost_after:.2f} s after its Watch ended")
            assert lost_after >= REATTACH_S * 0.8 and st.last_error.reason == "PEER_LOST", (lost_after, st.last_error)
            assert st.weight_version == "kept" and not st.dirty
        finally:
            trainer.destroy()  # type: ignore[attr-defined]
