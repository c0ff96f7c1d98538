"""Bucket digests: a hash of the bytes one bucket puts on the wire, computed by its sender, checked by every receiver.

What is hashed (``wsync.v1.BucketDigest``): in the flattened layout the bucket's
``size_bytes`` bytes as broadcast, padding included (the trainer zeroes it); in the
individual layout its tensors' bytes in the order of the bucket, each in its wire dtype
and C order, one after the other. Hashing in pieces gives the digest of their
concatenation, so a sender may hash a packed buffer or the tensors it would pack (and
the zeros between them) alike: :class:`BucketHasher` takes the pieces in order.

The one algorithm today is XXH3-128 (``xxhash``, seed 0; the value is the 16-byte
canonical form), fast enough to stay off the wire's critical path on CPU. It catches
bytes corrupted or lost on the way; it is not a proof against someone who can rewrite
both the bytes and the digest (the digest travels over the control plane, whose TLS
and token protect it). Tensors on another device are copied to the host to be hashed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import xxhash

from wsync_grpc.core.errors import DataLoss

_ZEROS = bytes(1 << 16)
"""Zero bytes fed for padding, at most this many at a time."""


class DigestAlgorithm(enum.Enum):
    """The hash of a bucket digest (``wsync.v1.DigestAlgorithm``)."""

    XXH3_128 = "xxh3_128"
    """xxHash's XXH3, 128-bit, seed 0; the value is the 16-byte canonical (big-endian) form."""


DIGEST_SIZES: dict[DigestAlgorithm, int] = {DigestAlgorithm.XXH3_128: 16}
"""Algorithm -> length of its value, in bytes."""


@dataclass(frozen=True)
class Digest:
    """One bucket's digest.

    Attributes:
        algorithm: the hash.
        value: its bytes (:data:`DIGEST_SIZES`).
    """

    algorithm: DigestAlgorithm
    value: bytes

    def __str__(self) -> str:
        return f"{self.algorithm.value}:{self.value.hex()}"


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of tensor ``t`` in C order, as a read-only view of host memory (a copy only when needed).

    A contiguous CPU tensor is viewed as it lies; another one is made contiguous (and
    copied to the host from another device) first.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.contiguous().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data.toreadonly()


class BucketHasher:
    """The digest of one bucket's bytes, fed in order (tensors, or zero padding between them).

    Args:
        algorithm: the hash.
    """

    def __init__(self, algorithm: DigestAlgorithm = DigestAlgorithm.XXH3_128) -> None:
        self.algorithm = algorithm
        self._h = xxhash.xxh3_128()
        self.size = 0
        """Bytes hashed so far."""

    def update(self, t: torch.Tensor) -> None:
        """Hash the bytes of tensor ``t`` next (see :func:`host_bytes`); the GIL is released for large ones."""
        data = host_bytes(t)
        self._h.update(data)
        self.size += data.nbytes

    def zeros(self, n: int) -> None:
        """Hash ``n`` zero bytes next (the padding of a flattened bucket)."""
        self.size += n
        while n > 0:
            k = min(n, len(_ZEROS))
            self._h.update(memoryview(_ZEROS)[:k])
            n -= k

    def digest(self) -> Digest:
        """The digest of everything hashed so far."""
        return Digest(self.algorithm, self._h.digest())


def digest_of(tensors: Iterable[torch.Tensor]) -> Digest:
    """The digest of ``tensors``' bytes, one after the other (a flat bucket: one tensor)."""
    h = BucketHasher()
    for t in tensors:
        h.update(t)
    return h.digest()


def check_digest(bucket: int, expected: Digest, received: Digest) -> None:
    """Raise unless the bytes received for bucket ``bucket`` hash to ``expected``.

    Raises:
        DataLoss: BUCKET_DIGEST_MISMATCH, naming the bucket (metadata ``bucket``).
    """
    if received != expected:
        raise DataLoss(
            "BUCKET_DIGEST_MISMATCH",
            f"bucket {bucket} arrived corrupted: its bytes hash to {received}, the trainer's digest is {expected}",
            bucket=str(bucket),
        )
