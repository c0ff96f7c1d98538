"""Random sequences of RPCs against a live engine, checked against a model of the servicer.

Hypothesis' stateful testing drives a real gRPC server (a synthetic
:class:`~wsync_grpc.engines.tensor.TensorEngine`) whose trainer side, rank 0 of
a real gloo group, runs in this process: Init (with the trainer joining, or
with nobody to join), Prepare (valid, invalid, abandoned mid-stream,
cancelled while preparing), the broadcast of one bucket, Update, Complete
(with a short timeout), Pause in each mode, Resume (forced or not), Cancel,
Leave, GetStatus. The test keeps its own model of the lifecycle (the tables
of :mod:`wsync_grpc.core.lifecycle`), admission, dirtiness, weight version, last
error and the served bytes; every RPC's status code and reason is predicted
by the model, and after every step the invariant checks that the server
answers GetStatus within a deadline and that everything it reports, and every
served tensor, agrees with the model.

``make test`` runs a short search; ``make soak`` a long one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import code_of, free_port
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.core.dtypes import dtype_name
from wsync_grpc.core.lifecycle import ALLOWED, BUSY, Rpc, State
from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.group.waits import wait_work
from wsync_grpc.service.server import build_server
from wsync_grpc.testing import owner_channel
from wsync_grpc.wire.status import error_reason

PRESET = "tiny"
NAMES = list(synthetic.build(PRESET, seed=0))
GROUP_TIMEOUT_S = 60  # collectives; never reached within one example (every posted receive is matched)
SHORT_S = 0.5  # Complete's timeout when buckets are missing, and the join timeout with nobody to join
STATUS_DEADLINE_S = 2.0
RPC_DEADLINE_S = 10.0

Code = grpc.StatusCode
PAUSE_MODES = {"abort": pb.PAUSE_MODE_ABORT, "wait": pb.PAUSE_MODE_WAIT, "keep": pb.PAUSE_MODE_KEEP}


@dataclass
class ModelUpdate:
    """The update in flight, as the test expects the engine to hold it."""

    update_id: str
    version: str
    streaming: bool
    incremental: bool
    buckets: list[tuple[pb.BucketSpec, dict[str, torch.Tensor]]] = field(default_factory=list)
    sent: int = 0  # buckets broadcast (and received: the broadcast rule waits for the engine)
    auto_paused: bool = False

    @property
    def names(self) -> set[str]:
        return {n for _, values in self.buckets for n in values}


@dataclass
class Expected:
    """What an RPC should do: succeed, or fail with this code and reason."""

    code: Code | None = None
    reason: str = ""


def lifecycle_refusal(rpc: Rpc, state: State) -> Expected | None:
    """The refusal the lifecycle tables predict for ``rpc`` in ``state``; ``None`` when allowed."""
    if state in ALLOWED[rpc]:
        return None
    if state in BUSY.get(rpc, frozenset()):
        return Expected(Code.ABORTED, "UPDATE_IN_PROGRESS")
    return Expected(Code.FAILED_PRECONDITION, "WRONG_STATE")


def flat_bucket(spec: pb.BucketSpec, values: dict[str, torch.Tensor]) -> torch.Tensor:
    buf = torch.zeros(spec.size_bytes, dtype=torch.uint8)
    for t in spec.tensors:
        src = values[t.name].reshape(-1).view(torch.uint8)
        buf[t.offset_bytes : t.offset_bytes + src.numel()] = src
    return buf


class WsyncMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = TensorEngine(synthetic.build(PRESET, seed=0), aliases=synthetic.aliases(PRESET))
        self.srv = build_server(self.engine)
        self.channel = owner_channel(self.srv.address)  # one caller: it keeps and presents its lease credential
        self.stub = weight_sync_pb2_grpc.WeightSyncServiceStub(self.channel)
        self.trainer: WeightSyncGroup | None = None
        self.pool: list[Any] = []  # background Prepare calls to reap
        # The model.
        self.state = State.UNINITIALIZED
        self.init_req: pb.InitRequest | None = None
        self.paused: str | None = None  # None or the TensorEngine's mode name
        self.dirty = False
        self.dirty_paused = False
        self.version = ""
        self.completed = 0
        self.last_error = ""
        self.update: ModelUpdate | None = None
        self.failed: tuple[str, Expected] | None = None  # (update id, its error) in FAILED
        self.weights = {n: t.clone() for n, t in self.engine.tensors.items()}
        self.counter = 0

    # ------------------------------------------------------------------ helpers

    def call(self, expected: Expected | None, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run one RPC and check its outcome against ``expected`` (``None``: must succeed)."""
        kw.setdefault("timeout", RPC_DEADLINE_S)
        if expected is None or expected.code is None:
            return fn(*args, **kw)
        with pytest.raises(grpc.RpcError) as e:
            fn(*args, **kw)
        assert code_of(e.value) == expected.code, (fn, e.value)
        assert error_reason(e.value) == expected.reason, (fn, e.value)
        return None

    def drop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.destroy()
            self.trainer = None

    def fail_update(self, reason: str, error: Expected) -> None:
        """The engine's failure protocol (servicer._fail), as the model sees it."""
        upd = self.update
        assert upd is not None
        self.state = State.FAILED
        self.update = None
        self.failed = (upd.update_id, error)
        self.last_error = reason
        self.init_req = None
        self.drop_trainer()  # the engine left the group: so does the trainer
        if upd.streaming and upd.sent > 0:
            self.dirty = True
            if self.paused in (None, "wait"):
                self.dirty_paused = self.paused is None
                self.pause_engine("keep")
            elif upd.auto_paused:
                self.dirty_paused = True
        elif upd.auto_paused:
            self.paused = None

    def pause_engine(self, mode: str) -> None:
        """TensorEngine.pause: the first mode holds unless ABORT replaces it."""
        if self.paused is None or mode == "abort":
            self.paused = mode

    def new_values(self, name: str) -> torch.Tensor:
        self.counter += 1
        like = self.engine.tensors[name]
        gen = torch.Generator().manual_seed(self.counter)
        return torch.randn(like.shape, generator=gen).to(like.dtype)

    def make_buckets(
        self, start: int, count: int, used: set[str]
    ) -> list[tuple[pb.BucketSpec, dict[str, torch.Tensor]]]:
        """``count`` buckets of two fresh tensors each (not in ``used``), 256-byte aligned."""
        free = [n for n in NAMES if n not in used]
        out = []
        for i in range(count):
            spec = pb.BucketSpec(index=start + i)
            values: dict[str, torch.Tensor] = {}
            end = 0
            for n in free[2 * i : 2 * i + 2]:
                t = values[n] = self.new_values(n)
                off = -(-end // 256) * 256
                spec.tensors.add(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape), offset_bytes=off)
                end = off + t.numel() * t.element_size()
            spec.size_bytes = end
            out.append((spec, values))
        return out

    def wait_for(self, state: State, received: int | None = None) -> None:
        deadline = time.monotonic() + 10
        while True:
            st_ = self.stub.GetStatus(pb.GetStatusRequest(), timeout=STATUS_DEADLINE_S)
            if st_.state == state.value and (received is None or st_.update.buckets_received == received):
                return
            assert time.monotonic() < deadline, f"never reached {state.name} with {received} buckets: {st_}"
            time.sleep(0.005)

    def expected_in_flight_state(self) -> State:
        upd = self.update
        assert upd is not None
        return State.RECEIVED if upd.sent == len(upd.buckets) else State.RECEIVING

    # ------------------------------------------------------------------ Init

    @initialize()
    def start_joined(self) -> None:
        """Most sequences worth exploring start with the engine in a group."""
        self.init(same=False, nobody=1)

    @rule(same=st.booleans(), nobody=st.integers(0, 9))
    def init(self, same: bool, nobody: int) -> None:
        """Init with the trainer joining as rank 0; when READY, Init again with the same or other
        parameters; sometimes (``nobody == 0``) an Init whose group never forms."""
        port = free_port()
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
        req.timeout.FromSeconds(GROUP_TIMEOUT_S)
        if self.state == State.READY:
            assert self.init_req is not None
            if same:
                assert self.call(None, self.stub.Init, self.init_req).already_joined
            else:
                self.call(Expected(Code.ALREADY_EXISTS, "GROUP_MISMATCH"), self.stub.Init, req)
            return
        refusal = lifecycle_refusal(Rpc.INIT, self.state)
        if refusal is not None:
            self.call(refusal, self.stub.Init, req)
            return
        if nobody == 0:
            self.init_with_nobody_to_join()
            return
        self.drop_trainer()
        fut = self.stub.Init.future(req, timeout=GROUP_TIMEOUT_S + 10)
        self.trainer = join_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=GROUP_TIMEOUT_S
        )
        resp = fut.result()
        assert not resp.already_joined and list(resp.group.ranks) == [1]
        self.state = State.READY
        self.init_req = req
        self.failed = None

    def init_with_nobody_to_join(self) -> None:
        """Init whose group never forms: fails by its short timeout, back to UNINITIALIZED."""
        req = pb.InitRequest(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2)
        req.timeout.FromMilliseconds(int(SHORT_S * 1000))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            self.stub.Init(req, timeout=RPC_DEADLINE_S)
        assert time.monotonic() - t0 < SHORT_S + 5
        reason = error_reason(e.value)
        assert (code_of(e.value), reason) in (
            (Code.DEADLINE_EXCEEDED, "JOIN_TIMEOUT"),
            (Code.UNAVAILABLE, "JOIN_FAILED"),
        ), e.value
        self.state = State.UNINITIALIZED
        self.last_error = reason
        self.failed = None

    # ------------------------------------------------------------------ Prepare

    @rule(n=st.integers(0, 3), streaming=st.booleans(), incremental=st.booleans(), send=st.integers(0, 3))
    def prepare(self, n: int, streaming: bool, incremental: bool, send: int) -> None:
        """Prepare an update, then broadcast ``send`` of its buckets."""
        buckets = (n + 1) % 4  # 1, 2, 3 buckets, or an incremental update that starts empty
        if buckets == 0:
            incremental = True  # an empty non-incremental update is bad metadata (prepare_invalid)
        self.counter += 1
        upd = ModelUpdate(f"u{self.counter}", f"v{self.counter}", streaming, incremental)
        upd.buckets = self.make_buckets(0, buckets, set())
        header = pb.PrepareHeader(
            update_id=upd.update_id,
            weight_version=upd.version,
            apply_mode=pb.APPLY_MODE_STREAMING if streaming else pb.APPLY_MODE_STAGED,
            bucket_count=buckets,
            total_bytes=sum(s.size_bytes for s, _ in upd.buckets),
            incremental=incremental,
        )
        stream = [pb.PrepareRequest(header=header)] + [pb.PrepareRequest(bucket=s) for s, _ in upd.buckets]
        refusal = lifecycle_refusal(Rpc.PREPARE, self.state)
        if self.state in (State.UNINITIALIZED, State.FAILED):  # allowed for a disk update; a broadcast needs Init
            refusal = Expected(Code.FAILED_PRECONDITION, "WRONG_STATE")
        resp = self.call(refusal, self.stub.Prepare, iter(stream))
        if refusal is not None:
            return
        assert resp.update_id == upd.update_id and resp.bucket_count == buckets
        if streaming and self.paused in (None, "wait"):
            upd.auto_paused = self.paused is None
            self.pause_engine("keep")
        self.update = upd
        self.state = self.expected_in_flight_state()
        if self.state == State.RECEIVED:
            self.wait_for(State.RECEIVED)
        if send:
            self.broadcast(send)

    @rule(
        kind=st.sampled_from(
            ["unknown tensor", "wrong shape", "negative dim", "header twice", "bucket first", "empty", "bytes"]
        )
    )
    def prepare_invalid(self, kind: str) -> None:
        spec = pb.BucketSpec(index=0, size_bytes=128)
        spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64])
        header = pb.PrepareHeader(weight_version="bad", bucket_count=1, total_bytes=128)
        reason = {
            "unknown tensor": "UNKNOWN_TENSOR",
            "wrong shape": "SHAPE_MISMATCH",
            "negative dim": "INVALID_SHAPE",
            "header twice": "DUPLICATE_HEADER",
            "bucket first": "MISSING_HEADER",
            "empty": "EMPTY_UPDATE",
            "bytes": "TOO_MANY_BYTES",
        }[kind]
        if kind == "unknown tensor":
            spec.tensors[0].name = "model.nope\u202e.weight"
        elif kind == "wrong shape":
            spec.tensors[0].shape[:] = [2**40, 64]
        elif kind == "negative dim":
            spec.tensors[0].shape[:] = [-64]
        elif kind == "empty":
            header.bucket_count = 0
        elif kind == "bytes":
            header.total_bytes = 10**12
        stream = [pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]
        if kind == "header twice":
            stream = [stream[0], *stream]
        elif kind == "bucket first":
            stream = [stream[1], stream[0]]
        elif kind == "empty":
            stream = stream[:1]
        refusal = lifecycle_refusal(Rpc.PREPARE, self.state) or Expected(Code.INVALID_ARGUMENT, reason)
        self.call(refusal, self.stub.Prepare, iter(stream))

    @precondition(lambda self: self.state == State.READY)
    @rule(cancel=st.booleans())
    def prepare_abandoned(self, cancel: bool) -> None:
        """A Prepare stream held open mid-way, then dropped by the client or cancelled by Cancel."""
        gate = threading.Event()
        header = pb.PrepareHeader(weight_version="held", bucket_count=1, total_bytes=128)
        spec = pb.BucketSpec(index=0, size_bytes=128)
        spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64])

        def held() -> Iterator[pb.PrepareRequest]:
            yield pb.PrepareRequest(header=header)
            gate.wait(30)
            yield pb.PrepareRequest(bucket=spec)

        fut = self.stub.Prepare.future(held(), timeout=60)
        try:
            self.wait_for(State.PREPARING)
            # Another trainer's Cancel, naming its own update, leaves this one alone.
            r = self.call(None, self.stub.Cancel, pb.CancelRequest(update_id="someone-else"))
            assert not r.cancelled and r.state == pb.LIFECYCLE_STATE_PREPARING
            if cancel:
                r = self.call(None, self.stub.Cancel, pb.CancelRequest(reason="stateful"))
                assert r.cancelled and r.state == pb.LIFECYCLE_STATE_PREPARING
                # The engine ends the held stream itself, without the client's next message (the
                # client sees the cancelled call, or the ABORTED status if it got out first).
                with pytest.raises(grpc.RpcError) as e:
                    fut.result(timeout=10)
                assert (code_of(e.value), error_reason(e.value)) in (
                    (Code.CANCELLED, ""),
                    (Code.ABORTED, "UPDATE_CANCELLED"),
                ), e.value
            else:
                fut.cancel()
        finally:
            gate.set()
        self.wait_for(State.READY)

    # ------------------------------------------------------------------ bytes

    @precondition(lambda self: self.update is not None and self.update.sent < len(self.update.buckets))
    @rule(count=st.integers(1, 3))
    def broadcast(self, count: int) -> None:
        """The trainer broadcasts the next ``count`` declared buckets (as many as are left)."""
        upd = self.update
        assert upd is not None and self.trainer is not None
        for _ in range(min(count, len(upd.buckets) - upd.sent)):
            spec, values = upd.buckets[upd.sent]
            wait_work(self.trainer.broadcast(flat_bucket(spec, values)), time.monotonic() + 10)
            upd.sent += 1
            if upd.streaming:
                self.weights.update(values)
            self.state = self.expected_in_flight_state()
            self.wait_for(self.state, upd.sent)

    # ------------------------------------------------------------------ Update

    @rule(count=st.integers(1, 2), wrong_id=st.booleans())
    def update_more(self, count: int, wrong_id: bool) -> None:
        upd = self.update
        used = upd.names if upd is not None else set()
        start = len(upd.buckets) if upd is not None else 0
        if len(NAMES) - len(used) < 2 * count:
            return  # the model has no tensors left for this update
        buckets = self.make_buckets(start, count, used)
        req = pb.UpdateRequest(
            update_id="nope" if wrong_id or upd is None else upd.update_id, buckets=[s for s, _ in buckets]
        )
        refusal = lifecycle_refusal(Rpc.UPDATE, self.state)
        if refusal is None:
            assert upd is not None
            if wrong_id:
                refusal = Expected(Code.FAILED_PRECONDITION, "UPDATE_ID_MISMATCH")
            elif not upd.incremental:
                refusal = Expected(Code.FAILED_PRECONDITION, "NOT_INCREMENTAL")
        resp = self.call(refusal, self.stub.Update, req)
        if refusal is not None:
            return
        assert upd is not None
        upd.buckets += buckets
        assert resp.bucket_count == len(upd.buckets)
        self.state = State.RECEIVING

    # ------------------------------------------------------------------ Complete

    @rule(wrong_id=st.booleans())
    def complete(self, wrong_id: bool) -> None:
        upd = self.update
        current = upd.update_id if upd is not None else (self.failed[0] if self.failed else "none")
        req = pb.CompleteRequest(update_id="nope" if wrong_id else current)
        req.timeout.FromMilliseconds(int(SHORT_S * 1000))
        refusal = lifecycle_refusal(Rpc.COMPLETE, self.state)
        if refusal is not None:
            self.call(refusal, self.stub.Complete, req)
            return
        if self.state == State.FAILED:
            if self.failed is not None and not wrong_id:
                self.call(self.failed[1], self.stub.Complete, req)  # the update's own error
            else:
                self.call(Expected(Code.FAILED_PRECONDITION, "WRONG_STATE"), self.stub.Complete, req)
            return
        assert upd is not None
        if wrong_id:
            self.call(Expected(Code.FAILED_PRECONDITION, "UPDATE_ID_MISMATCH"), self.stub.Complete, req)
            return
        if upd.sent < len(upd.buckets):
            error = Expected(Code.DEADLINE_EXCEEDED, "RECEIVE_TIMEOUT")
            t0 = time.monotonic()
            self.call(error, self.stub.Complete, req)
            assert time.monotonic() - t0 < SHORT_S + 5
            self.fail_update("RECEIVE_TIMEOUT", error)
            return
        resp = self.call(None, self.stub.Complete, req)
        assert resp.weight_version == upd.version and resp.bucket_count == len(upd.buckets)
        if not upd.streaming:
            for _, values in upd.buckets:
                self.weights.update(values)
        self.version = upd.version
        self.completed += 1
        self.dirty = False
        if upd.auto_paused or self.dirty_paused:
            self.paused = None
        self.dirty_paused = False
        self.update = None
        self.state = State.READY

    # ------------------------------------------------------------------ admission

    @rule(mode=st.sampled_from(sorted(PAUSE_MODES)))
    def pause(self, mode: str) -> None:
        resp = self.call(None, self.stub.Pause, pb.PauseRequest(mode=PAUSE_MODES[mode]))
        assert resp.already_paused == (self.paused is not None)
        if self.update is not None:
            self.update.auto_paused = False
        self.dirty_paused = False
        self.pause_engine(mode)
        assert resp.mode == PAUSE_MODES[self.paused or mode]

    @rule(force=st.booleans())
    def resume(self, force: bool) -> None:
        refusal = None
        if self.update is not None and self.update.streaming:
            refusal = Expected(Code.FAILED_PRECONDITION, "STREAMING_UPDATE_IN_FLIGHT")
        elif self.dirty and not force:
            refusal = Expected(Code.FAILED_PRECONDITION, "ENGINE_DIRTY")
        resp = self.call(refusal, self.stub.Resume, pb.ResumeRequest(force=force))
        if refusal is not None:
            return
        assert resp.was_paused == (self.paused is not None)
        self.paused = None
        self.dirty_paused = False

    # ------------------------------------------------------------------ Cancel / Leave

    @rule(match=st.sampled_from(["any", "own", "other"]))
    def cancel(self, match: str) -> None:
        upd = self.update
        update_id = {"any": "", "own": upd.update_id if upd else "", "other": "someone-else"}[match]
        resp = self.call(
            lifecycle_refusal(Rpc.CANCEL, self.state), self.stub.Cancel, pb.CancelRequest(update_id=update_id)
        )
        if upd is None or match == "other":
            assert not resp.cancelled and resp.state == self.state.value
            return
        assert resp.cancelled and resp.update_id == upd.update_id
        self.fail_update("UPDATE_CANCELLED", Expected(Code.ABORTED, "UPDATE_CANCELLED"))
        assert resp.state == State.FAILED.value

    @rule()
    def leave(self) -> None:
        refusal = lifecycle_refusal(Rpc.LEAVE, self.state)
        resp = self.call(refusal, self.stub.Leave, pb.LeaveRequest())
        if refusal is not None:
            return
        assert resp.was_member == (self.state == State.READY)
        self.state = State.UNINITIALIZED
        self.init_req = None
        self.drop_trainer()

    @rule()
    def checksums(self) -> None:
        resp = self.call(None, self.stub.GetWeightChecksums, pb.GetWeightChecksumsRequest(names=NAMES[:3]))
        assert resp.weight_version == self.version and len(resp.checksums) == 3

    # ------------------------------------------------------------------ the invariant

    @invariant()
    def server_agrees_with_model(self) -> None:
        t0 = time.monotonic()
        s = self.stub.GetStatus(pb.GetStatusRequest(), timeout=STATUS_DEADLINE_S)
        assert time.monotonic() - t0 < STATUS_DEADLINE_S
        assert s.state == self.state.value, f"server {pb.LifecycleState.Name(s.state)}, model {self.state.name}"
        assert s.paused == (self.paused is not None), s
        if self.paused is not None:
            assert s.pause_mode == PAUSE_MODES[self.paused], s
        assert s.dirty == self.dirty, s
        assert s.weight_version == self.version and s.updates_completed == self.completed, s
        assert s.HasField("group") == (self.state in (State.READY, State.RECEIVING, State.RECEIVED)), s
        if self.init_req is not None:
            assert s.group.master_port == self.init_req.master_port, s
        assert (s.last_error.reason if s.HasField("last_error") else "") == self.last_error, s
        upd = self.update
        assert s.HasField("update") == (upd is not None), s
        if upd is not None:
            assert s.update.update_id == upd.update_id and s.update.weight_version == upd.version, s
            assert s.update.buckets_expected == len(upd.buckets) and s.update.buckets_received == upd.sent, s
            assert s.update.incremental == upd.incremental, s
        for name, t in self.weights.items():
            assert torch.equal(self.engine.tensors[name], t), f"{name} differs from the model"

    def teardown(self) -> None:
        try:
            if self.update is not None:
                self.stub.Cancel(pb.CancelRequest(), timeout=RPC_DEADLINE_S)
            self.drop_trainer()
        finally:
            self.channel.close()
            self.srv.stop(0)


def run(examples: int, steps: int) -> None:
    run_state_machine_as_test(
        WsyncMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.timeout(240)
def test_random_rpc_sequences_agree_with_the_model() -> None:
    run(examples=40, steps=30)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_rpc_sequences_agree_with_the_model_soak() -> None:
    run(examples=300, steps=60)
