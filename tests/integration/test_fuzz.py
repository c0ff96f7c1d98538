"""Fuzzing a live engine: random Prepare streams and random calls of every other RPC, in random orders.

Hypothesis builds whole Prepare streams (headers with any field and any enum number, buckets and
batches with random names, dtypes, shapes, offsets and sizes, empty messages, in any order) and
random calls of the other RPCs (random update ids, owners, durations and flags) against a real gRPC
server whose engine joined a real gloo group with this process as rank 0. Every answer must be OK
or a documented status code carrying a ``google.rpc.ErrorInfo`` reason, never UNKNOWN or INTERNAL.
After each example the engine is brought back to READY in a fresh group with only documented calls
and must serve exactly the bytes it started with; at the end its process' resident memory has not
grown beyond a bound, and a real sync goes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import code_of, free_port, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb
from wsync.v1 import weight_sync_pb2_grpc

from wsync_grpc.engines import synthetic
from wsync_grpc.engines.tensor import TensorEngine
from wsync_grpc.group.process_group import WeightSyncGroup, join_group
from wsync_grpc.trainer import TrainerClient
from wsync_grpc.wire.status import error_reason

pytestmark = pytest.mark.timeout(600)

Code = grpc.StatusCode
DOCUMENTED = {
    Code.INVALID_ARGUMENT,
    Code.FAILED_PRECONDITION,
    Code.ABORTED,
    Code.ALREADY_EXISTS,
    Code.DEADLINE_EXCEEDED,
    Code.UNAVAILABLE,
    Code.UNIMPLEMENTED,
    Code.CANCELLED,
    Code.RESOURCE_EXHAUSTED,
    Code.PERMISSION_DENIED,
    Code.NOT_FOUND,
}
"""The codes the contract documents; UNKNOWN and INTERNAL are never acceptable."""
WITH_REASON = {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.ABORTED, Code.ALREADY_EXISTS, Code.UNIMPLEMENTED}
"""The engine's own refusals: each must name its reason."""
NAMES = list(synthetic.build("tiny", seed=0))
OWNERS = ["", "fuzz-other"]
RSS_BOUND_BYTES = 256 << 20

u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
small = st.integers(min_value=0, max_value=4)
text = st.text(max_size=24)
tensor = st.builds(
    pb.TensorSpec,
    name=st.one_of(st.sampled_from(NAMES), text),
    dtype=st.one_of(st.sampled_from(["bfloat16", "float32", "int8", "bool"]), text),
    shape=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=3),
    offset_bytes=st.one_of(st.sampled_from([0, 128, 256]), u64),
)
bucket = st.builds(
    pb.BucketSpec,
    index=st.one_of(small, u32),
    size_bytes=st.one_of(st.sampled_from([128, 256, 128_000]), u64),
    tensors=st.lists(tensor, max_size=3),
)
header = st.builds(
    pb.PrepareHeader,
    update_id=st.one_of(st.just(""), text),
    weight_version=st.one_of(st.just("fuzz"), text),
    transport=st.integers(min_value=0, max_value=6),
    layout=st.integers(min_value=0, max_value=4),
    apply_mode=st.integers(min_value=0, max_value=4),
    bucket_count=st.one_of(small, u32),
    total_bytes=st.one_of(st.sampled_from([128, 256]), u64),
    incremental=st.booleans(),
    owner=st.sampled_from(OWNERS),
)
message = st.one_of(
    st.builds(lambda h: pb.PrepareRequest(header=h), header),
    st.builds(lambda b: pb.PrepareRequest(bucket=b), bucket),
    st.builds(lambda bs: pb.PrepareRequest(buckets=pb.BucketBatch(buckets=bs)), st.lists(bucket, max_size=3)),
    st.just(pb.PrepareRequest()),
)
streams = st.lists(message, max_size=6)


def _short(seconds: float) -> duration_pb2.Duration:
    """A ``timeout``/``interval`` field value of ``seconds`` (never 0, which means a long default)."""
    d = duration_pb2.Duration()
    d.FromMilliseconds(max(1, int(seconds * 1000)))
    return d


@dataclass
class Fuzzed:
    """One engine under fuzz: its stub, its tensors, and this process' side of its group."""

    target: str
    stub: weight_sync_pb2_grpc.WeightSyncServiceStub
    engine: TensorEngine
    group: WeightSyncGroup | None = None

    def join(self) -> None:
        """Init (the anonymous owner, forced) while this process joins as rank 0."""
        if self.group is not None:
            self.group.destroy()
        port = free_port()
        req = pb.InitRequest(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, force=True)
        req.timeout.FromSeconds(30)
        fut = self.stub.Init.future(req, timeout=40)
        self.group = join_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=30)
        fut.result()

    def restore(self) -> None:
        """Back to READY in a fresh group, with documented calls only (an operator's force)."""
        self.stub.Cancel(pb.CancelRequest(force=True, reason="fuzz: next example"), timeout=30)
        self.stub.Leave(pb.LeaveRequest(force=True), timeout=30)
        self.stub.Resume(pb.ResumeRequest(force=True), timeout=30)
        self.join()


def rpc_calls(stub: weight_sync_pb2_grpc.WeightSyncServiceStub) -> st.SearchStrategy[Callable[[], object]]:
    """Random calls of every RPC but Prepare, each bounded by a short deadline."""
    ids = st.one_of(st.just(""), text)
    owners = st.sampled_from(OWNERS)

    def watch(req: pb.WatchRequest) -> object:
        return next(iter(stub.Watch(req, timeout=2)), None)

    def keepalive(req: pb.KeepAliveRequest) -> object:
        call = stub.KeepAlive(req, timeout=2)
        first = next(iter(call), None)
        call.cancel()
        return first

    def init(owner: str, port: int, offset: int, world: int, backend: int, name: str) -> object:
        req = pb.InitRequest(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=offset,
            world_size=world,
            backend=backend,
            group_name=name,
            owner=owner,
            timeout=_short(0.2),
        )
        return stub.Init(req, timeout=15)

    return st.one_of(
        st.builds(
            lambda uid, tr, bs, ow: (
                lambda: stub.Update(pb.UpdateRequest(update_id=uid, transport=tr, buckets=bs, owner=ow), timeout=10)
            ),
            ids,
            st.integers(min_value=0, max_value=6),
            st.lists(bucket, max_size=2),
            owners,
        ),
        st.builds(
            lambda uid, v, f, ow, s: (
                lambda: stub.Complete(
                    pb.CompleteRequest(update_id=uid, verify_only=v, flush_cache=f, owner=ow, timeout=_short(s)),
                    timeout=10,
                )
            ),
            ids,
            st.booleans(),
            st.booleans(),
            owners,
            st.floats(min_value=0.001, max_value=0.3),
        ),
        st.builds(
            lambda uid, ow, r: lambda: stub.Cancel(pb.CancelRequest(update_id=uid, owner=ow, reason=r), timeout=10),
            ids,
            owners,
            text,
        ),
        st.builds(
            lambda uid, hold, ow: lambda: watch(pb.WatchRequest(update_id=uid, hold=hold, owner=ow)),
            ids,
            st.booleans(),
            owners,
        ),
        st.builds(lambda ow: lambda: keepalive(pb.KeepAliveRequest(owner=ow, interval=_short(0.05))), owners),
        st.builds(lambda ow: lambda: stub.Leave(pb.LeaveRequest(owner=ow), timeout=10), owners),
        st.builds(
            lambda m: lambda: stub.Pause(pb.PauseRequest(mode=m, timeout=_short(0.1)), timeout=10),
            st.integers(min_value=0, max_value=5),
        ),
        st.builds(lambda f: lambda: stub.Resume(pb.ResumeRequest(force=f), timeout=10), st.booleans()),
        st.just(lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10)),
        st.builds(
            lambda n, ow: lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name=n, owner=ow), timeout=10),
            text,
            owners,
        ),
        st.builds(
            lambda ns: lambda: stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(names=ns), timeout=10),
            st.lists(st.one_of(st.sampled_from(NAMES), text), max_size=2),
        ),
        st.builds(
            lambda ow, port, off, world, be, name: lambda: init(ow, port, off, world, be, name),
            owners,
            st.integers(min_value=0, max_value=70000),
            small,
            small,
            st.integers(min_value=0, max_value=4),
            text,
        ),
    )


def answer_is_documented(call: Callable[[], object]) -> None:
    """Run ``call``; a failure must carry a documented code (and the engine's refusals a reason)."""
    try:
        call()
    except grpc.RpcError as e:
        code = code_of(e)
        assert code in DOCUMENTED, f"undocumented status {code}: {e}"
        if code in WITH_REASON:
            assert error_reason(e), f"{code} without an ErrorInfo reason: {e}"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        f = Fuzzed(srv.address, stub, engine)
        f.join()
        try:
            yield f
        finally:
            if f.group is not None:
                f.group.destroy()


def test_fuzzed_prepare_streams_and_rpc_orders_get_documented_answers(fuzzed: Fuzzed) -> None:
    before = {n: t.clone() for n, t in fuzzed.engine.tensors.items()}
    rss_before = rss_bytes()
    examples = 0

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(stream=streams, calls=st.lists(rpc_calls(fuzzed.stub), max_size=5), data=st.data())
    def example(stream: list[pb.PrepareRequest], calls: list[Callable[[], object]], data: st.DataObject) -> None:
        nonlocal examples
        examples += 1
        order = data.draw(st.integers(min_value=0, max_value=len(calls)), label="Prepare after this many calls")
        for call in calls[:order]:
            answer_is_documented(call)
        answer_is_documented(lambda: fuzzed.stub.Prepare(iter(stream), timeout=30))
        for call in calls[order:]:
            answer_is_documented(call)
        st_ = status(fuzzed.stub)  # answers at once, whatever happened
        assert st_.state in pb.LifecycleState.values()
        fuzzed.restore()
        assert status(fuzzed.stub).state == pb.LIFECYCLE_STATE_READY
        for n, t in fuzzed.engine.tensors.items():
            assert torch.equal(t, before[n]), f"{n} changed although no byte was broadcast"

    example()
    grown = rss_bytes() - rss_before
    print(f"{examples} examples; resident memory grew by {grown / 2**20:.1f} MiB")
    assert grown < RSS_BOUND_BYTES, f"resident memory grew by {grown / 2**20:.0f} MiB"
    fuzzed.stub.Leave(pb.LeaveRequest(), timeout=30)  # the anonymous owner leaves: a trainer may take over
    if fuzzed.group is not None:
        fuzzed.group.destroy()
        fuzzed.group = None
    with TrainerClient([fuzzed.target], rpc_timeout_s=30) as client:
        new = synthetic.build("tiny", seed=5, dtype=torch.bfloat16)
        client.sync(new.items(), "after-fuzz")
        assert status(fuzzed.stub).weight_version == "after-fuzz"
        for n, t in new.items():
            assert torch.equal(fuzzed.engine.tensors[n], t)
