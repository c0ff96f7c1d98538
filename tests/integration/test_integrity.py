"""Bucket digests: every bucket checked by the engine before it is staged or applied; a byte flipped on the way
fails the update and nothing of it is published.

Real gRPC servers on loopback ports serving :class:`TensorEngine` s; a real :class:`TrainerClient` as rank 0
of a real gloo group in this process, or the raw-stub trainer process (``tests/stub_trainer.py``, which
hashes with ``xxhash`` itself, not with wsync's code).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch
import xxhash
from support import code_of, free_port, join_as_trainer, run_stub_trainer, status, tensor_server
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.lifecycle import State
from wsync_grpc.engines import synthetic
from wsync_grpc.trainer import ApplyMode, SyncError, TrainerClient
from wsync_grpc.trainer.planning import Planner
from wsync_grpc.trainer.sender import BroadcastSender, Sender
from wsync_grpc.trainer.source import NamedTensors
from wsync_grpc.transports.broadcast.sender import Corruption, PackBuffers
from wsync_grpc.wire.status import error_info

pytestmark = pytest.mark.timeout(180)

SMALL = {"bucket_bytes": 32 << 10, "ramp_bytes": 0, "solo_bytes": 64 << 10}
"""Client settings that cut the tiny model in several buckets: the embedding alone, the rest packed."""


def corrupting(bucket: int) -> Callable[[PackBuffers], Sender]:
    """A sender that flips one byte of ``bucket`` after hashing it (the test hook of the broadcast sender)."""
    return lambda buffers: BroadcastSender(buffers, corrupt=Corruption(bucket))


def checksums(stub: object) -> dict[str, str]:
    reply = stub.GetWeightChecksums(pb.GetWeightChecksumsRequest(), timeout=30)  # type: ignore[attr-defined]
    return {c.name: c.sha256 for c in reply.checksums}


def plan(client: TrainerClient, tensors: dict[str, torch.Tensor], layout: Layout) -> list[Bucket]:
    """The buckets ``client`` sends ``tensors`` in (its planner, its settings)."""
    buckets, _ = Planner(client).plan(NamedTensors(tensors.items()).metadata(), client.bucket_bytes, None, layout)
    return buckets


@pytest.mark.parametrize("layout", ["flattened", "individual"])
@pytest.mark.parametrize("apply", ["staged", "streaming"])
def test_every_bucket_is_verified_on_every_engine(layout: str, apply: ApplyMode) -> None:
    new = synthetic.build("tiny", seed=7)
    with (
        tensor_server("tiny", seed=0) as (a, ea, _),
        tensor_server("tiny", seed=1) as (b, eb, _),
        TrainerClient([a.address, b.address], **SMALL) as client,  # type: ignore[arg-type]
    ):
        r = client.sync(new.items(), "v1", layout=layout, apply_mode=apply)  # type: ignore[arg-type]
        assert r.bucket_count > 3
        assert {t: e.buckets_verified for t, e in r.engines.items()} == {
            a.address: r.bucket_count,
            b.address: r.bucket_count,
        }
        for n, t in new.items():
            assert torch.equal(ea.tensors[n], t) and torch.equal(eb.tensors[n], t), n
        client.digests = False  # a trainer that sends no digest: accepted, unverified
        r = client.sync(synthetic.build("tiny", seed=8).items(), "v2", layout=layout, apply_mode=apply)  # type: ignore[arg-type]
        assert [e.buckets_verified for e in r.engines.values()] == [0, 0]
        assert [e.weight_version for e in r.engines.values()] == ["v2", "v2"]


@pytest.mark.parametrize("layout", ["flattened", "individual"])
@pytest.mark.parametrize(("apply", "bad"), [("staged", 0), ("staged", 2), ("streaming", 2)])
def test_a_byte_flipped_in_transit_fails_the_update_and_nothing_of_it_is_served(
    layout: str, apply: ApplyMode, bad: int
) -> None:
    """Staged: old weights and version, clean. Streaming: the buckets before the bad one were applied (dirty,
    paused), the bad one's tensors are the old ones. Either way a clean sync afterwards restores everything."""
    new = synthetic.build("tiny", seed=7)
    with tensor_server("tiny", seed=0) as (srv, engine, stub):
        old = {n: t.clone() for n, t in engine.tensors.items()}
        sums = checksums(stub)
        with TrainerClient([srv.address], sender=corrupting(bad), **SMALL) as client:  # type: ignore[arg-type]
            buckets = plan(client, new, Layout(layout))
            assert len(buckets) > bad + 1
            with pytest.raises(SyncError) as e:
                client.sync(new.items(), "v1", layout=layout, apply_mode=apply)  # type: ignore[arg-type]
        failure = e.value.failures[srv.address]
        assert failure.reason == "BUCKET_DIGEST_MISMATCH", e.value
        assert f"bucket {bad} arrived corrupted" in failure.message, failure
        if failure.rpc == "Complete":
            assert failure.code == grpc.StatusCode.DATA_LOSS and failure.metadata["bucket"] == str(bad)
        assert e.value.stage in ("broadcast", "verify", "complete"), e.value
        st = status(stub)
        assert st.weight_version == "" and engine.weight_version == ""
        assert st.last_error.reason == "BUCKET_DIGEST_MISMATCH"
        in_bad = {t.name for t in buckets[bad].tensors}
        applied = {t.name for b in buckets[:bad] for t in b.tensors}
        for n, t in engine.tensors.items():
            expected = new[n] if apply == "streaming" and n in applied else old[n]
            assert torch.equal(t, expected), (n, n in in_bad)
        if apply == "staged":
            assert checksums(stub) == sums and not st.dirty and not st.paused
        else:
            assert st.dirty and st.paused  # a streaming update that failed half-way
        with TrainerClient([srv.address], **SMALL) as client:  # type: ignore[arg-type]
            r = client.sync(new.items(), "v2", layout=layout, apply_mode=apply)  # type: ignore[arg-type]
            assert r.engines[srv.address].buckets_verified == len(buckets)
        for n, t in new.items():
            assert torch.equal(engine.tensors[n], t), n
        st = status(stub)
        assert st.weight_version == "v2" and not st.dirty and not st.paused


@pytest.mark.parametrize(
    ("args", "verified", "reason", "code"),
    [
        (["--digests", "spec"], "all", "", ""),
        (["--digests", "follow", "--layout", "individual"], "all", "", ""),
        (["--digests", "none"], 0, "", ""),
        (["--digests", "spec", "--flip-bucket", "-1"], None, "BUCKET_DIGEST_MISMATCH", "DATA_LOSS"),
        (["--digests", "follow", "--flip-bucket", "-1", "--layout", "individual"], None, "BUCKET_DIGEST_MISMATCH",
         "DATA_LOSS"),
        (["--digests", "follow", "--skip-digest", "-1"], None, "DIGEST_MISSING", "INVALID_ARGUMENT"),
    ],
    ids=["spec", "follow", "none", "spec-flipped", "follow-flipped", "follow-missing"],
)  # fmt: skip
def test_a_raw_stub_trainers_digests_are_checked_before_verify_only_succeeds(
    args: list[str], verified: int | str | None, reason: str, code: str
) -> None:
    """The contract from another implementation: digests in the specs, or declared by Update after the bytes.

    A raw trainer has no held ``Watch``: the bad bucket is the last one, so that its every broadcast
    completes and its ``Complete(verify_only)`` gets the engine's answer.
    """
    with tensor_server("tiny", seed=0) as (srv, _engine, stub):
        sums = checksums(stub)
        out = run_stub_trainer(srv.address, free_port(), "--seed", "7", "--bucket-bytes", "16384", "--verify-only",
                               *args)  # fmt: skip
        st = status(stub)
        if reason:
            assert out["ok"] is False and out["reason"] == reason and out["code"] == code, out
            assert "buckets_verified" not in out, "verify_only must not succeed"
            if "--flip-bucket" in args:
                assert out["metadata"]["bucket"] == str(int(out["buckets"]) - 1), out  # type: ignore[call-overload]
            assert checksums(stub) == sums and st.weight_version == "" and st.state == State.FAILED.value
            return
        assert out["ok"] is True, out
        assert int(out["buckets"]) > 3  # type: ignore[call-overload]
        assert out["buckets_verified"] == (out["buckets"] if verified == "all" else verified)
        assert st.weight_version == out["weight_version"] == "v1"


def test_digests_declared_by_update_are_checked_for_what_they_name() -> None:
    """Update's digests: only for an update that promised them, only for declared buckets, one value each."""
    name, shape = "model.norm.weight", [64]
    with tensor_server("tiny", seed=0) as (_srv, _engine, stub):
        group = join_as_trainer(stub)
        try:

            def prepare(follow: bool) -> str:
                spec = pb.BucketSpec(
                    index=0, size_bytes=128, tensors=[pb.TensorSpec(name=name, dtype="bfloat16", shape=shape)]
                )
                header = pb.PrepareHeader(weight_version="x", bucket_count=1, total_bytes=128, digests_follow=follow)
                msgs = [pb.PrepareRequest(header=header), pb.PrepareRequest(bucket=spec)]
                return str(stub.Prepare(iter(msgs), timeout=30).update_id)

            def declare(uid: str, *digests: pb.DeclaredDigest) -> grpc.RpcError | None:
                try:
                    stub.Update(pb.UpdateRequest(update_id=uid, digests=digests), timeout=30)
                except grpc.RpcError as e:
                    return e
                return None

            def digest(value: bytes, algorithm: int = pb.DIGEST_ALGORITHM_XXH3_128) -> pb.BucketDigest:
                return pb.BucketDigest(algorithm=algorithm, value=value)

            uid = prepare(follow=False)
            err = declare(uid, pb.DeclaredDigest(bucket_index=0, digest=digest(bytes(16))))
            assert err is not None and code_of(err) == grpc.StatusCode.FAILED_PRECONDITION
            assert error_info(err)[0] == "DIGESTS_NOT_FOLLOWING"
            stub.Cancel(pb.CancelRequest(update_id=uid), timeout=30)
            group.destroy()
            group = join_as_trainer(stub)

            uid = prepare(follow=True)
            refused = {
                "UNKNOWN_BUCKET": pb.DeclaredDigest(bucket_index=1, digest=digest(bytes(16))),
                "INVALID_DIGEST": pb.DeclaredDigest(bucket_index=0, digest=digest(bytes(3))),
                "UNKNOWN_ENUM_VALUE": pb.DeclaredDigest(bucket_index=0, digest=digest(bytes(16), algorithm=99)),
            }
            for why, d in refused.items():
                err = declare(uid, d)
                assert err is not None and code_of(err) == grpc.StatusCode.INVALID_ARGUMENT, (why, err)
                assert error_info(err)[0] == why
            bucket = torch.randn(64).to(torch.bfloat16)
            good = digest(xxhash.xxh3_128_digest(bucket.view(torch.uint8).numpy().tobytes()))
            assert declare(uid, pb.DeclaredDigest(bucket_index=0, digest=good)) is None
            assert declare(uid, pb.DeclaredDigest(bucket_index=0, digest=good)) is None  # the same again: fine
            err = declare(uid, pb.DeclaredDigest(bucket_index=0, digest=digest(bytes(16))))
            assert err is not None and error_info(err)[0] == "DIGEST_CONFLICT"
            group.broadcast(bucket.view(torch.uint8)).wait()
            done = stub.Complete(pb.CompleteRequest(update_id=uid), timeout=60)
            assert done.weight_version == "x" and done.buckets_verified == 1
        finally:
            group.destroy()
