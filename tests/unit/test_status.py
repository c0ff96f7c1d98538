"""GetStatus built from a snapshot (service.status), and the engine-wide state's snapshot and admission policy
(service.engine_state) on a real tensor engine, with no process group and no server."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import ParamSpec, PauseMode
from wsync_grpc.core.errors import Aborted, DeadlineExceeded, FailedPrecondition
from wsync_grpc.core.layout import ApplyMode, Layout
from wsync_grpc.core.lifecycle import Event, State
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.status import (
    EngineFacts,
    ErrorRecord,
    Progress,
    StatusSnapshot,
    engine_info,
    error_detail,
    progress_message,
    status_response,
)
from wsync_grpc.wire.convert import seconds

FACTS = EngineFacts(name="tiny", parameter_count=30, parameter_bytes=96, tensor_count=2, workers=2)

IDLE = StatusSnapshot(
    state=State.UNINITIALIZED,
    paused=False,
    pause_mode=None,
    dirty=False,
    weight_version="",
    updates_completed=0,
    group=None,
    devices=("cpu", "cpu"),
    update=None,
    last_error=None,
    engine=FACTS,
    running_requests=0,
    waiting_requests=0,
)

PROGRESS = Progress(
    update_id="u9",
    weight_version="v9",
    layout=Layout.INDIVIDUAL,
    apply_mode=ApplyMode.STREAMING,
    buckets_expected=4,
    buckets_received=1,
    bytes_expected=4096,
    bytes_received=1024,
    elapsed_seconds=0.5,
    incremental=True,
)


def test_an_idle_engine_reports_only_what_is_set() -> None:
    resp = status_response(IDLE)
    assert resp.state == pb.LIFECYCLE_STATE_UNINITIALIZED
    assert not resp.paused and resp.pause_mode == pb.PAUSE_MODE_UNSPECIFIED
    assert not resp.HasField("group") and not resp.HasField("update") and not resp.HasField("last_error")
    assert resp.engine == pb.EngineInfo(name="tiny", parameter_count=30, parameter_bytes=96, tensor_count=2, workers=2)


def test_a_busy_engine_reports_everything() -> None:
    snap = dataclasses.replace(
        IDLE,
        state=State.RECEIVING,
        paused=True,
        pause_mode=PauseMode.KEEP,
        dirty=True,
        weight_version="v8",
        updates_completed=8,
        group=GroupParams("127.0.0.1", 29500, 1, 3, "g", "gloo", 12.0),
        update=PROGRESS,
        last_error=ErrorRecord("PEER_LOST", "the trainer died", "u8", 1700000000.5),
        running_requests=3,
        waiting_requests=5,
    )
    resp = status_response(snap)
    assert resp.state == pb.LIFECYCLE_STATE_RECEIVING
    assert resp.paused and resp.pause_mode == pb.PAUSE_MODE_KEEP and resp.dirty
    assert (resp.weight_version, resp.updates_completed) == ("v8", 8)
    assert list(resp.group.ranks) == [1, 2] and list(resp.group.devices) == ["cpu", "cpu"]
    assert resp.group.backend == pb.BACKEND_GLOO and seconds(resp.group.timeout, 0.0) == 12.0
    assert resp.update == progress_message(PROGRESS)
    assert resp.last_error == pb.ErrorDetail(
        reason="PEER_LOST", message="the trainer died", update_id="u8", unix_seconds=1700000000.5
    )
    assert (resp.engine.running_requests, resp.engine.waiting_requests) == (3, 5)
    assert resp.engine.name == "tiny"


def test_progress_message_converts_enums() -> None:
    msg = progress_message(PROGRESS)
    assert msg.layout == pb.BUCKET_LAYOUT_INDIVIDUAL and msg.apply_mode == pb.APPLY_MODE_STREAMING
    assert (msg.buckets_expected, msg.buckets_received, msg.bytes_expected, msg.bytes_received) == (4, 1, 4096, 1024)
    assert msg.elapsed_seconds == 0.5 and msg.incremental and msg.update_id == "u9"


def test_error_record_of_an_error_is_stamped_now() -> None:
    before = time.time()
    rec = ErrorRecord.of(Aborted("UPDATE_CANCELLED", "the update was cancelled: test"), "u1")
    assert (rec.reason, rec.message, rec.update_id) == ("UPDATE_CANCELLED", "the update was cancelled: test", "u1")
    assert before <= rec.unix_seconds <= time.time()
    assert error_detail(rec).unix_seconds == rec.unix_seconds


def test_engine_facts_count_elements_and_bytes() -> None:
    specs = {
        "w": ParamSpec("w", torch.float32, (2, 3)),
        "b": ParamSpec("b", torch.bfloat16, (4,)),
        "s": ParamSpec("s", torch.int64, ()),
    }
    facts = EngineFacts.of("e", specs, workers=1)
    assert facts == EngineFacts("e", parameter_count=6 + 4 + 1, parameter_bytes=24 + 8 + 8, tensor_count=3, workers=1)
    assert engine_info(facts).running_requests == 0


# ---------------------------------------------------- engine state, no group


@pytest.fixture
def engine() -> EngineState:
    tensors = {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    return EngineState(TensorEngine(tensors, name="tiny"))


def test_a_fresh_engine_snapshot(engine: EngineState) -> None:
    snap = engine.snapshot()
    assert snap.state is State.UNINITIALIZED and snap.group is None and snap.update is None
    assert snap.devices == ("cpu",) and not snap.paused and snap.pause_mode is None
    assert snap.engine == EngineFacts("tiny", parameter_count=10, parameter_bytes=32, tensor_count=2, workers=1)
    assert engine.receive_buffer_bytes == 0


def test_pause_then_resume(engine: EngineState) -> None:
    already, outcome, mode = engine.pause(PauseMode.KEEP, 1.0)
    assert not already and mode is PauseMode.KEEP and outcome.aborted == 0
    snap = engine.snapshot()
    assert snap.paused and snap.pause_mode is PauseMode.KEEP
    assert status_response(snap).pause_mode == pb.PAUSE_MODE_KEEP
    assert engine.pause(PauseMode.WAIT, 1.0)[0], "already paused"
    assert engine.resume(force=False) == (True, 0)
    assert engine.resume(force=False) == (False, 0)
    assert not engine.snapshot().paused


def test_dirty_weights_refuse_resume_unless_forced(engine: EngineState) -> None:
    engine.pause(PauseMode.KEEP, 1.0)
    engine.dirty = engine.dirty_paused = True
    with pytest.raises(FailedPrecondition) as e:
        engine.resume(force=False)
    assert e.value.reason == "ENGINE_DIRTY"
    assert engine.snapshot().paused and engine.dirty_paused
    assert engine.resume(force=True) == (True, 0)
    assert not engine.dirty_paused and engine.dirty, "forcing serves the dirty weights; it does not clean them"


def test_no_update_in_flight(engine: EngineState) -> None:
    with pytest.raises(FailedPrecondition) as e:
        engine.current("u1")
    assert e.value.reason == "NO_UPDATE"
    err = engine.failure_of("u1")
    assert isinstance(err, FailedPrecondition) and err.reason == "WRONG_STATE"


def test_an_init_error_is_reported(engine: EngineState) -> None:
    engine.lifecycle.fire(Event.JOIN)
    engine.lifecycle.fire(Event.JOIN_FAILED)
    engine.record_error(DeadlineExceeded("JOIN_TIMEOUT", "group 'g' did not form within 1 s"))
    resp = status_response(engine.snapshot())
    assert resp.state == pb.LIFECYCLE_STATE_UNINITIALIZED
    assert (resp.last_error.reason, resp.last_error.update_id) == ("JOIN_TIMEOUT", "")
