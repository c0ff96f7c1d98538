"""The outcome trainer rank 0 shares with the other ranks: JSON both ways, the same result or the same error."""

from __future__ import annotations

import grpc
import pytest

from wsync_grpc.trainer.results import ClientError, EngineFailure, EngineSyncResult, SyncError, SyncResult
from wsync_grpc.trainer.sharded.outcome import decode_outcome, encode_error, encode_result

ENGINE = EngineSyncResult("127.0.0.1:1", "u1", "v1", 3, 272, 538_000_000, 0.1, 0.5, 0.2, 0.9, True, 0.05)


def test_a_result_comes_back_equal() -> None:
    result = SyncResult(
        "u1", "v1", "flattened", "staged", 3, 272, 538_000_000, 538_000_128, 0.0, 0.01, 0.1, 0.5, 0.02, 0.3, 0.1,
        0.9, {ENGINE.target: ENGINE},
    )  # fmt: skip
    assert decode_outcome(encode_result(result)) == result


def test_a_result_of_a_fleet_that_left_engines_out_comes_back_equal_and_nothing_to_do_is_none() -> None:
    dead = EngineFailure("127.0.0.1:3", "GetStatus", grpc.StatusCode.UNAVAILABLE, "", "connection refused")
    result = SyncResult(
        "u2", "v2", "flattened", "staged", 3, 272, 538_000_000, 538_000_128, 0.0, 0.01, 0.1, 0.5, 0.02, 0.3, 0.1,
        0.9, {ENGINE.target: ENGINE}, excluded={dead.target: dead}, rejoined=[], attempts=2,
    )  # fmt: skip
    assert decode_outcome(encode_result(result)) == result
    assert decode_outcome(encode_result(None)) is None


def test_a_sync_error_comes_back_with_its_stage_failures_and_results() -> None:
    lost = EngineFailure("127.0.0.1:2", "Complete", grpc.StatusCode.UNAVAILABLE, "PEER_LOST", "gone", {"a": "b"})
    rank = EngineFailure("trainer", "broadcast", None, "TrainerRankLost", "trainer rank 1 is gone")
    failures = {"127.0.0.1:2": lost, "trainer": rank}
    err = SyncError(
        "boom",
        stage="apply",
        update_id="u1",
        weight_version="v1",
        failures=failures,
        results={ENGINE.target: ENGINE},
        cancelled={"127.0.0.1:2": True},
        broadcast_started=True,
    )
    with pytest.raises(SyncError) as got:
        decode_outcome(encode_error(err))
    e = got.value
    assert str(e) == "trainer rank 0: boom"
    assert (e.stage, e.update_id, e.weight_version, e.broadcast_started) == ("apply", "u1", "v1", True)
    assert e.failures == failures and e.results == {ENGINE.target: ENGINE} and e.cancelled == {"127.0.0.1:2": True}
    assert e.published == "partial"


@pytest.mark.parametrize(("exc", "kind"), [(ValueError("bad bucket size"), ValueError), (KeyError("x"), ClientError)])
def test_other_errors_keep_their_kind_and_message(exc: Exception, kind: type[Exception]) -> None:
    with pytest.raises(kind, match=f"trainer rank 0: {type(exc).__name__}"):
        decode_outcome(encode_error(exc))
