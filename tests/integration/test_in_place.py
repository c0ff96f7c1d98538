"""Lone tensors received straight into the served ones (streaming apply), batched Prepare messages.

A real gRPC server on a loopback port serving a :class:`TensorEngine`, and a
:class:`TrainerClient` as rank 0 of a real gloo group in this process.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from support import code_of, join_as_trainer, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import ApplyMode, TrainerClient


@pytest.mark.parametrize(
    ("apply", "solo_bytes", "digests", "path"),
    [
        ("streaming", 1, False, "in place"),
        ("streaming", 1, True, "copy"),  # a verified bucket is checked before a byte of it is served
        ("streaming", 0, True, "copy"),
        ("staged", 1, True, "swap"),
        ("staged", 0, True, "copy"),
    ],
)
def test_lone_tensors_are_received_in_place_or_swapped(
    apply: ApplyMode, solo_bytes: int, digests: bool, path: str
) -> None:
    """Streaming without digests: lone tensors land in the served memory. Staged: they land in buffers the engine
    then serves."""
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        objects = dict(engine.tensors)
        before = {n: (t.data_ptr(), t.clone()) for n, t in engine.tensors.items()}
        new = synthetic.build("tiny", seed=7)
        with TrainerClient([srv.address], solo_bytes=solo_bytes, bucket_bytes=1 << 20, digests=digests) as client:
            client.init()
            r = client.sync(new.items(), weight_version="v1", apply_mode=apply)
            assert r.engines[srv.address].tensor_count == len(new)
            assert r.engines[srv.address].buckets_verified == (r.bucket_count if digests else 0)
            if solo_bytes:
                assert r.bucket_count == len(new), "every tensor alone in its bucket"
            for n, t in new.items():
                assert torch.equal(engine.tensors[n], t), n
                assert engine.tensors[n] is objects[n], "the engine's tensor objects are kept"
            moved = {n for n, t in engine.tensors.items() if t.data_ptr() != before[n][0]}
            assert moved == (set(new) if path == "swap" else set()), moved
            # In place: no receive buffer was needed. A swap leaves the replaced memory in the pool.
            assert (srv.servicer.receive_buffer_bytes == 0) == (path == "in place")
            # Back to the old weights, same path; a swap serves the first memory again (ping-pong).
            client.sync(((n, old) for n, (_p, old) in before.items()), weight_version="v2", apply_mode=apply)
        for n, (_p, old) in before.items():
            assert torch.equal(engine.tensors[n], old), n
        if path == "swap":
            assert {t.data_ptr() for t in engine.tensors.values()} == {p for p, _old in before.values()}
        else:
            assert all(engine.tensors[n].data_ptr() == p for n, (p, _old) in before.items())
        st = status(stub)
        assert st.weight_version == "v2" and not st.paused and not st.dirty


OWNER = "in-place-test"
"""The owner name of this module's trainer, whose raw Prepare calls go through the client's own stub
(``TrainerClient.stubs``: its channel carries the client's lease credential; one owner per engine)."""


def _header(bucket_count: int, total: int) -> pb.PrepareRequest:
    return pb.PrepareRequest(
        header=pb.PrepareHeader(weight_version="v1", bucket_count=bucket_count, total_bytes=total, owner=OWNER)
    )


def _spec(engine_tensors: dict[str, torch.Tensor], name: str, index: int) -> pb.BucketSpec:
    t = engine_tensors[name]
    return pb.BucketSpec(
        index=index,
        size_bytes=t.numel() * t.element_size(),
        tensors=[pb.TensorSpec(name=name, dtype="bfloat16", shape=list(t.shape), offset_bytes=0)],
    )


def test_bucket_batches_are_validated_like_single_buckets() -> None:
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        names = list(engine.tensors)[:3]
        specs = [_spec(engine.tensors, n, i) for i, n in enumerate(names)]
        total = sum(s.size_bytes for s in specs)
        with TrainerClient([srv.address], owner=OWNER) as client:
            client.init()
            raw = client.stubs[srv.address]
            bad = [
                ([_header(3, total), pb.PrepareRequest(buckets=pb.BucketBatch())], "EMPTY_MESSAGE"),
                (
                    [_header(2, total), pb.PrepareRequest(buckets=pb.BucketBatch(buckets=specs))],
                    "BUCKET_COUNT_MISMATCH",
                ),
                ([pb.PrepareRequest(buckets=pb.BucketBatch(buckets=specs))], "MISSING_HEADER"),
                (
                    [
                        _header(3, total),
                        pb.PrepareRequest(buckets=pb.BucketBatch(buckets=[specs[1], specs[0], specs[2]])),
                    ],
                    "BUCKET",  # out of order: the index check names it
                ),
            ]
            for msgs, reason in bad:
                with pytest.raises(grpc.RpcError) as e:
                    raw.Prepare(iter(msgs), timeout=30)
                assert code_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT
                assert reason in (e.value.details() or "") or reason in str(e.value.trailing_metadata()), e.value
                assert status(stub).state == State.READY.value
            # A header, one bucket alone, then a batch of two: armed as three buckets.
            ok = [
                _header(3, total),
                pb.PrepareRequest(bucket=specs[0]),
                pb.PrepareRequest(buckets=pb.BucketBatch(buckets=specs[1:])),
            ]
            reply = raw.Prepare(iter(ok), timeout=30)
            assert reply.bucket_count == 3 and reply.total_bytes == total
            raw.Cancel(pb.CancelRequest(update_id=reply.update_id, owner=OWNER), timeout=30)


@pytest.mark.parametrize(("apply", "dirty"), [(pb.APPLY_MODE_STREAMING, True), (pb.APPLY_MODE_STAGED, False)])
def test_update_abandoned_with_a_receive_posted_in_place_marks_weights_dirty(
    apply: pb.ApplyMode.ValueType, dirty: bool
) -> None:
    """Bytes may have landed in the served tensor: the engine cannot vouch for it (staged: untouched)."""
    with tensor_server("tiny", seed=0) as (_srv, engine, stub):
        before = engine.tensors["model.norm.weight"].clone()
        trainer = join_as_trainer(stub)
        spec = pb.BucketSpec(index=0, size_bytes=128)  # one tensor, alone: received in place when streaming
        spec.tensors.add(name="model.norm.weight", dtype="bfloat16", shape=[64])
        header = pb.PrepareHeader(weight_version="never", bucket_count=1, total_bytes=128, apply_mode=apply)
        prep = stub.Prepare(iter([pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]), timeout=30)
        stub.Cancel(pb.CancelRequest(update_id=prep.update_id), timeout=30)
        st = status(stub)
        assert st.dirty == dirty and st.weight_version == ""
        assert torch.equal(engine.tensors["model.norm.weight"], before)  # nothing was sent
        trainer.destroy()
