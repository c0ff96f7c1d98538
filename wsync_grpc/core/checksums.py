"""Checksums of served tensors (``wsync.v1.GetWeightChecksums``), comparable across trainer and engines."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from wsync_grpc.core.lanes import lanes


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of ``t``'s bytes (C-contiguous, native byte order, its own dtype).

    The same digest as ``wsync.v1.TensorChecksum.sha256``: a trainer compares it with
    ``tensor_sha256(param)`` of its own tensor to check an engine serves exactly those bytes.
    ``t`` may have any shape and device (it is copied to CPU first, and made contiguous where it is not;
    a contiguous CPU tensor is hashed in place).
    """
    flat = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def tensor_sha256s(tensors: Iterable[torch.Tensor]) -> list[str]:
    """:func:`tensor_sha256` of each of ``tensors``, in order, hashed on this process's lanes
    (:mod:`wsync_grpc.core.lanes`): ``hashlib`` releases the GIL while it hashes a large buffer, so a model's
    tensors hash on as many cores as the lanes have. The caller keeps the tensors unchanged until it returns.
    """
    pool, width = lanes()
    if width <= 1:
        return [tensor_sha256(t) for t in tensors]
    return [f.result() for f in [pool.submit(tensor_sha256, t) for t in tensors]]
