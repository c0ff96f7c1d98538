"""The trainer's bucket plan of an update and its Prepare messages, reused while the tensors stay the same.

A trainer syncs the same parameters every step, and planning a large MoE
(tens of thousands of tensors) costs more than checking that each tensor
still has its name, dtype, shape, strides, address and device (the address
and strides decide which tensors are tied): :class:`Planner` keeps the last
plan and returns it again while none of that, nor a planning setting, changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.planning import plan_buckets
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.wire.convert import batch_bucket_specs, bucket_spec


class Planner:
    """Plans buckets (:func:`~wsync_grpc.core.planning.plan_buckets`) with the client's settings, caching the last plan.

    Args:
        settings: the client's settings (``alignment``, ``ramp_bytes`` and
            ``solo_bytes`` are read at every plan).
    """

    def __init__(self, settings: ClientSettings) -> None:
        self._settings = settings
        self._cache: tuple[tuple[object, ...] | None, list[Bucket], list[pb.PrepareRequest]] | None = None

    def plan(
        self,
        pairs: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        dtype: torch.dtype | None,
        layout: Layout,
    ) -> tuple[list[Bucket], list[pb.PrepareRequest]]:
        """Plan the buckets and their Prepare messages, reusing the last plan when nothing it depends on changed.

        Args:
            pairs: ``(name, tensor)`` pairs, in order.
            bucket_bytes: bucket capacity, in bytes.
            dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
            layout: the bucket layout (tensors of at least ``solo_bytes`` travel alone in the flattened one).

        Returns:
            The buckets, and the Prepare messages that describe them (after the header).

        Raises:
            ValueError: a planning error.
        """
        s = self._settings
        try:
            signature: tuple[object, ...] | None = (
                bucket_bytes,
                s.alignment,
                dtype,
                s.ramp_bytes,
                s.solo_bytes,
                layout,
                [(n, t.dtype, t.shape, t.stride(), t.data_ptr(), t.get_device()) for n, t in pairs],
            )
        except (RuntimeError, NotImplementedError):  # tensor subclasses without plain storage
            signature = None
        cached = self._cache
        if signature is not None and cached is not None and cached[0] == signature:
            return cached[1], cached[2]
        solo = s.solo_bytes if layout is Layout.FLATTENED else 0  # individual: every tensor is alone
        buckets = plan_buckets(pairs, bucket_bytes, s.alignment, dtype, ramp_bytes=s.ramp_bytes, solo_bytes=solo)
        messages = batch_bucket_specs([bucket_spec(b, layout) for b in buckets])
        self._cache = (signature, buckets, messages) if signature is not None else None
        return buckets, messages
