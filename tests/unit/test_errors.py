"""Errors: the one mapping of any exception to a domain error (core.errors.domain_error, by phase), and the one
mapping of a domain error to a rich gRPC status (wire.status)."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from wsync_grpc.core.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GroupError,
    GroupTimeout,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Phase,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    WsyncError,
    domain_error,
)
from wsync_grpc.core.lifecycle import Rpc, State, UpdateInProgress, WrongState
from wsync_grpc.trainer.results import EngineFailure
from wsync_grpc.wire.status import (
    DOMAIN,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_VALUE_BYTES,
    STATUS_CODES,
    error_info,
    status_code,
    to_status,
)

# ------------------------------------------------------------- domain_error


@pytest.mark.parametrize("phase", list(Phase))
def test_a_wsync_error_is_returned_as_it_is(phase: Phase) -> None:
    err = InvalidArgument("SOME_REASON", "text", tensor="w")
    assert domain_error(err, phase) is err


@pytest.mark.parametrize(
    ("exc", "category", "reason"),
    [
        (GroupTimeout("group 'g' did not form within 5 s"), DeadlineExceeded, "JOIN_TIMEOUT"),
        (GroupError("store unreachable"), Unavailable, "JOIN_FAILED"),
        (ValueError("rank 3 outside world size 2"), InvalidArgument, "INVALID_GROUP"),
        (Cancelled("the update was cancelled"), Aborted, "UPDATE_CANCELLED"),
        (RuntimeError("boom"), Internal, "INTERNAL"),
    ],
)
def test_join_phase(exc: BaseException, category: type[WsyncError], reason: str) -> None:
    err = domain_error(exc, Phase.JOIN)
    assert type(err) is category and err.reason == reason
    if reason.startswith("JOIN") or reason == "INVALID_GROUP":
        assert err.message == str(exc)


def test_receive_phase() -> None:
    timeout = domain_error(GroupTimeout("the collective did not finish"), Phase.RECEIVE, timeout_s=2.5)
    assert isinstance(timeout, DeadlineExceeded) and timeout.reason == "RECEIVE_TIMEOUT"
    assert timeout.message == "no bucket arrived within the group timeout of 2.5 s: the collective did not finish"
    lost = domain_error(GroupError("connection reset"), Phase.RECEIVE, timeout_s=2.5)
    assert isinstance(lost, Unavailable) and lost.reason == "PEER_LOST"
    assert lost.message.endswith("(did the trainer die?): connection reset")
    cancelled = domain_error(Cancelled("the update was cancelled"), Phase.RECEIVE, timeout_s=2.5)
    assert isinstance(cancelled, Aborted) and cancelled.reason == "UPDATE_CANCELLED"
    assert cancelled.message == "the update was cancelled"
    # A ValueError is a join's INVALID_GROUP only: elsewhere it is a bug.
    assert domain_error(ValueError("x"), Phase.RECEIVE).reason == "INTERNAL"


@pytest.mark.parametrize(
    ("exc", "category", "reason", "message"),
    [
        (Cancelled("c"), Aborted, "UPDATE_CANCELLED", "the update was cancelled"),
        (GroupTimeout("late"), DeadlineExceeded, "TIMEOUT", "late"),
        (TimeoutError(), DeadlineExceeded, "TIMEOUT", "timed out"),
        (GroupError("broken pipe"), Unavailable, "GROUP_BROKEN", "broken pipe"),
        (ValueError("bad"), Internal, "INTERNAL", "ValueError: bad"),
        (KeyError("w"), Internal, "INTERNAL", "KeyError: 'w'"),
    ],
)
def test_other_phase(exc: BaseException, category: type[WsyncError], reason: str, message: str) -> None:
    err = domain_error(exc)
    assert type(err) is category and (err.reason, err.message) == (reason, message)


def test_lifecycle_refusals_are_domain_errors() -> None:
    wrong = WrongState(Rpc.COMPLETE, State.READY)
    assert isinstance(wrong, FailedPrecondition) and wrong.reason == "WRONG_STATE"
    assert wrong.metadata == {"state": "READY", "rpc": "Complete"}
    assert "Complete is not allowed in state READY" in wrong.message
    busy = UpdateInProgress(Rpc.PREPARE, State.RECEIVING)
    assert isinstance(busy, Aborted) and busy.reason == "UPDATE_IN_PROGRESS"
    assert domain_error(wrong) is wrong and domain_error(busy) is busy


# ------------------------------------------------------------------ statuses

EXPECTED_CODES: dict[type[WsyncError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Internal: grpc.StatusCode.INTERNAL,
}
"""The contract's canonical codes (docs/architecture.md, "Errors")."""
CATEGORIES = list(EXPECTED_CODES)


def test_every_category_has_its_canonical_code() -> None:
    assert STATUS_CODES == EXPECTED_CODES
    for cls, code in EXPECTED_CODES.items():
        assert status_code(cls("R", "m")) == code
    assert status_code(WrongState(Rpc.INIT, State.JOINING)) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_code(UpdateInProgress(Rpc.PREPARE, State.PREPARING)) == grpc.StatusCode.ABORTED
    assert status_code(WsyncError("R", "m")) == grpc.StatusCode.INTERNAL


def _rich(status: grpc.Status) -> tuple[status_pb2.Status, error_details_pb2.ErrorInfo]:
    """The ``google.rpc.Status`` and its ErrorInfo carried in ``status``'s trailing metadata."""
    (key, value), *rest = status.trailing_metadata  # type: ignore[attr-defined]
    assert key == "grpc-status-details-bin" and not rest
    rich = status_pb2.Status.FromString(value)
    (detail,) = rich.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return rich, info


@pytest.mark.parametrize("cls", CATEGORIES)
def test_to_status_carries_code_message_and_error_info(cls: type[WsyncError]) -> None:
    status = to_status(cls("SOME_REASON", "what happened", bucket="3", tensor="w"))
    assert status.code == STATUS_CODES[cls]  # type: ignore[attr-defined]
    assert status.details == "what happened"  # type: ignore[attr-defined]
    rich, info = _rich(status)
    assert rich.code == getattr(code_pb2, STATUS_CODES[cls].name) and rich.message == "what happened"
    assert (info.reason, info.domain, dict(info.metadata)) == ("SOME_REASON", DOMAIN, {"bucket": "3", "tensor": "w"})


def test_to_status_bounds_message_and_metadata() -> None:
    status = to_status(InvalidArgument("R", "é" * 5000, tensor="x" * 5000))
    rich, info = _rich(status)
    assert len(rich.message.encode()) <= MAX_MESSAGE_BYTES and rich.message.endswith("...")
    assert rich.message.rstrip(".").strip("é") == ""  # cut between characters, never inside one
    assert len(info.metadata["tensor"].encode()) <= MAX_METADATA_VALUE_BYTES
    short = to_status(InvalidArgument("R", "short", tensor="w"))
    assert _rich(short)[0].message == "short" and _rich(short)[1].metadata["tensor"] == "w"


def test_a_failed_aio_call_gives_its_code_reason_and_metadata() -> None:
    """The trainer's streams run on ``grpc.aio``: an ``AioRpcError`` is read like a synchronous call's error."""
    status = to_status(FailedPrecondition("NOT_OWNER", "owned by alice", owner="alice"))
    trailers = grpc.aio.Metadata(*status.trailing_metadata)  # type: ignore[attr-defined]
    exc = grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailers, details=status.details)  # type: ignore[attr-defined]
    assert error_info(exc) == ("NOT_OWNER", {"owner": "alice"})
    failure = EngineFailure.from_exception("h:1", "KeepAlive", exc)
    assert failure == EngineFailure(
        "h:1", "KeepAlive", grpc.StatusCode.FAILED_PRECONDITION, "NOT_OWNER", "owned by alice", {"owner": "alice"}
    )
    bare = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone")
    assert EngineFailure.from_exception("h:1", "Watch", bare) == EngineFailure(
        "h:1", "Watch", grpc.StatusCode.UNAVAILABLE, "", "gone"
    )
