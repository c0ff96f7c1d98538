"""Bucket digests: what is hashed on each side agrees, and digests cross to worker processes intact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from wsync_grpc.core.digests import BucketHasher, Digest, DigestAlgorithm, check_digest, digest_of
from wsync_grpc.core.errors import DataLoss
from wsync_grpc.core.layout import Layout
from wsync_grpc.core.messages import (
    bucket_from_msg,
    bucket_to_msg,
    digests_from_msg,
    digests_to_msg,
    error_from_msg,
    error_to_msg,
)
from wsync_grpc.core.packing import pack_bucket
from wsync_grpc.core.planning import plan_buckets
from wsync_grpc.trainer.settings import client_settings
from wsync_grpc.transports.broadcast.sender import Corruption, bucket_digest

TENSORS = {
    "a": torch.randn(37, 5),  # float32, sent as bfloat16 below: the digest is of the wire dtype
    "b": torch.randn(3, 7).t(),  # not contiguous
    "c": torch.arange(11, dtype=torch.int64),
    "s": torch.tensor(2.5),
}


def test_the_digest_is_xxh3_128_of_the_bytes_in_order_however_they_are_fed() -> None:
    t = torch.randn(1000)
    raw = t.numpy().tobytes()
    h = BucketHasher()
    h.update(t[:300])
    h.update(t[300:])
    assert h.digest() == Digest(DigestAlgorithm.XXH3_128, xxhash.xxh3_128_digest(raw)) == digest_of([t])
    padded = BucketHasher()
    padded.update(t)
    padded.zeros(100_000)  # more than one block of zeros
    assert padded.digest().value == xxhash.xxh3_128_digest(raw + bytes(100_000))
    assert digest_of([t.reshape(10, 100).t()]) == digest_of([t.reshape(10, 100).t().contiguous()])


@pytest.mark.parametrize("layout", [Layout.FLATTENED, Layout.INDIVIDUAL])
def test_a_bucket_hashed_without_packing_has_the_digest_of_its_bytes_on_the_wire(layout: Layout) -> None:
    """What the sender declares before sending (a sharded rank's own buckets) is what the engine receives."""
    (bucket,) = plan_buckets(TENSORS.items(), 1 << 20, alignment=256, dtype=torch.bfloat16)
    assert any(t.offset > 0 for t in bucket.tensors) and bucket.size_bytes > bucket.payload_bytes  # padding
    if layout is Layout.FLATTENED:
        stale = torch.full((bucket.size_bytes,), 0xAB, dtype=torch.uint8)  # a reused buffer: padding zeroed
        flat = pack_bucket(bucket, TENSORS, stale, zero_padding=True)
        sent = [flat]
    else:
        sent = [TENSORS[t.name].to(t.dtype).contiguous() for t in bucket.tensors]
    assert bucket_digest(bucket, TENSORS, layout) == digest_of(sent)
    flipped = Corruption(bucket.index, byte=3).corrupted(sent)
    assert digest_of(flipped) != digest_of(sent)
    assert all(x is not y for x, y in zip(flipped[:1], sent[:1], strict=True)), "a copy is corrupted, not the source"
    with pytest.raises(DataLoss) as e:
        check_digest(bucket.index, digest_of(sent), digest_of(flipped))
    assert e.value.reason == "BUCKET_DIGEST_MISMATCH" and e.value.metadata == {"bucket": str(bucket.index)}


def test_digests_and_their_errors_cross_to_worker_processes_intact() -> None:
    (bucket,) = plan_buckets(TENSORS.items(), 1 << 20, alignment=256)
    d = Digest(DigestAlgorithm.XXH3_128, bytes(range(16)))
    signed = dataclasses.replace(bucket, digest=d)
    assert bucket_from_msg(bucket_to_msg(signed)) == signed
    assert bucket_from_msg(bucket_to_msg(bucket)).digest is None
    assert digests_from_msg(digests_to_msg({4: d, 9: d})) == {4: d, 9: d}
    err = DataLoss("BUCKET_DIGEST_MISMATCH", "bucket 4 arrived corrupted", bucket="4")
    back = error_from_msg(error_to_msg(err))
    assert isinstance(back, DataLoss) and (back.reason, back.message, back.metadata) == (
        err.reason,
        err.message,
        err.metadata,
    )


@pytest.mark.parametrize(
    ("device", "asked", "sent"),
    [("cpu", None, True), ("cuda:0", None, False), ("cpu", False, False), ("cuda:0", True, True)],
)
def test_digests_default_to_on_for_cpu_buckets_and_off_for_cuda_ones(
    device: str, asked: bool | None, sent: bool
) -> None:
    """A CUDA bucket would be copied to the host to be hashed on both sides: off unless asked; CPU: on."""
    settings = client_settings(
        ["127.0.0.1:1"],
        master_address="127.0.0.1",
        master_port=None,
        group_name="",
        backend="",
        device=device,
        workers=None,
        rpc_timeout_s=1.0,
        group_timeout_s=1.0,
        bucket_bytes=1 << 20,
        alignment=256,
        ramp_bytes=0,
        solo_bytes=0,
        digests=asked,
    )
    assert settings.digests is sent
    assert settings.backend == ("gloo" if device == "cpu" else "nccl")
