"""Checksums of served tensors (``wsync.v1.GetWeightChecksums``), comparable across trainer and engines."""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of ``t``'s bytes (C-contiguous, native byte order, its own dtype).

    The same digest as ``wsync.v1.TensorChecksum.sha256``: a trainer compares it with
    ``tensor_sha256(param)`` of its own tensor to check an engine serves exactly those bytes.
    ``t`` may have any shape and device (it is copied to CPU first).
    """
    flat = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
