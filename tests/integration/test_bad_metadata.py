"""Bad metadata: INVALID_ARGUMENT (or UNIMPLEMENTED) naming what is wrong, nothing armed, engine unchanged.

Each case streams a Prepare to a live engine that has joined a real gloo
group; after the refusal the engine is still READY with no update in flight,
and a good update goes through.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import code_of, free_port, join_as_trainer, run_stub_trainer, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import State
from wsync_grpc.group.process_group import join_group
from wsync_grpc.wire.status import error_reason

pytestmark = pytest.mark.timeout(300)

NORM = "model.norm.weight"  # bf16 [64] in the tiny preset
EMB = "model.embed_tokens.weight"  # bf16 [1000, 64]


def t(name: str = NORM, dtype: str = "bfloat16", shape: list[int] | None = None, offset: int = 0) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=dtype, shape=[64] if shape is None else shape, offset_bytes=offset)


def b(index: int, size: int, *tensors: pb.TensorSpec) -> pb.PrepareRequest:
    return pb.PrepareRequest(bucket=pb.BucketSpec(index=index, size_bytes=size, tensors=list(tensors)))


def h(count: int = 1, total: int = 128, **kw: object) -> pb.PrepareRequest:
    return pb.PrepareRequest(header=pb.PrepareHeader(weight_version="bad", bucket_count=count, total_bytes=total, **kw))  # type: ignore[arg-type]


L1 = "model.layers.1.input_layernorm.weight"
CASES: dict[str, tuple[list[pb.PrepareRequest], grpc.StatusCode, str, str]] = {
    # name: (stream, code, reason, text the message must contain)
    "unknown tensor": (
        [h(), b(0, 128, t("model.nope.weight"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNKNOWN_TENSOR",
        "model.nope.weight",
    ),
    "wrong shape": (
        [h(), b(0, 128, t(shape=[65]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SHAPE_MISMATCH",
        NORM,
    ),
    "negative dim": (
        [h(), b(0, 128, t(shape=[-64]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SHAPE",
        NORM,
    ),
    "huge dims": (
        [h(), b(0, 128, t(shape=[2**62, 2**62]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SHAPE_MISMATCH",
        NORM,
    ),
    "unsupported dtype": (
        [h(), b(0, 128, t(dtype="complex64"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNSUPPORTED_DTYPE",
        NORM,
    ),
    "unknown dtype": (
        [h(), b(0, 128, t(dtype="bf17"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNSUPPORTED_DTYPE",
        "bf17",
    ),
    "int into float": (
        [h(count=1, total=64), b(0, 64, t(dtype="int8"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DTYPE_MISMATCH",
        NORM,
    ),
    "overlap": (
        [h(total=256), b(0, 256, t(), t(L1, offset=64))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "OVERLAPPING_TENSORS",
        L1,
    ),
    "overrun": (
        [h(total=128), b(0, 128, t(offset=64))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "OFFSET_OUT_OF_BOUNDS",
        NORM,
    ),
    "misaligned": (
        [h(total=130), b(0, 130, t(offset=1))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MISALIGNED_OFFSET",
        NORM,
    ),
    "bucket padded far beyond its tensors": (
        [h(total=10**6), b(0, 10**6, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "BUCKET_SIZE_MISMATCH",
        "bucket 0",
    ),
    "header total far beyond the model": (
        [h(total=10**15)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "TOO_MANY_BYTES",
        "total_bytes",
    ),
    "a million buckets": (
        [h(count=10**6)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "TOO_MANY_BUCKETS",
        "bucket_count",
    ),
    "fewer buckets than announced": (
        [h(count=2, total=256), b(0, 128, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "BUCKET_COUNT_MISMATCH",
        "2 buckets",
    ),
    "more buckets than announced": (
        [h(), b(0, 128, t()), b(1, 128, t(L1))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "BUCKET_COUNT_MISMATCH",
        "1",
    ),
    "total bytes disagree": (
        [h(total=999), b(0, 128, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "TOTAL_BYTES_MISMATCH",
        "999",
    ),
    "bucket out of order": (
        [h(count=2, total=256), b(1, 128, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "BUCKET_OUT_OF_ORDER",
        "index 1",
    ),
    "duplicate tensor": (
        [h(count=2, total=256), b(0, 128, t()), b(1, 128, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DUPLICATE_TENSOR",
        NORM,
    ),
    "empty bucket": ([h(total=0), b(0, 0)], grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_BUCKET", "bucket 0"),
    "header twice": ([h(), h()], grpc.StatusCode.INVALID_ARGUMENT, "DUPLICATE_HEADER", "second header"),
    "bucket before header": (
        [b(0, 128, t()), h()],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MISSING_HEADER",
        "before the header",
    ),
    "no header at all": ([], grpc.StatusCode.INVALID_ARGUMENT, "MISSING_HEADER", "without a header"),
    "no weight version": (
        [pb.PrepareRequest(header=pb.PrepareHeader(bucket_count=1, total_bytes=128))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MISSING_WEIGHT_VERSION",
        "weight_version",
    ),
    "a 3 MiB weight version": (
        [pb.PrepareRequest(header=pb.PrepareHeader(weight_version="v" * (3 << 20), bucket_count=1, total_bytes=128))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "VERSION_TOO_LONG",
        "at most 256",
    ),
    "odd unicode name": (
        [h(), b(0, 128, t("modèl.\u202e\U0001f600.weight\x00"))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNKNOWN_TENSOR",
        "modèl",
    ),
    "individual sizes disagree": (
        [h(total=100, layout=pb.BUCKET_LAYOUT_INDIVIDUAL), b(0, 100, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "BUCKET_SIZE_MISMATCH",
        "individual",
    ),
    "cuda ipc transport without a ring": (
        [h(transport=pb.TRANSPORT_CUDA_IPC)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "SHARED_MEMORY_HANDLE",
        "required for transport TRANSPORT_CUDA_IPC",
    ),
    "disk transport without a checkpoint path": (
        [pb.PrepareRequest(header=pb.PrepareHeader(weight_version="v", transport=pb.TRANSPORT_DISK))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "MISSING_CHECKPOINT_PATH",
        "checkpoint_path",
    ),
    "disk transport with bucket fields": (
        [h(transport=pb.TRANSPORT_DISK, checkpoint_path="x")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "DISK_HEADER_FIELDS",
        "bucket_count",
    ),
    "checkpoint path on a broadcast": (
        [h(checkpoint_path="/some/where"), b(0, 128, t())],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNEXPECTED_CHECKPOINT_PATH",
        "TRANSPORT_DISK only",
    ),
    "shared-memory handle on a broadcast": (
        [
            h(shared_memory=pb.SharedMemoryHandle(socket_name="x", token=b"t" * 32, slot_bytes=64, slots=2)),
            b(0, 128, t()),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNEXPECTED_SHARED_MEMORY",
        "TRANSPORT_SHARED_MEMORY and TRANSPORT_CUDA_IPC only",
    ),
    "undefined layout": ([h(layout=7)], grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_ENUM_VALUE", "layout"),
}


class Joined:
    """A live engine joined to a real gloo group whose rank 0 is this test process."""

    def __init__(self, stub: object, engine: object) -> None:
        self.stub = stub
        self.engine = engine
        self.trainer: object | None = None
        self.join()

    def join(self) -> None:
        if self.trainer is not None:
            self.trainer.destroy()  # type: ignore[attr-defined]
        port = free_port()
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
        fut = self.stub.Init.future(req, timeout=60)  # type: ignore[attr-defined]
        self.trainer = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=60)
        fut.result()

    def __iter__(self) -> Iterator[object]:
        return iter((self.stub, self.engine))


@pytest.fixture(scope="module")
def joined_engine() -> Iterator[Joined]:
    with tensor_server("tiny", seed=0) as (_, engine, stub):
        joined = Joined(stub, engine)
        yield joined
        joined.trainer.destroy()  # type: ignore[union-attr]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_metadata_is_refused_and_nothing_is_armed(case: str, joined_engine: Joined) -> None:
    stub, engine = joined_engine
    stream, code, reason, text = CASES[case]
    before = {n: x.clone() for n, x in engine.tensors.items()}  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as e:
        stub.Prepare(iter(stream), timeout=30)  # type: ignore[attr-defined]
    assert code_of(e.value) == code, e.value
    assert error_reason(e.value) == reason, e.value
    assert text in e.value.details(), e.value.details()  # type: ignore[attr-defined]
    st = status(stub)  # type: ignore[arg-type]
    assert st.state == State.READY.value and not st.HasField("update")
    assert all(x.equal(before[n]) for n, x in engine.tensors.items())  # type: ignore[attr-defined]


def test_client_disconnect_mid_stream_arms_nothing(joined_engine: Joined) -> None:
    stub, _ = joined_engine
    import threading

    gate = threading.Event()

    def stream() -> Iterator[pb.PrepareRequest]:
        yield h(count=2, total=256)
        yield b(0, 128, t())
        gate.wait(30)

    fut = stub.Prepare.future(stream(), timeout=60)  # type: ignore[attr-defined]
    import time

    deadline = time.monotonic() + 10
    while status(stub).state != State.PREPARING.value:  # type: ignore[arg-type]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    fut.cancel()  # the trainer goes away mid-stream
    gate.set()
    deadline = time.monotonic() + 10
    while status(stub).state != State.READY.value:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, status(stub)  # type: ignore[arg-type]
        time.sleep(0.01)
    assert not status(stub).HasField("update")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.one_of(st.sampled_from([NORM, EMB, L1, "lm_head.weight"]), st.text(max_size=40)),
    dtype=st.one_of(st.sampled_from(["bfloat16", "float32", "int64", "bool"]), st.text(max_size=12)),
    shape=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4),
    offset=st.integers(min_value=0, max_value=2**64 - 1),
    size=st.integers(min_value=0, max_value=2**64 - 1),
    total=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_fuzzed_metadata_never_crashes_or_arms(
    joined_engine: Joined, name: str, dtype: str, shape: list[int], offset: int, size: int, total: int
) -> None:
    stub, _ = joined_engine
    stream = [
        h(total=total),
        b(0, size, pb.TensorSpec(name=name, dtype=dtype, shape=shape, offset_bytes=offset)),
    ]
    try:
        resp = stub.Prepare(iter(stream), timeout=30)  # type: ignore[attr-defined]
    except grpc.RpcError as e:
        assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT, e
        assert error_reason(e), e
        assert status(stub).state == State.READY.value  # type: ignore[arg-type]
        return
    # Valid by chance: it was armed. Cancel it (the group is left) and re-join for the next example.
    assert resp.bucket_count == 1
    assert stub.Cancel(pb.CancelRequest(), timeout=10).cancelled  # type: ignore[attr-defined]
    joined_engine.join()


def test_good_update_after_refusals() -> None:
    with tensor_server("tiny", seed=0) as (srv, _, stub):
        with pytest.raises(grpc.RpcError):
            stub.Prepare(iter([h(), b(0, 128, t("nope"))]), timeout=10)  # not joined: FAILED_PRECONDITION
        out = run_stub_trainer(srv.address, free_port(), "--seed", "3", "--version", "good")
        assert out["ok"] is True and status(stub).weight_version == "good"


def test_log_lines_stay_bounded_whatever_a_caller_sends(caplog: pytest.LogCaptureFixture) -> None:
    """Caller strings of 100 KB (a dtype, a weight version, an update id, a cancel reason) leave log lines of at
    most a few KB (versions and update ids beyond 256 characters are refused)."""
    huge = "x" * 100_000
    caplog.set_level("DEBUG", logger="wsync_grpc")
    with tensor_server("tiny", seed=0) as (_, _engine, stub):
        trainer = join_as_trainer(stub)
        try:
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(iter([h(), b(0, 128, t(dtype=huge))]), timeout=30)
            assert error_reason(e.value) == "UNSUPPORTED_DTYPE"
            header = pb.PrepareHeader(update_id=huge, weight_version=huge, bucket_count=1, total_bytes=128)
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(iter([pb.PrepareRequest(header=header), b(0, 128, t())]), timeout=30)
            assert error_reason(e.value) == "VERSION_TOO_LONG"
            longest_id = "u" * 256  # the longest accepted
            header = pb.PrepareHeader(update_id=longest_id, weight_version=longest_id, bucket_count=1, total_bytes=128)
            stub.Prepare(iter([pb.PrepareRequest(header=header), b(0, 128, t())]), timeout=30)
            assert stub.Cancel(pb.CancelRequest(update_id=longest_id, reason=huge), timeout=10).cancelled
        finally:
            trainer.destroy()
    ours = [r for r in caplog.records if r.name.startswith("wsync_grpc")]
    assert any("UNSUPPORTED_DTYPE" in r.getMessage() for r in ours), "the refusal is logged"
    assert any("failed" in r.getMessage() for r in ours), "the cancelled update is logged"
    longest = max(len(r.getMessage()) for r in ours)
    assert longest < 4096, f"a log line of {longest} characters"
