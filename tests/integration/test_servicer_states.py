"""Every (lifecycle state, RPC) pair against a live server: allowed calls succeed, others fail fast.

A real gRPC server on a loopback port serves a synthetic engine; the trainer
side (rank 0 of a real gloo group) runs in a thread of the test process, so
that each state can be held while the RPCs are tried.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import save_file
from support import code_of, free_port, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.lifecycle import ALLOWED, Rpc, State
from wsync_grpc.engines import synthetic
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.group.waits import wait_work
from wsync_grpc.wire.status import error_reason

TENSORS = synthetic.build("tiny", seed=3)
NAMES = list(TENSORS)


def bucket(index: int, names: list[str]) -> pb.BucketSpec:
    """A flattened bucket of ``names`` packed back to back (all bf16, 2-byte aligned)."""
    spec = pb.BucketSpec(index=index)
    off = 0
    for n in names:
        t = TENSORS[n]
        spec.tensors.add(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape), offset_bytes=off)
        off += t.numel() * t.element_size()
    spec.size_bytes = off
    return spec


def flat(spec: pb.BucketSpec) -> object:
    import torch

    buf = torch.empty(spec.size_bytes, dtype=torch.uint8)
    for t in spec.tensors:
        src = TENSORS[t.name].reshape(-1).view(torch.uint8)
        buf[t.offset_bytes : t.offset_bytes + src.numel()] = src
    return buf


B0 = bucket(0, NAMES[:5])
B1 = bucket(1, NAMES[5:10])


class Harness:
    """Drives one live engine into a chosen state."""

    def __init__(self, stub: object) -> None:
        self.stub = stub  # WeightSyncServiceStub
        self.trainer: WeightSyncGroup | None = None
        self.update_id = ""
        self.pool = concurrent.futures.ThreadPoolExecutor(4)
        self.hold = threading.Event()
        self.init_req: pb.InitRequest | None = None

    def init_request(self, port: int) -> pb.InitRequest:
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
        req.timeout.FromSeconds(30)
        return req

    def init(self) -> pb.InitResponse:
        if self.trainer is not None:
            self.trainer.destroy()
        port = free_port()
        self.init_req = self.init_request(port)
        fut = self.stub.Init.future(self.init_req, timeout=60)  # type: ignore[attr-defined]
        self.trainer = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30)
        resp: pb.InitResponse = fut.result()
        return resp

    def prepare(self, incremental: bool = True) -> pb.PrepareResponse:
        header = pb.PrepareHeader(
            weight_version="v-test", bucket_count=1, total_bytes=B0.size_bytes, incremental=incremental
        )
        resp: pb.PrepareResponse = self.stub.Prepare(  # type: ignore[attr-defined]
            iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=B0)]), timeout=30
        )
        self.update_id = resp.update_id
        return resp

    def broadcast(self, spec: pb.BucketSpec) -> None:
        assert self.trainer is not None
        wait_work(self.trainer.broadcast(flat(spec)), time.monotonic() + 30)  # type: ignore[arg-type]

    def wait_state(self, state: State) -> None:
        deadline = time.monotonic() + 30
        while status(self.stub).state != state.value:  # type: ignore[arg-type]
            assert time.monotonic() < deadline, f"never reached {state.name}: {status(self.stub)}"  # type: ignore[arg-type]
            time.sleep(0.01)

    def to(self, state: State) -> None:
        if state == State.UNINITIALIZED:
            return
        if state == State.JOINING:
            # Claim the engine first (a KeepAlive issues the credential at once), so that this
            # caller's other calls prove its ownership while its Init is still joining.
            keepalive = self.stub.KeepAlive(pb.KeepAliveRequest(), timeout=10)  # type: ignore[attr-defined]
            next(keepalive)
            keepalive.cancel()
            port = free_port()
            self.init_req = self.init_request(port)
            self.pool.submit(self.stub.Init, self.init_req, timeout=60)  # type: ignore[attr-defined]
            self.wait_state(State.JOINING)

            def late_trainer() -> None:
                self.hold.wait(60)
                self.trainer = join_group(
                    master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30
                )

            self.pool.submit(late_trainer)
            return
        self.init()
        if state == State.READY:
            return
        if state == State.PREPARING:
            header = pb.PrepareHeader(weight_version="v-held", bucket_count=1, total_bytes=B0.size_bytes)

            def held() -> Iterator[pb.PrepareRequest]:
                yield pb.PrepareRequest(header=header)
                self.hold.wait(60)
                yield pb.PrepareRequest(bucket=B0)

            self.held_prepare = self.stub.Prepare.future(held(), timeout=90)  # type: ignore[attr-defined]
            self.wait_state(State.PREPARING)
            return
        self.prepare()
        if state == State.RECEIVING:
            return
        if state == State.RECEIVED:
            self.broadcast(B0)
            self.wait_state(State.RECEIVED)
            return
        if state == State.FAILED:
            self.stub.Cancel(pb.CancelRequest(), timeout=10)  # type: ignore[attr-defined]
            self.wait_state(State.FAILED)
            return
        raise AssertionError(f"cannot hold {state}")

    def close(self) -> None:
        self.hold.set()
        self.pool.shutdown(wait=True)
        if self.trainer is not None:
            self.trainer.destroy()

    # One successful call of each RPC, as allowed in the current state.
    def call_ok(self, rpc: Rpc, state: State) -> None:
        s = self.stub
        if rpc == Rpc.INIT:
            if state == State.READY:
                assert self.init_req is not None
                assert s.Init(self.init_req, timeout=30).already_joined  # type: ignore[attr-defined]
            else:
                assert not self.init().already_joined
                assert status(s).state == State.READY.value  # type: ignore[arg-type]
        elif rpc == Rpc.PREPARE and state != State.READY:  # no group: a broadcast is refused, a disk update runs
            with pytest.raises(grpc.RpcError) as e:
                self.prepare(incremental=False)
            assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION and error_reason(e.value) == "WRONG_STATE"
            assert "call Init first" in e.value.details() and status(s).state == state.value  # type: ignore[attr-defined,arg-type]
            header = pb.PrepareHeader(weight_version="v-test", transport=pb.TRANSPORT_DISK, checkpoint_path="ckpt")
            r = s.Prepare(iter([pb.PrepareRequest(header=header)]), timeout=30)  # type: ignore[attr-defined]
            assert r.tensor_count == len(NAMES) - 5
            assert s.Complete(pb.CompleteRequest(update_id=r.update_id), timeout=30).weight_version == "v-test"  # type: ignore[attr-defined]
            assert status(s).state == State.UNINITIALIZED.value  # type: ignore[arg-type]
        elif rpc == Rpc.PREPARE:
            assert self.prepare(incremental=False).bucket_count == 1
            assert status(s).state in (State.RECEIVING.value, State.RECEIVED.value)  # type: ignore[arg-type]
        elif rpc == Rpc.UPDATE:
            r = s.Update(pb.UpdateRequest(update_id=self.update_id, buckets=[B1]), timeout=10)  # type: ignore[attr-defined]
            assert r.bucket_count == 2
        elif rpc == Rpc.COMPLETE:
            req = pb.CompleteRequest(update_id=self.update_id)
            if state == State.FAILED:
                with pytest.raises(grpc.RpcError) as e:
                    s.Complete(req, timeout=30)  # type: ignore[attr-defined]
                assert code_of(e.value) == grpc.StatusCode.ABORTED
                assert error_reason(e.value) == "UPDATE_CANCELLED"
                return
            fut = s.Complete.future(req, timeout=30)  # type: ignore[attr-defined]
            if state == State.RECEIVING:
                self.broadcast(B0)
            assert fut.result().weight_version == "v-test"
            assert status(s).weight_version == "v-test"  # type: ignore[arg-type]
        elif rpc == Rpc.PAUSE:
            assert not s.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=10).already_paused  # type: ignore[attr-defined]
            assert status(s).paused  # type: ignore[arg-type]
        elif rpc == Rpc.RESUME:
            assert not s.Resume(pb.ResumeRequest(), timeout=10).was_paused  # type: ignore[attr-defined]
        elif rpc == Rpc.GET_STATUS:
            assert status(s).state == state.value  # type: ignore[arg-type]
        elif rpc == Rpc.CANCEL:
            r = s.Cancel(pb.CancelRequest(reason="test"), timeout=10)  # type: ignore[attr-defined]
            in_flight = state in (State.PREPARING, State.RECEIVING, State.RECEIVED)
            assert r.cancelled == in_flight
            if state in (State.RECEIVING, State.RECEIVED):
                assert status(s).state == State.FAILED.value  # type: ignore[arg-type]
                assert status(s).last_error.reason == "UPDATE_CANCELLED"  # type: ignore[arg-type]
        elif rpc == Rpc.LEAVE:
            r = s.Leave(pb.LeaveRequest(), timeout=10)  # type: ignore[attr-defined]
            assert r.was_member == (state == State.READY)
            assert status(s).state == State.UNINITIALIZED.value  # type: ignore[arg-type]
        elif rpc == Rpc.WATCH:
            stream = s.Watch(pb.WatchRequest(update_id=self.update_id), timeout=10)  # type: ignore[attr-defined]
            first = next(stream)
            assert first.state == state.value and not first.ended
            assert first.update.update_id == self.update_id and first.update.buckets_expected >= 1
            stream.cancel()
            assert status(s).state == state.value, "a Watch without hold changes nothing when it ends"  # type: ignore[arg-type]
        elif rpc == Rpc.LIST_ADAPTERS:
            r = s.ListAdapters(pb.ListAdaptersRequest(), timeout=10)  # type: ignore[attr-defined]
            assert not r.supported and not r.adapters  # the tensor engine serves no adapters
        elif rpc == Rpc.UNLOAD_ADAPTER:
            r = s.UnloadAdapter(pb.UnloadAdapterRequest(name="none"), timeout=10)  # type: ignore[attr-defined]
            assert not r.was_loaded and status(s).state == state.value  # type: ignore[arg-type]
        elif rpc == Rpc.GET_WEIGHT_CHECKSUMS:
            r = s.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=[NAMES[0]]), timeout=30)  # type: ignore[attr-defined]
            assert len(r.checksums) == 1 and len(r.checksums[0].sha256) == 64


def call_any(stub: object, rpc: Rpc) -> None:
    """Call ``rpc`` with a minimal request (used where it must be refused)."""
    s: object = stub
    if rpc == Rpc.PREPARE:
        header = pb.PrepareHeader(weight_version="x", bucket_count=1, total_bytes=B0.size_bytes)
        s.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=B0)]), timeout=10)  # type: ignore[attr-defined]
        return
    if rpc == Rpc.WATCH:
        next(s.Watch(pb.WatchRequest(update_id="x", hold=True), timeout=10))  # type: ignore[attr-defined]
        return
    requests = {
        Rpc.INIT: pb.InitRequest(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2),
        Rpc.UPDATE: pb.UpdateRequest(update_id="x", buckets=[B1]),
        Rpc.COMPLETE: pb.CompleteRequest(update_id="x"),
        Rpc.CANCEL: pb.CancelRequest(),
        Rpc.LEAVE: pb.LeaveRequest(),
    }
    getattr(s, rpc.value)(requests[rpc], timeout=10)


HOLDABLE = [
    State.UNINITIALIZED,
    State.JOINING,
    State.READY,
    State.PREPARING,
    State.RECEIVING,
    State.RECEIVED,
    State.FAILED,
]
ALLOWED_PAIRS = [(s, r) for s in HOLDABLE for r in Rpc if s in ALLOWED[r]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("state", "rpc"), ALLOWED_PAIRS, ids=lambda x: x.name)
def test_allowed_rpc_succeeds(state: State, rpc: Rpc, tmp_path: Path) -> None:
    save_file({n: TENSORS[n] for n in NAMES[5:]}, str(tmp_path / "model.safetensors"))  # for a disk Prepare
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "model.safetensors").rename(tmp_path / "ckpt" / "model.safetensors")
    with tensor_server(seed=0, checkpoint_roots=[str(tmp_path)]) as (_, _, stub):
        h = Harness(stub)
        try:
            h.to(state)
            h.call_ok(rpc, state)
        finally:
            h.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", HOLDABLE, ids=lambda s: s.name)
def test_disallowed_rpcs_fail_fast_and_change_nothing(state: State) -> None:
    refused = [r for r in Rpc if state not in ALLOWED[r]]
    with tensor_server(seed=0) as (_, _, stub):
        h = Harness(stub)
        try:
            h.to(state)
            before = status(stub)
            for rpc in refused:
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    call_any(stub, rpc)
                assert time.monotonic() - t0 < 5, f"{rpc.value} did not fail fast"
                reason = error_reason(e.value)
                if rpc == Rpc.PREPARE and state in (State.PREPARING, State.RECEIVING, State.RECEIVED):
                    assert code_of(e.value) == grpc.StatusCode.ABORTED and reason == "UPDATE_IN_PROGRESS"
                else:
                    assert code_of(e.value) == grpc.StatusCode.FAILED_PRECONDITION, (rpc, e.value)
                    assert reason == "WRONG_STATE"
                    assert state.name in e.value.details()  # type: ignore[attr-defined]
                after = status(stub)
                assert after.state == before.state == state.value
                assert after.weight_version == before.weight_version
        finally:
            h.close()


@pytest.mark.timeout(120)
def test_a_watch_of_the_update_that_failed_the_engine_says_why_and_ends() -> None:
    """A held Watch opened after its update already failed (the trainer opens it after Prepare's reply; the update
    may fail first): one message, the last, naming the failure, as an open call would have seen; the engine stays
    FAILED. Another update's Watch is still refused."""
    with tensor_server(seed=0) as (_, _, stub):
        h = Harness(stub)
        try:
            h.to(State.FAILED)
            messages = list(stub.Watch(pb.WatchRequest(update_id=h.update_id, hold=True), timeout=10))  # type: ignore[attr-defined]
            assert [(m.ended, m.state, m.last_error.reason) for m in messages] == [
                (True, State.FAILED.value, "UPDATE_CANCELLED")
            ]
            assert status(stub).state == State.FAILED.value  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Watch(pb.WatchRequest(update_id="another", hold=True), timeout=10))  # type: ignore[attr-defined]
            assert (code_of(e.value), error_reason(e.value)) == (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
        finally:
            h.close()
