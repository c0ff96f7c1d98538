"""The trainer's string options and its default timeouts.

:class:`~wsync_grpc.trainer.client.TrainerClient` takes layouts, apply modes,
pause modes and backends as strings (the :data:`Layout`, :data:`ApplyMode`,
:data:`PauseModeName` and :data:`BackendName` literals): they are the values
of the core's enums (:class:`wsync_grpc.core.layout.Layout`,
:class:`~wsync_grpc.core.layout.ApplyMode`,
:class:`~wsync_grpc.core.adapter.PauseMode`), which
:mod:`wsync_grpc.wire.convert` maps to the protocol's enums, one map each.
"""

from __future__ import annotations

from typing import Literal

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
