"""A sync's whole deadline (``sync(..., timeout_s=...)``) against a real engine process in a real gloo group.

A trainer whose tensors come slowly (a slow gather) is stopped by its deadline mid-broadcast: the sync
raises a :class:`SyncError` naming the stage and ``DEADLINE_EXCEEDED`` by the deadline (plus the
abandon's Cancel calls), the engine serves the weights it had (published nowhere), and the next sync
without a deadline publishes. A second client's first sync, after the first client closed, succeeds
within its own deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
import time
from collections.abc import Iterator, Mapping

import pytest
import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.layout import Bucket
from wsync_grpc.engines import synthetic
from wsync_grpc.testing import EngineProcess, child_env, spawn_engine, stop_all
from wsync_grpc.trainer import TRAINER, EngineCallError, SyncError, SyncProgress, TrainerClient
from wsync_grpc.trainer.deadline import CancelSignal
from wsync_grpc.trainer.source import NamedTensors

# Wall-clock bounds: `make test` runs this module in its serial pass.
pytestmark = pytest.mark.serial

ENV = child_env({"WSYNC_LOG_LEVEL": "INFO"})
SMALL = {"bucket_bytes": 16 << 10, "ramp_bytes": 0, "solo_bytes": 1 << 30, "rpc_timeout_s": 30.0}
"""Client settings that cut the tiny model in many buckets."""

DELAY_S = 0.4
"""How long the slow trainer takes to produce each bucket's tensors, in seconds."""


class SlowSource(NamedTensors):
    """A trainer's tensors that take :data:`DELAY_S` per bucket to produce (as a slow gather does)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(tensors.items())
        self.asked = 0

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        time.sleep(DELAY_S)
        self.asked += 1
        return super().bucket_tensors(bucket)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    d = tmp_path_factory.mktemp("deadline")
    e = spawn_engine(
        ["--synthetic", "tiny", "--dtype", "bfloat16", "--grace", "1"],
        port_file=d / "port",
        log=d / "engine.log",
        env=ENV,
    )
    yield e
    stop_all([e])


def served(e: EngineProcess) -> tuple[pb.GetStatusResponse, dict[str, str]]:
    with TrainerClient([e.target]) as c:
        status = c.status()[e.target].raw
        sums = c.checksums()[e.target].by_name
    return status, sums


def test_a_sync_ends_by_its_deadline_and_publishes_nowhere(engine: EngineProcess) -> None:
    before = synthetic.build("tiny", seed=1)
    after = synthetic.build("tiny", seed=2)
    with TrainerClient([engine.target], **SMALL) as c:
        buckets = c.sync(before.items(), "before").bucket_count
        assert buckets * DELAY_S > 1.5 + 2.0, buckets  # the slow sync cannot end before its deadline
        slow = SlowSource(after)
        t0 = time.monotonic()
        with pytest.raises(SyncError) as raised:
            c.sync(slow, "late", timeout_s=1.5)
        took = time.monotonic() - t0
        err = raised.value
        assert err.stage == "broadcast", err
        assert err.failures[TRAINER].reason == "DEADLINE_EXCEEDED" and "1.5 s" in err.failures[TRAINER].message
        assert took < 1.5 + 5.0, took  # the deadline, then the Cancel calls of the abandon
        assert 0 < slow.asked < buckets, (slow.asked, buckets)  # stopped mid-broadcast, not at the end
        status, sums = served(engine)
        assert status.weight_version == "before" and not status.dirty  # staged: published nowhere
        assert status.last_error.reason == "UPDATE_CANCELLED" and status.last_error.update_id == err.update_id
        assert sums == {n: sha256(t) for n, t in before.items() if n in sums}
        result = c.sync(after.items(), "after")  # the next sync, without a deadline, publishes
    assert result.weight_version == "after"
    status, sums = served(engine)
    assert status.weight_version == "after" and sums == {n: sha256(t) for n, t in after.items() if n in sums}


def test_a_second_clients_first_sync_succeeds_within_its_deadline(engine: EngineProcess) -> None:
    model = synthetic.build("tiny", seed=3)
    with TrainerClient([engine.target], **SMALL) as first:
        one = first.sync(model.items(), "first-client", timeout_s=60.0)
    with TrainerClient([engine.target], **SMALL) as second:
        two = second.sync(model.items(), "second-client", timeout_s=60.0)
    assert (one.weight_version, two.weight_version) == ("first-client", "second-client")
    assert two.total_seconds < 60.0
    assert served(engine)[0].weight_version == "second-client"


def test_cancel_ends_a_verify_that_an_engine_does_not_answer_at_once(engine: EngineProcess) -> None:
    """``cancel()`` from another thread while the verifying Complete waits on an engine that answers nothing
    (stopped right after its last bucket): the sync raises by the abandon's Cancel (its RPC timeout), not by the
    Complete's deadline (the group timeout plus the RPC timeout); the engine, continued, serves what it had."""
    before, after = synthetic.build("tiny", seed=4), synthetic.build("tiny", seed=5)
    rpc_s, group_s = 3.0, 60.0
    stopped, stopped_at = threading.Event(), [0.0]

    def stop_at_last_bucket(p: SyncProgress) -> None:
        if p.buckets_sent == p.bucket_count and not stopped.is_set():
            engine.process.send_signal(signal.SIGSTOP)
            stopped_at[0] = time.monotonic()
            stopped.set()

    # No digests: the verifying Complete is the first call after the last bucket (not the digests' declaration).
    options = {**SMALL, "rpc_timeout_s": rpc_s, "group_timeout_s": group_s, "digests": False}
    with TrainerClient([engine.target], **options) as c:  # type: ignore[arg-type]
        c.sync(before.items(), "before-stop")

        def cancel_once_stopped() -> None:
            if stopped.wait(120):
                time.sleep(1.0)  # the verifying Complete is waiting
                with contextlib.suppress(EngineCallError):  # the stopped engine does not answer Cancel either
                    c.cancel("the test cancels")

        canceller = threading.Thread(target=cancel_once_stopped, daemon=True)
        canceller.start()
        try:
            with pytest.raises(SyncError) as raised:
                c.sync(after.items(), "never", progress=stop_at_last_bucket)
            took = time.monotonic() - stopped_at[0]
        finally:
            engine.process.send_signal(signal.SIGCONT)
            canceller.join(30)
        err = raised.value
        assert err.stage == "verify" and err.failures[TRAINER].reason == "CANCELLED", err
        assert stopped.is_set() and took < 1.0 + 2 * rpc_s + 5.0 < group_s, took
    status, sums = served(engine)
    assert status.weight_version == "before-stop" and not status.dirty  # staged: published nowhere
    assert sums == {n: sha256(t) for n, t in before.items() if n in sums}


def test_the_signal_keeps_a_passed_deadline_through_a_clear_and_bounds_calls_by_the_time_left() -> None:
    signal = CancelSignal()
    assert signal.bound(30.0) == 30.0 and not signal.is_set()
    signal.start(0.2)
    assert 0.05 <= signal.bound(30.0) <= 0.2
    assert signal.wait(5.0)  # the deadline's timer sets it
    signal.clear()  # a new group or attempt clears a cancel, never the deadline
    assert signal.is_set() and signal.failure("broadcast").reason == "DEADLINE_EXCEEDED"
    signal.end()
    assert not signal.is_set() and signal.bound(30.0) == 30.0
    signal.set()
    assert signal.failure("broadcast").reason == "CANCELLED"
    with pytest.raises(ValueError, match="above 0"):
        signal.start(0.0)
