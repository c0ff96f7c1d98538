"""Checksums of tensors (``wsync.v1.TensorChecksum.sha256``): one tensor's, and many hashed on the lanes."""

from __future__ import annotations

import hashlib

import torch

from wsync_grpc.core.checksums import tensor_sha256, tensor_sha256s


def test_a_checksum_is_the_sha256_of_the_c_ordered_bytes_and_many_are_hashed_in_order() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 257, generator=g)
    tensors = [
        base,
        base.t(),  # not contiguous: its C-ordered copy is hashed
        base[:, 1:],
        base.to(torch.bfloat16),
        torch.arange(10, dtype=torch.int64),
        torch.empty(0),
        torch.randn(3_000_000, generator=g),  # large enough to hash without the GIL
    ]
    expected = [
        hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for t in tensors
    ]
    assert [tensor_sha256(t) for t in tensors] == expected
    assert tensor_sha256s(tensors) == expected
    assert tensor_sha256s(t for t in tensors) == expected  # any iterable, read once
    assert tensor_sha256s([]) == []
    assert tensor_sha256(base) != tensor_sha256(base.t())
