"""Every wait has a server-side bound: the operator's caps on what callers choose, and the update idle limit.

Real servers on loopback ports, real trainers (``TrainerClient``, or raw stubs with a real gloo group):

- a trainer that broadcasts every bucket and then stalls with its connection alive (its KeepAlive and
  held Watch open, no Complete) loses its update at the idle limit (staged: the old weights, clean;
  streaming: dirty and paused) and the engine, which another trainer then claims and syncs;
- Init asking for a 10^9 s group timeout and lease ttl gets the caps (the reply and GetStatus say so),
  Complete asking for 10^9 s gives up by the cap, and Watch and KeepAlive asking for a message every
  microsecond get one per minimum interval.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch
from support import code_of, free_port, status
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.checksums import tensor_sha256
from wsync_grpc.core.timeouts import ServerBounds
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.group.process_group import join_group
from wsync_grpc.testing import in_process_server
from wsync_grpc.trainer import SyncError, SyncProgress, TrainerClient
from wsync_grpc.wire.status import error_reason

# Wall-clock bounds (caps kept to the second): `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

IDLE_S = 2.0
"""The engine's update idle limit in these tests, in seconds."""
POLL_S = 1.0
"""How late the idle watch may notice (its polling period, at most 1 s), in seconds."""


def tensor_engine(seed: int = 0) -> TensorEngine:
    return TensorEngine(synthetic.build("tiny", seed=seed, dtype=torch.bfloat16), aliases=synthetic.aliases("tiny"))


def sums(engine: TensorEngine) -> dict[str, str]:
    return {n: tensor_sha256(engine.get_weight(n)) for n in engine.parameter_specs()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_a_trainer_stalled_before_complete_loses_the_update_and_the_engine_at_the_idle_limit(mode: str) -> None:
    engine = tensor_engine()
    before = sums(engine)
    with in_process_server(engine, bounds=ServerBounds(update_idle_s=IDLE_S)) as (srv, stub):
        gate = threading.Event()
        stalled_at: list[float] = []
        outcome: list[BaseException | None] = []

        def stall_after_the_last_bucket(p: SyncProgress) -> None:
            if p.buckets_sent == p.bucket_count:
                stalled_at.append(time.monotonic())
                gate.wait(60)  # alive, connected, and never calling Complete

        def stalled_trainer() -> None:
            with TrainerClient([srv.address], owner="stalled", rpc_timeout_s=30, bucket_bytes=1 << 16) as c:
                try:
                    c.sync(
                        synthetic.build("tiny", seed=1, dtype=torch.bfloat16).items(),
                        "never",
                        apply_mode=mode,
                        progress=stall_after_the_last_bucket,
                    )
                except BaseException as e:  # handed to the test's thread
                    outcome.append(e)
                else:
                    outcome.append(None)

        thread = threading.Thread(target=stalled_trainer, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not stalled_at:
                assert time.monotonic() < deadline and thread.is_alive(), "the trainer never sent its last bucket"
                time.sleep(0.01)
            st = status(stub)
            assert st.owner.owner == "stalled" and st.owner.keepalive_calls == 1, st.owner
            while st.state != pb.LIFECYCLE_STATE_FAILED:
                assert time.monotonic() - stalled_at[0] < IDLE_S + POLL_S + 1.0, pb.LifecycleState.Name(st.state)
                time.sleep(0.05)
                st = status(stub)
            failed_after = time.monotonic() - stalled_at[0]
            print(f"{mode}: the stalled update failed {failed_after:.2f} s after the last bucket")
            assert failed_after >= IDLE_S - 0.5, failed_after
            assert st.last_error.reason == "UPDATE_IDLE", st.last_error
            assert not st.HasField("owner"), "the stalled trainer no longer owns the engine"
            assert st.weight_version == ""
            if mode == "staged":
                assert sums(engine) == before and not st.dirty and not st.paused, "staged: the old weights, clean"
            else:
                assert st.dirty and st.paused, "streaming: half-updated weights are flagged and not served"

            # Another trainer claims the engine (Init) and syncs, while the first is still stalled.
            fresh = synthetic.build("tiny", seed=2, dtype=torch.bfloat16)
            with TrainerClient([srv.address], owner="next", rpc_timeout_s=30) as c:
                c.sync(fresh.items(), "fresh", apply_mode=mode)
                st = status(stub)
                assert st.owner.owner == "next" and st.weight_version == "fresh" and not st.dirty, st
            assert sums(engine) == {n: tensor_sha256(t) for n, t in fresh.items()}
        finally:
            gate.set()
            thread.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], SyncError), outcome


@pytest.mark.timeout(120)
def test_the_durations_callers_choose_are_capped_by_the_server() -> None:
    bounds = ServerBounds(max_timeout_s=5.0, max_lease_ttl_s=7.0, min_interval_s=0.25)
    with in_process_server(tensor_engine(), bounds=bounds) as (_srv, stub):
        port = free_port()
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, owner="t")
        req.timeout.seconds = 10**9
        req.lease_ttl.seconds = 10**9
        fut = stub.Init.future(req, timeout=60)
        trainer = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30)
        try:
            reply = fut.result()
            assert reply.group.timeout.ToTimedelta().total_seconds() == 5.0
            assert reply.owner.lease_ttl.ToTimedelta().total_seconds() == 7.0
            st = status(stub)
            assert st.group.timeout.ToTimedelta().total_seconds() == 5.0
            assert st.owner.lease_ttl.ToTimedelta().total_seconds() == 7.0

            # A message every microsecond, asked for: one every 0.25 s, given.
            spec = pb.BucketSpec(index=0, size_bytes=128)
            spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64], offset_bytes=0)
            header = pb.PrepareHeader(weight_version="v", bucket_count=1, total_bytes=128, owner="t")
            prepared = stub.Prepare(
                iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=30
            )
            tiny = pb.WatchRequest(update_id=prepared.update_id)
            tiny.interval.nanos = 1000
            assert count_for(stub.Watch(tiny), 1.0) <= 1 / 0.25 + 2
            ka = pb.KeepAliveRequest(owner="t")
            ka.interval.nanos = 1000
            assert count_for(stub.KeepAlive(ka), 1.0) <= 1 / 0.25 + 2

            # Complete asking to wait 10^9 s for a bucket that never comes gives up by the cap.
            complete = pb.CompleteRequest(update_id=prepared.update_id, owner="t")
            complete.timeout.seconds = 10**9
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(complete, timeout=60)
            took = time.monotonic() - t0
            assert code_of(e.value) == grpc.StatusCode.DEADLINE_EXCEEDED and error_reason(e.value) == "RECEIVE_TIMEOUT"
            assert took < 5.0 + 2.0, f"Complete waited {took:.1f} s with a 5 s cap"
        finally:
            trainer.destroy()  # type: ignore[attr-defined]


def count_for(stream: Any, seconds: float) -> int:
    """Messages ``stream`` delivers in ``seconds`` (then it is cancelled)."""
    timer = threading.Timer(seconds, stream.cancel)
    timer.start()
    n = 0
    try:
        for _ in stream:
            n += 1
    except grpc.RpcError as e:
        assert code_of(e) == grpc.StatusCode.CANCELLED, e
    finally:
        timer.cancel()
    return n
