"""The trainer's string options, their one conversion into the core's enums, and its default timeouts.

:class:`~wsync_grpc.trainer.client.TrainerClient` takes layouts, apply modes,
pause modes and backends as strings (the :data:`Layout`, :data:`ApplyMode`,
:data:`PauseModeName` and :data:`BackendName` literals, vLLM's and SGLang's
spellings): they are the values of the core's enums
(:class:`wsync_grpc.core.layout.Layout`, :class:`~wsync_grpc.core.layout.ApplyMode`,
:class:`~wsync_grpc.core.engine.PauseMode`). The client converts each once, at
its public methods, with :func:`layout_of`, :func:`apply_mode_of` and
:func:`pause_mode_of`; inside the trainer only the enums travel, and
:mod:`wsync_grpc.wire.convert` maps those to the protocol's enums at the wire.
"""

from __future__ import annotations

from typing import Literal

from wsync_grpc.core import layout as core_layout
from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.timeouts import DEFAULT_GROUP_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S
from wsync_grpc.core.validation import MAX_ID_CHARS

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "SENT_TRANSPORTS",
    "ApplyMode",
    "BackendName",
    "Layout",
    "PauseModeName",
    "TransportName",
    "apply_mode_name",
    "apply_mode_of",
    "check_version",
    "layout_name",
    "layout_of",
    "pause_mode_of",
    "transport_of",
]

Layout = Literal["flattened", "individual"]
"""Bucket layout: one broadcast per bucket, or one per tensor (``wsync.v1.BucketLayout``)."""

ApplyMode = Literal["staged", "streaming"]
"""When the engines apply: all at Complete, or bucket by bucket (``wsync.v1.ApplyMode``)."""

PauseModeName = Literal["abort", "wait", "keep"]
"""What Pause does with requests in flight (vLLM's ``/pause?mode=``; ``wsync.v1.PauseMode``)."""

BackendName = Literal["gloo", "nccl", ""]
"""Collective backend; ``""`` lets each side choose by device (NCCL on CUDA, gloo on CPU)."""

TransportName = Literal["broadcast", "shared_memory", "cuda_ipc"]
"""How the bytes of an update the trainer sends travel (``wsync.v1.Transport``): over the weight-sync group,
through a shared-memory segment on the engines' host (colocated engines, tensors on CPU), or through a ring in
the trainer's GPU memory that engines on that GPU open by CUDA IPC (tensors on a GPU)."""

SENT_TRANSPORTS: tuple[str, ...] = ("broadcast", "shared_memory", "cuda_ipc")
"""The :data:`TransportName` values, in the order the docs list them."""


def transport_of(value: str) -> core_layout.Transport:
    """The core's :class:`~wsync_grpc.core.layout.Transport` of an update the trainer sends, named ``value``.

    Raises:
        ValueError: not one of :data:`SENT_TRANSPORTS` (a disk update is :meth:`TrainerClient.sync_from_disk
            <wsync_grpc.trainer.client.TrainerClient.sync_from_disk>`).
    """
    if value not in SENT_TRANSPORTS:
        raise ValueError(f"unknown transport {value!r}; use one of {', '.join(map(repr, SENT_TRANSPORTS))}")
    return core_layout.Transport(value)


def layout_of(value: str) -> core_layout.Layout:
    """The core's :class:`~wsync_grpc.core.layout.Layout` named ``value`` (``"flattened"`` or ``"individual"``).

    Raises:
        ValueError: an unknown layout.
    """
    try:
        return core_layout.Layout(value)
    except ValueError:
        raise ValueError(f"unknown layout {value!r}; use 'flattened' or 'individual'") from None


def apply_mode_of(value: str) -> core_layout.ApplyMode:
    """The core's :class:`~wsync_grpc.core.layout.ApplyMode` named ``value`` (``"staged"`` or ``"streaming"``).

    Raises:
        ValueError: an unknown apply mode.
    """
    try:
        return core_layout.ApplyMode(value)
    except ValueError:
        raise ValueError(f"unknown apply_mode {value!r}; use 'staged' or 'streaming'") from None


def pause_mode_of(value: str) -> PauseMode:
    """The core's :class:`~wsync_grpc.core.engine.PauseMode` named ``value`` (``"abort"``, ``"wait"``, ``"keep"``).

    Raises:
        ValueError: an unknown pause mode.
    """
    try:
        return PauseMode(value)
    except ValueError:
        raise ValueError(f"unknown pause mode {value!r}; use 'abort', 'wait' or 'keep'") from None


def layout_name(layout: core_layout.Layout) -> Layout:
    """``layout`` as the caller spelt it (the value a :class:`~wsync_grpc.trainer.results.SyncResult` reports)."""
    return layout.value


def apply_mode_name(mode: core_layout.ApplyMode) -> ApplyMode:
    """``mode`` as the caller spelt it (the value a :class:`~wsync_grpc.trainer.results.SyncResult` reports)."""
    return mode.value


def check_version(weight_version: str) -> None:
    """Refuse an update without a version before anything runs.

    Raises:
        ValueError: an empty ``weight_version``, or one longer than the engines accept
            (:data:`~wsync_grpc.core.validation.MAX_ID_CHARS` characters).
    """
    if not weight_version:
        raise ValueError("weight_version is required")
    if len(weight_version) > MAX_ID_CHARS:
        raise ValueError(f"weight_version has {len(weight_version)} characters; engines accept at most {MAX_ID_CHARS}")
