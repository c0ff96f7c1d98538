"""Fault classes of the fault-tolerance campaign that the other test modules do not cover.

- Two trainer processes race Prepare on one joined engine: exactly one update
  proceeds (and completes with that trainer's bytes); the other trainer gets
  ABORTED / UPDATE_IN_PROGRESS and can neither complete nor cancel the winner's
  update.
- An engine SIGKILLed in the middle of a *streaming* sync: the trainer returns
  by its deadline with an error naming the dead engine, and the survivor,
  half-updated, reports dirty, stays paused and refuses a plain Resume until a
  complete update succeeds (the staged case is in test_client.py).
- Hostile metadata beyond test_bad_metadata.py: strings and shapes far beyond
  any model (their errors must still arrive as INVALID_ARGUMENT with a reason,
  not as a trailer too large to deliver), a million tensors, byte counts far
  beyond the model; and none of it makes the engine allocate memory in
  proportion to what was claimed (peak RSS and peak virtual size of a separate
  engine process, read from /proc).
"""

from __future__ import annotations

import base64
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support import ENV, ROOT, code_of, free_port, join_as_trainer, lease_credential, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.group.waits import wait_work
from wsync_grpc.testing import EngineProcess, cli_command, owner_channel, spawn_engine
from wsync_grpc.trainer import TRAINER, SyncError, SyncProgress, TrainerClient
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (deadlines kept to the second): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

START_TIMEOUT_S = 120.0

# ----------------------------------------------------------------------------- helpers


def start_cli_engine(tmp: Path, name: str, *args: str) -> EngineProcess:
    """``python -m wsync_grpc.tools.cli serve ARGS --port 0 --port-file ...`` (the real CLI)."""
    port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
    return spawn_engine(
        [*args, "--grace", "1"], port_file=port_file, log=log, env=ENV, cwd=ROOT, timeout_s=START_TIMEOUT_S, name=name
    )


# ----------------------------------------------------------------------------- two trainers race

RACER = r"""
import base64, json, os, sys, time
import grpc
from wsync.v1 import weight_sync_pb2 as pb, weight_sync_pb2_grpc
from wsync_grpc.wire.status import error_reason

stub = weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(sys.argv[1]))
LEASE = [("wsync-lease", os.environ["WSYNC_LEASE"])]  # both racers present the owner's credential
stub.GetStatus(pb.GetStatusRequest(), timeout=30)  # connected before the first race
print(json.dumps({"ready": True}), flush=True)

def outcome(fn):
    try:
        reply = fn()
        return {"ok": True, "reply": type(reply).__name__, "cancelled": getattr(reply, "cancelled", None)}
    except grpc.RpcError as e:
        return {"ok": False, "code": e.code().name, "reason": error_reason(e), "details": e.details()}

for line in sys.stdin:
    go_at, header, bucket = line.split()
    header = pb.PrepareHeader.FromString(base64.b64decode(header))
    bucket = pb.BucketSpec.FromString(base64.b64decode(bucket))
    stream = [pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=bucket)]
    while time.time() < float(go_at):
        time.sleep(0.0005)
    out = {"prepare": outcome(lambda: stub.Prepare(iter(stream), timeout=30, metadata=LEASE))}
    if not out["prepare"]["ok"]:
        # The loser must not be able to touch the winner's update through its own update id.
        own = header.update_id
        out["complete"] = outcome(lambda: stub.Complete(pb.CompleteRequest(update_id=own), timeout=30, metadata=LEASE))
        out["cancel"] = outcome(lambda: stub.Cancel(pb.CancelRequest(update_id=own), timeout=30, metadata=LEASE))
    print(json.dumps(out), flush=True)
"""

RACE_NAMES = ["model.norm.weight", "model.layers.1.input_layernorm.weight"]


def race_bucket() -> pb.BucketSpec:
    spec = pb.BucketSpec(index=0)
    off = 0
    for n in RACE_NAMES:
        spec.tensors.add(name=n, dtype="bfloat16", shape=[64], offset_bytes=off)
        off += 128
    spec.size_bytes = off
    return spec


@pytest.mark.parametrize(
    "rounds",
    [
        pytest.param(8, marks=pytest.mark.timeout(180)),
        pytest.param(200, marks=[pytest.mark.soak, pytest.mark.timeout(1200)], id="soak"),
    ],
)
def test_two_trainer_processes_race_prepare_exactly_one_proceeds(rounds: int) -> None:
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        trainer = join_as_trainer(stub)
        env = {**ENV, "WSYNC_LEASE": lease_credential(stub)}  # the two racers are one owner (one lease)
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, srv.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )
            for _ in range(2)
        ]
        try:
            for p in racers:
                assert p.stdout is not None
                assert json.loads(p.stdout.readline()) == {"ready": True}, p.stderr.read() if p.stderr else ""
            spec = race_bucket()
            bucket = base64.b64encode(spec.SerializeToString()).decode()
            winners = []
            for r in range(rounds):
                values = {
                    who: {
                        n: torch.randn(64, generator=torch.Generator().manual_seed(100 * r + who)).bfloat16()
                        for n in RACE_NAMES
                    }
                    for who in range(2)
                }
                go_at = time.time() + 0.3
                for who, p in enumerate(racers):
                    header = pb.PrepareHeader(
                        update_id=f"r{r}-t{who}",
                        weight_version=f"round-{r}-trainer-{who}",
                        bucket_count=1,
                        total_bytes=spec.size_bytes,
                    )
                    assert p.stdin is not None
                    p.stdin.write(f"{go_at} {base64.b64encode(header.SerializeToString()).decode()} {bucket}\n")
                    p.stdin.flush()
                outs = []
                for p in racers:
                    assert p.stdout is not None
                    line = p.stdout.readline()
                    assert line, p.stderr.read() if p.stderr else ""
                    outs.append(json.loads(line))
                won = [who for who, o in enumerate(outs) if o["prepare"]["ok"]]
                assert len(won) == 1, f"round {r}: exactly one Prepare may proceed: {outs}"
                winner, loser = won[0], 1 - won[0]
                winners.append(winner)
                lost = outs[loser]
                assert lost["prepare"]["code"] == "ABORTED" and lost["prepare"]["reason"] == "UPDATE_IN_PROGRESS", lost
                assert "another update is in flight" in lost["prepare"]["details"], lost
                assert lost["complete"]["code"] == "FAILED_PRECONDITION", lost
                # WRONG_STATE while the winner is still PREPARING, UPDATE_ID_MISMATCH once it is armed.
                assert lost["complete"]["reason"] in ("WRONG_STATE", "UPDATE_ID_MISMATCH"), lost
                assert lost["cancel"] == {"ok": True, "reply": "CancelResponse", "cancelled": False}, lost
                st = status(stub)
                assert st.update.update_id == f"r{r}-t{winner}" and st.state == State.RECEIVING.value, st
                # The winner's bytes go through; the loser's never could.
                buf = torch.cat([values[winner][n].view(torch.uint8) for n in RACE_NAMES])
                wait_work(trainer.broadcast(buf), time.monotonic() + 30)  # type: ignore[attr-defined]
                done = stub.Complete(pb.CompleteRequest(update_id=f"r{r}-t{winner}"), timeout=30)
                assert done.weight_version == f"round-{r}-trainer-{winner}"
                for n in RACE_NAMES:
                    assert torch.equal(engine.tensors[n], values[winner][n]), (r, n)
            st = status(stub)
            assert st.updates_completed == rounds and st.state == State.READY.value
            assert not st.HasField("last_error"), "the lost races left no error behind"
        finally:
            for p in racers:
                if p.stdin is not None:
                    p.stdin.close()
                p.wait(30)
            trainer.destroy()  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- engine killed, streaming


@pytest.mark.timeout(180)
def test_engine_killed_mid_streaming_sync_leaves_survivor_dirty_and_paused(tmp_path: Path) -> None:
    engines = [
        start_cli_engine(tmp_path, name, "--synthetic", "tiny", "--dtype", "bfloat16")
        for name in ("survivor", "victim")
    ]
    survivor, victim = engines
    group_timeout = 20.0
    tensors = synthetic.build("tiny", seed=41, dtype=torch.bfloat16)
    try:
        with TrainerClient([survivor.target, victim.target], group_timeout_s=group_timeout, rpc_timeout_s=10) as client:
            client.init()
            before = {c.name: c.sha256 for c in client.checksums()[survivor.target].checksums}

            def kill_after_first(p: SyncProgress) -> None:
                if p.buckets_sent == 1:
                    victim.process.send_signal(signal.SIGKILL)
                    victim.process.wait(10)

            t0 = time.monotonic()
            with pytest.raises(SyncError) as info:
                client.sync(
                    tensors.items(),
                    "doomed",
                    apply_mode="streaming",
                    bucket_bytes=16 << 10,
                    progress=kill_after_first,
                )
            elapsed = time.monotonic() - t0
            print(f"the trainer noticed the dead engine after {elapsed:.1f} s")
            err = info.value
            assert elapsed < group_timeout + 15, f"the trainer must return by its deadline, took {elapsed:.1f} s"
            assert err.stage == "broadcast" and err.broadcast_started
            assert victim.target in err.failures and victim.target in str(err), err
            assert TRAINER in err.failures, err

        with TrainerClient([survivor.target], group_timeout_s=group_timeout, rpc_timeout_s=10) as alone:
            st = alone.status()[survivor.target]
            # Cancelled (FAILED), then left by the first client's close().
            assert st.state in (State.FAILED, State.UNINITIALIZED), st
            # Half-updated (the first bucket was applied): flagged, kept paused, version unchanged.
            after = {c.name: c.sha256 for c in alone.checksums()[survivor.target].checksums}
            assert after != before, "the first streamed bucket was applied"
            assert st.dirty and st.paused and st.weight_version == "", st
            assert st.last_error is not None and st.last_error.reason in ("UPDATE_CANCELLED", "PEER_LOST"), st
            stub = alone.stubs[survivor.target]
            with pytest.raises(grpc.RpcError) as e:
                stub.Resume(pb.ResumeRequest(), timeout=10)
            assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION and error_reason(e.value) == "ENGINE_DIRTY"
            # A complete update clears the dirt and lifts the pause the dirt imposed.
            alone.sync(tensors.items(), "recovered", apply_mode="streaming", bucket_bytes=16 << 10)
            st = alone.status()[survivor.target]
            assert st.weight_version == "recovered" and not st.dirty and not st.paused, st
            served = {c.name: c.sha256 for c in alone.checksums()[survivor.target].checksums}
            from wsync_grpc.core.checksums import tensor_sha256

            assert served == {n: tensor_sha256(t) for n, t in tensors.items()}
    finally:
        for e in engines:
            e.stop()


# ----------------------------------------------------------------------------- hostile metadata


def header(total: int, count: int = 1, **kw: object) -> pb.PrepareRequest:
    return pb.PrepareRequest(
        header=pb.PrepareHeader(weight_version="hostile", bucket_count=count, total_bytes=total, **kw)
    )  # type: ignore[arg-type]


def bucket(size: int, *tensors: pb.TensorSpec, index: int = 0) -> pb.PrepareRequest:
    return pb.PrepareRequest(bucket=pb.BucketSpec(index=index, size_bytes=size, tensors=list(tensors)))


NORM = "model.norm.weight"

HUGE_STRINGS: dict[str, tuple[list[pb.PrepareRequest], str]] = {
    "100 kB dtype string": (
        [header(128), bucket(128, pb.TensorSpec(name=NORM, dtype="x" * 100_000, shape=[64]))],
        "UNSUPPORTED_DTYPE",
    ),
    "200k-dimensional shape": (
        [header(128), bucket(128, pb.TensorSpec(name=NORM, dtype="bfloat16", shape=[64] * 200_000))],
        "SHAPE_MISMATCH",
    ),
    "200k negative dimensions": (
        [header(128), bucket(128, pb.TensorSpec(name=NORM, dtype="bfloat16", shape=[-1] * 200_000))],
        "INVALID_SHAPE",
    ),
    "1 MB name": (
        [header(128), bucket(128, pb.TensorSpec(name="n" * 1_000_000, dtype="bfloat16", shape=[64]))],
        "UNKNOWN_TENSOR",
    ),
    "emoji and bidi name": (
        [header(128), bucket(128, pb.TensorSpec(name="\U0001f600\u202e\x00" * 50_000, dtype="bfloat16", shape=[64]))],
        "UNKNOWN_TENSOR",
    ),
    "100 kB weight version": (
        [pb.PrepareRequest(header=pb.PrepareHeader(weight_version="v" * 100_000, bucket_count=1, total_bytes=10**15))],
        "VERSION_TOO_LONG",
    ),
}


@pytest.fixture(scope="module")
def joined_tiny() -> Iterator[weight_sync_pb2_grpc.WeightSyncServiceStub]:
    with tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        trainer = join_as_trainer(stub)
        yield stub
        trainer.destroy()  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(HUGE_STRINGS))
def test_huge_strings_and_shapes_are_refused_with_a_deliverable_reason(
    case: str, joined_tiny: weight_sync_pb2_grpc.WeightSyncServiceStub
) -> None:
    """The error quotes what the caller sent; it must still fit in the trailers (8 KiB by default)."""
    stream, reason = HUGE_STRINGS[case]
    with pytest.raises(grpc.RpcError) as e:
        joined_tiny.Prepare(iter(stream), timeout=30)
    assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert error_reason(e.value) == reason, e.value
    assert len(e.value.details().encode()) <= 1024  # type: ignore[attr-defined]
    st = status(joined_tiny)
    assert st.state == State.READY.value and not st.HasField("update")


def proc_status(pid: int) -> dict[str, int]:
    """VmPeak, VmHWM (peak virtual size, peak RSS) and friends of ``pid``, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Vm"):
            out[key] = int(value.split()[0])
    return out


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_claims_far_beyond_the_model_allocate_nothing(tmp_path: Path) -> None:
    """A separate engine serving SmolLM2-135M's shapes (270 MB in bf16; it accepts at most about
    1.08 GB of declared bytes) faces claims of up to 10^12 bytes, a million tensors and a header
    of the largest acceptable claim held open: its peak RSS and peak virtual size hardly move."""
    engine = start_cli_engine(tmp_path, "big", "--synthetic", "smollm2-shapes", "--dtype", "bfloat16")
    channel = owner_channel(engine.target)
    stub = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
    trainer = join_as_trainer(stub)
    pid = engine.process.pid
    try:
        info = status(stub).engine
        max_claim = info.parameter_count * 8 + info.tensor_count * 4096  # the validator's bound
        emb = pb.TensorSpec(name="model.embed_tokens.weight", dtype="bfloat16", shape=[49152, 576])

        def refused(stream: Iterator[pb.PrepareRequest] | list[pb.PrepareRequest], reason: str) -> None:
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(iter(stream), timeout=60)
            assert (code_of(e.value), error_reason(e.value)) == (grpc.StatusCode.INVALID_ARGUMENT, reason), e.value
            assert status(stub).state == State.READY.value

        # Warm up the paths measured below (threads, arenas, the validator).
        refused([header(128), bucket(128, pb.TensorSpec(name="nope", dtype="bfloat16", shape=[1]))], "UNKNOWN_TENSOR")
        base = proc_status(pid)

        refused([header(10**12)], "TOO_MANY_BYTES")
        refused([header(2**64 - 1, count=2**32 - 1)], "TOO_MANY_BUCKETS")
        refused([header(max_claim), bucket(max_claim, emb)], "BUCKET_SIZE_MISMATCH")
        refused([header(10**12, count=1), bucket(10**12, emb)], "TOO_MANY_BYTES")

        def million_tensors() -> Iterator[pb.PrepareRequest]:
            yield header(max_claim, count=250)
            for i in range(250):
                yield bucket(
                    10**9,
                    *(pb.TensorSpec(name=f"t{i}.{j}", dtype="bfloat16", shape=[10**6]) for j in range(4000)),
                    index=i,
                )

        t0 = time.monotonic()
        refused(million_tensors(), "UNKNOWN_TENSOR")
        assert time.monotonic() - t0 < 30

        # One message far beyond gRPC's 4 MiB receive limit: refused by gRPC itself, engine untouched.
        giant = bucket(10**9, *(pb.TensorSpec(name=f"t{j}", dtype="bfloat16", shape=[1]) for j in range(300_000)))
        with pytest.raises(grpc.RpcError) as e:
            stub.Prepare(iter([header(max_claim), giant]), timeout=60)
        assert code_of(e.value) == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert status(stub).state == State.READY.value

        # The largest acceptable claim, held open mid-stream: nothing is allocated for it yet.
        gate = threading.Event()

        def held() -> Iterator[pb.PrepareRequest]:
            yield header(max_claim, count=272)
            gate.wait(30)

        fut = stub.Prepare.future(held(), timeout=60)
        deadline = time.monotonic() + 10
        while status(stub).state != State.PREPARING.value:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)
        during = proc_status(pid)
        fut.cancel()
        gate.set()
        deadline = time.monotonic() + 10
        while status(stub).state != State.READY.value:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        # An incremental update whose Update claims 10^12 bytes.
        prep = stub.Prepare(iter([header(0, count=0, incremental=True)]), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            stub.Update(
                pb.UpdateRequest(
                    update_id=prep.update_id, buckets=[pb.BucketSpec(index=0, size_bytes=10**12, tensors=[emb])]
                ),
                timeout=30,
            )
        assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT and error_reason(e.value) == "BUCKET_SIZE_MISMATCH"
        assert status(stub).update.bytes_expected == 0
        assert stub.Cancel(pb.CancelRequest(), timeout=10).cancelled

        after = proc_status(pid)
        mib = 1024
        print(
            f"engine VmHWM/VmPeak (KiB): before {base['VmHWM']}/{base['VmPeak']}, held open "
            f"{during['VmHWM']}/{during['VmPeak']}, after {after['VmHWM']}/{after['VmPeak']}"
        )
        for when, vm in (("held open", during), ("after", after)):
            grown_rss = (vm["VmHWM"] - base["VmHWM"]) / mib
            grown_virtual = (vm["VmPeak"] - base["VmPeak"]) / mib
            assert grown_rss < 64, f"{when}: peak RSS grew by {grown_rss:.0f} MiB ({base} -> {vm})"
            assert grown_virtual < max_claim / 2 / 2**20, f"{when}: peak virtual size grew by {grown_virtual:.0f} MiB"
    finally:
        trainer.destroy()  # type: ignore[attr-defined]
        channel.close()
        engine.stop()


# ----------------------------------------------------------------------------- stalled Prepare


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["stall", "cancel"])
def test_a_stalled_prepare_stream_does_not_hold_the_engine(how: str) -> None:
    """A trainer that opens Prepare and then sends nothing (alive, no deadline) must not keep the
    engine in PREPARING: the stream is cut after ``prepare_timeout_s`` of silence, or at once by
    Cancel, and the engine is READY for the next trainer."""
    with tensor_server("tiny", seed=0) as (srv, _engine, stub):
        srv.servicer.prepare_timeout_s = 1.5
        trainer = join_as_trainer(stub)
        gate = threading.Event()

        def stalled() -> Iterator[pb.PrepareRequest]:
            yield header(128)
            gate.wait(60)  # a stuck trainer

        try:
            fut = stub.Prepare.future(stalled())  # no deadline
            deadline = time.monotonic() + 10
            while status(stub).state != State.PREPARING.value:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # A Cancel naming another update (another trainer's) leaves this one alone.
            r = stub.Cancel(pb.CancelRequest(update_id="someone-else"), timeout=10)
            assert not r.cancelled and r.state == pb.LIFECYCLE_STATE_PREPARING
            t0 = time.monotonic()
            if how == "cancel":
                r = stub.Cancel(pb.CancelRequest(reason="operator"), timeout=10)
                assert r.cancelled and r.state == pb.LIFECYCLE_STATE_PREPARING
            with pytest.raises(grpc.RpcError) as e:
                fut.result(timeout=20)
            waited = time.monotonic() - t0
            # The engine cancels the call; its own status may get out first.
            expected = ("ABORTED", "UPDATE_CANCELLED") if how == "cancel" else ("DEADLINE_EXCEEDED", "PREPARE_STALLED")
            assert (code_of(e.value).name, error_reason(e.value)) in (("CANCELLED", ""), expected), e.value
            assert waited < (1.0 if how == "cancel" else 1.5 + 1.0), waited
            deadline = time.monotonic() + 5
            while status(stub).state != State.READY.value:
                assert time.monotonic() < deadline, status(stub)
                time.sleep(0.01)
            # The next trainer's update goes through on the same group.
            spec = race_bucket()
            prep = stub.Prepare(
                iter([header(spec.size_bytes), pb.PrepareRequest(bucket=spec)]),
                timeout=10,
            )
            buf = torch.zeros(spec.size_bytes, dtype=torch.uint8)
            wait_work(trainer.broadcast(buf), time.monotonic() + 10)  # type: ignore[attr-defined]
            assert stub.Complete(pb.CompleteRequest(update_id=prep.update_id), timeout=10).weight_version == "hostile"
        finally:
            gate.set()
            trainer.destroy()  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_cancel_that_says_cancelled_always_ends_the_prepare() -> None:
    """Cancel racing Prepare at random moments: whenever Cancel answers ``cancelled``, that Prepare
    does not arm the update (it fails), and the engine is left FAILED or READY, never RECEIVING."""
    spec = race_bucket()
    rng = random.Random(7)
    with tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        said = 0
        for _ in range(30):
            trainer = join_as_trainer(stub)
            try:
                fut = stub.Prepare.future(iter([header(spec.size_bytes), pb.PrepareRequest(bucket=spec)]), timeout=10)
                time.sleep(rng.uniform(0.0, 0.004))
                cancelled = stub.Cancel(pb.CancelRequest(reason="race"), timeout=10).cancelled
                try:
                    fut.result(timeout=20)
                    prepared = True
                except grpc.RpcError:
                    prepared = False
                st = status(stub)
                if cancelled:
                    said += 1
                    assert st.state != State.RECEIVING.value, "a Cancel that said cancelled left an update running"
                    assert not (prepared and st.state == State.RECEIVED.value), st
                if st.state in (State.RECEIVING.value, State.RECEIVED.value):
                    stub.Cancel(pb.CancelRequest(reason="cleanup"), timeout=10)
            finally:
                trainer.destroy()  # type: ignore[attr-defined]
                stub.Leave(pb.LeaveRequest(), timeout=10)
        assert said > 0, "no Cancel landed on an update"


@pytest.mark.timeout(60)
def test_a_refused_complete_changes_nothing() -> None:
    """Complete with a negative timeout is refused (INVALID_ARGUMENT) and the same update still completes."""
    spec = race_bucket()
    with tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        trainer = join_as_trainer(stub)
        try:
            prep = stub.Prepare(iter([header(spec.size_bytes), pb.PrepareRequest(bucket=spec)]), timeout=10)
            bad = pb.CompleteRequest(update_id=prep.update_id)
            bad.timeout.seconds = -3
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(bad, timeout=10)
            assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT and error_reason(e.value) == "NEGATIVE_TIMEOUT"
            wait_work(trainer.broadcast(torch.zeros(spec.size_bytes, dtype=torch.uint8)), time.monotonic() + 10)  # type: ignore[attr-defined]
            done = stub.Complete(pb.CompleteRequest(update_id=prep.update_id), timeout=10)
            assert done.weight_version == "hostile"
        finally:
            trainer.destroy()  # type: ignore[attr-defined]


def test_an_init_whose_group_never_forms_gives_up_at_its_timeout() -> None:
    """Nobody serves the store: Init ends with its timeout (plus torch's connect retries, never 10 s more)."""
    with tensor_server("tiny") as (_srv, _engine, stub):
        req = pb.InitRequest(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
        req.timeout.FromMilliseconds(1000)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Init(req, timeout=30)
        took = time.monotonic() - t0
        assert code_of(e.value) in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), e.value
        assert error_reason(e.value) in ("JOIN_TIMEOUT", "JOIN_FAILED")
        assert took < 11.0, f"Init took {took:.1f} s for a 1 s timeout"
        st = status(stub)
        assert st.state == State.UNINITIALIZED.value and not st.HasField("group")
        assert st.last_error.reason == error_reason(e.value)


def _armed_update(stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> pb.PrepareResponse:
    """Prepare one bucket of ``model.norm.weight`` (the engine must be joined); the reply (update id, lease)."""
    spec = pb.BucketSpec(index=0, size_bytes=128)
    spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64], offset_bytes=0)
    header = pb.PrepareHeader(weight_version="never", bucket_count=1, total_bytes=128)
    reply: pb.PrepareResponse = stub.Prepare(
        iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=30
    )
    return reply


def test_an_operators_cancel_of_an_armed_update_records_its_reason() -> None:
    """``wsync cancel --reason`` by the owner (its lease credential in ``WSYNC_LEASE``): the update is abandoned,
    the group left, the reason in ``last_error``."""
    with tensor_server("tiny") as (srv, _engine, stub):
        trainer = join_as_trainer(stub)
        try:
            armed = _armed_update(stub)
            update_id = armed.update_id
            r = subprocess.run(
                cli_command("cancel", "--target", srv.address, "--reason", "rollback requested by ops"),
                capture_output=True,
                text=True,
                env={**ENV, "WSYNC_LEASE": armed.lease_credential},
                cwd=ROOT,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["update_id"] == update_id
            st = status(stub)
            assert st.state == State.FAILED.value and not st.HasField("group") and st.weight_version == ""
            assert st.last_error.reason == "UPDATE_CANCELLED" and st.last_error.update_id == update_id
            assert "rollback requested by ops" in st.last_error.message
        finally:
            trainer.destroy()


def test_sigterm_with_an_update_in_flight_cancels_it_and_stops(tmp_path: Path) -> None:
    """SIGTERM: health NOT_SERVING, the update cancelled (SHUTDOWN), the group left, exit 0 within the grace."""
    log = tmp_path / "engine.log"
    engine = spawn_engine(
        ["--synthetic", "tiny", "--grace", "1"], port_file=tmp_path / "port", log=log, env=ENV, cwd=ROOT
    )
    try:
        stub = weight_sync_pb2_grpc.WeightSyncServiceStub(owner_channel(engine.target))
        trainer = join_as_trainer(stub)
        try:
            _armed_update(stub)
            assert status(stub).state == State.RECEIVING.value
            engine.terminate()
            assert engine.process.wait(30) == 0
        finally:
            trainer.destroy()
        out = log.read_text()
        assert "failed: SHUTDOWN" in out, out[-3000:]
        assert "stopped" in out
    finally:
        engine.kill()
