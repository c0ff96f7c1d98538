"""Sharded trainers: real FSDP2 ranks (2 processes over gloo, SmolLM2-135M) syncing into a real reference engine.

Every trainer rank is a ``python -m wsync_grpc.tools.fsdp_rank`` process; the engine is a ``wsync serve``
process shared by the module. Rank 0 checks checksums (bit-exact against the gathered weights) and
greedy answers itself (``--check``); the tests read every rank's JSON lines.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from fsdp_ranks import start_ranks
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.testing import EngineProcess, spawn_engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    tmp = tmp_path_factory.mktemp("sharded")
    proc = spawn_engine(["--engine", "reference"], port_file=tmp / "port", log=tmp / "engine.log", name="ref")
    try:
        yield proc
    finally:
        proc.stop()


def _stub(target: str) -> weight_sync_pb2_grpc.WeightSyncServiceStub:
    return weight_sync_pb2_grpc.WeightSyncServiceStub(grpc.insecure_channel(target))


def test_gather_mode_is_bit_exact_and_answers_change_with_the_trainer(engine: EngineProcess) -> None:
    ranks = start_ranks([engine.target], "--steps=2", "--modes=gather", "--check=all")
    codes = [r.wait() for r in ranks]
    assert codes == [0, 0], [r.stderr for r in ranks]
    for r in ranks:  # every rank returns rank 0's result
        synced = [e for e in r.events if e["event"] == "synced"]
        assert [e["version"] for e in synced] == ["step-1-gather", "step-2-gather"]
    checks = [e for e in ranks[0].events if e["event"] == "checked"]
    assert [c["failures"] for c in checks] == [[], []]
    status = _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.weight_version == "step-2-gather"


def test_ranks_that_disagree_fail_on_every_rank_within_seconds(engine: EngineProcess) -> None:
    before = _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10).weight_version
    ranks = start_ranks([engine.target], "--steps=1", per_rank=((), ("--version-suffix=-other",)))
    codes = [r.wait() for r in ranks]
    assert codes == [1, 1]
    errors = [r.wait_for("error") for r in ranks]
    for e in errors:
        assert e["kind"] == "RanksDisagree"
        assert "rank 1 differs from rank 0 in: weight version" in e["message"]
        assert e["seconds"] < 10
    assert _stub(engine.target).GetStatus(pb.GetStatusRequest(), timeout=10).weight_version == before


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_transfer_fails_the_others_and_the_engine_keeps_its_weights(
    engine: EngineProcess, victim: int
) -> None:
    stub = _stub(engine.target)
    # Small buckets: each sync is ~130 buckets, so a kill lands in the middle of one.
    ranks = start_ranks([engine.target], "--steps=6", "--bucket-bytes=4000000")
    ranks[0].wait_for("synced", version="step-1-gather")
    start = ranks[0].wait_for("sync_start", version="step-2-gather")
    served = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
    assert served.weight_version == "step-1-gather"
    time.sleep(random.uniform(0.05, 0.4))
    killed_at = time.monotonic()
    ranks[victim].proc.send_signal(signal.SIGKILL)
    survivor = ranks[1 - victim]
    error = survivor.wait_for("error", timeout=30)
    assert survivor.wait() == 1
    ranks[victim].wait()
    assert error["at"] - killed_at < 5, error
    assert error["version"] == "step-2-gather", error  # the sync in flight failed, not a later one
    assert f"trainer rank {victim} is gone" in error["message"], error
    assert start["at"] < killed_at
    # The engine noticed within the bound and serves the old weights whole (staged apply).
    deadline = killed_at + 5
    while stub.GetStatus(pb.GetStatusRequest(), timeout=10).HasField("update") and time.monotonic() < deadline:
        time.sleep(0.05)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert not status.HasField("update"), status
    assert status.weight_version == "step-1-gather"
    after = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)
    assert [(c.name, c.sha256) for c in after.checksums] == [(c.name, c.sha256) for c in served.checksums]
    # The trainer re-forms (new processes) and the next sync succeeds.
    again = start_ranks([engine.target], "--steps=1", "--version-suffix=-again")
    assert [r.wait() for r in again] == [0, 0], [r.stderr for r in again]
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).weight_version == "step-1-gather-again"


def test_a_bad_argument_fails_every_rank_not_one(engine: EngineProcess) -> None:
    ranks = start_ranks([engine.target], "--steps=1", "--modes=sideways")
    assert [r.wait() for r in ranks] == [1, 1]
    for r in ranks:
        e = r.wait_for("error")
        assert e["kind"] == "ValueError" and "unknown send mode 'sideways'" in e["message"], e
        assert e["seconds"] < 10
