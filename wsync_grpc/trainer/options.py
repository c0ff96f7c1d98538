"""The trainer's string options, their check, and its default timeouts.

:class:`~wsync_grpc.trainer.client.TrainerClient` takes layouts, apply modes,
pause modes and backends as strings (the :data:`Layout`, :data:`ApplyMode`,
:data:`PauseModeName` and :data:`BackendName` literals): they are the values
of the core's enums (:class:`wsync_grpc.core.layout.Layout`,
:class:`~wsync_grpc.core.layout.ApplyMode`,
:class:`~wsync_grpc.core.engine.PauseMode`), which
:mod:`wsync_grpc.wire.convert` maps to the protocol's enums, one map each.
"""

from __future__ import annotations

from typing import Literal

from wsync_grpc.core import layout as core_layout
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S

__all__ = ["DEFAULT_GROUP_TIMEOUT_S", "DEFAULT_RPC_TIMEOUT_S", "ApplyMode", "BackendName", "Layout", "PauseModeName"]

Layout = Literal["flattened", "individual"]
"""Bucket layout: one broadcast per bucket, or one per tensor (``wsync.v1.BucketLayout``)."""

ApplyMode = Literal["staged", "streaming"]
"""When the engines apply: all at Complete, or bucket by bucket (``wsync.v1.ApplyMode``)."""

PauseModeName = Literal["abort", "wait", "keep"]
"""What Pause does with requests in flight (vLLM's ``/pause?mode=``; ``wsync.v1.PauseMode``)."""

BackendName = Literal["gloo", "nccl", ""]
"""Collective backend; ``""`` lets each side choose by device (NCCL on CUDA, gloo on CPU)."""


def check_request(weight_version: str, layout: str, apply_mode: str) -> None:
    """Reject a sync's arguments before anything runs.

    Raises:
        ValueError: empty ``weight_version``, unknown ``layout`` or ``apply_mode``.
    """
    if not weight_version:
        raise ValueError("weight_version is required")
    if layout not in {m.value for m in core_layout.Layout}:
        raise ValueError(f"unknown layout {layout!r}; use 'flattened' or 'individual'")
    if apply_mode not in {m.value for m in core_layout.ApplyMode}:
        raise ValueError(f"unknown apply_mode {apply_mode!r}; use 'staged' or 'streaming'")
