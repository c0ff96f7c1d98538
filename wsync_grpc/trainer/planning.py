"""The trainer's bucket plan of an update and its Prepare messages, reused while the tensors stay the same.

A trainer syncs the same parameters every step, and planning a large MoE
(tens of thousands of tensors) and building its Prepare messages costs more
than comparing each tensor's metadata (name, dtype, global shape: a
:class:`~wsync_grpc.core.planning.TensorMeta` from the update's
:class:`~wsync_grpc.trainer.source.WeightSource`) with the last update's:
:class:`Planner` keeps the last plan and returns it again while neither the
metadata nor a planning setting changed. The plan depends on nothing else,
so no tensor's bytes or storage are read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, cast

import torch
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.delta import DeltaCoding
from wsync_grpc.core.digests import Digest
from wsync_grpc.core.layout import Bucket, Layout
from wsync_grpc.core.planning import PieceMeta, TensorMeta, plan_metadata, plan_pieces
from wsync_grpc.core.topology import ONE_PROCESS, SendTopology
from wsync_grpc.wire.convert import batch_bucket_specs, bucket_spec, digest_to_proto


class PlanSettings(Protocol):
    """The settings a plan depends on besides the update's own (a ``ClientSettings``, or a ``TrainerClient``)."""

    @property
    def alignment(self) -> int:
        """Byte alignment of tensors inside flat buckets."""
        ...

    @property
    def ramp_bytes(self) -> int:
        """Size of the first and last buckets, in bytes."""
        ...

    @property
    def solo_bytes(self) -> int:
        """Flattened layout: tensors of at least this many bytes travel alone, in bytes."""
        ...


class Planner:
    """Plans buckets (:func:`~wsync_grpc.core.planning.plan_metadata`) with the client's settings; caches the last.

    Args:
        settings: the client's settings (``alignment``, ``ramp_bytes`` and
            ``solo_bytes`` are read at every plan): its ``ClientSettings``, or the
            ``TrainerClient`` itself (a sharded trainer's other ranks plan as rank 0 does).
    """

    def __init__(self, settings: PlanSettings) -> None:
        self._settings = settings
        self._cache: tuple[tuple[object, ...], list[Bucket], list[pb.PrepareRequest]] | None = None

    def plan(
        self,
        metas: Sequence[TensorMeta] | Sequence[PieceMeta],
        bucket_bytes: int,
        dtype: torch.dtype | None,
        layout: Layout,
        topology: SendTopology = ONE_PROCESS,
        deltas: Mapping[int, Mapping[str, DeltaCoding]] | None = None,
    ) -> tuple[list[Bucket], list[pb.PrepareRequest]]:
        """Plan the buckets and their Prepare messages, reusing the last plan when nothing it depends on changed.

        Args:
            metas: the tensors to send, in order, each once (global shapes); or, where ``topology`` plans
                by pieces (a sharded trainer's direct send), every trainer rank's pieces of them
                (:class:`~wsync_grpc.core.planning.PieceMeta`: :func:`~wsync_grpc.core.planning.plan_pieces`).
            bucket_bytes: bucket capacity, in bytes.
            dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
            layout: the bucket layout (tensors of at least ``solo_bytes`` travel alone in the flattened one).
            topology: which trainer ranks send (default one process).
            deltas: a delta update's entries, by the trainer rank that sends them (0 for one process), then by
                tensor name (planned at their size, never cached; see :func:`~wsync_grpc.core.planning.plan_metadata`
                and :func:`~wsync_grpc.core.planning.plan_pieces`); ``None``: every tensor whole.

        Returns:
            The buckets, and the Prepare messages that describe them (after the header).

        Raises:
            ValueError: a planning error.
        """
        s = self._settings
        signature = (bucket_bytes, s.alignment, dtype, s.ramp_bytes, s.solo_bytes, layout, topology, list(metas))
        cached = self._cache
        if cached is not None and cached[0] == signature and not deltas:  # a delta's sizes change every time
            return cached[1], cached[2]
        solo = s.solo_bytes if layout is Layout.FLATTENED else 0  # individual: every tensor is alone
        if topology.by_pieces:
            pieces = cast(Sequence[PieceMeta], metas)
            limits = {"ramp_bytes": s.ramp_bytes, "solo_bytes": solo}
            buckets = plan_pieces(pieces, bucket_bytes, s.alignment, dtype, **limits, deltas=deltas)
        else:
            whole = cast(Sequence[TensorMeta], metas)
            limits = {"ramp_bytes": s.ramp_bytes, "solo_bytes": solo}
            buckets = plan_metadata(
                whole,
                bucket_bytes,
                s.alignment,
                dtype,
                **limits,
                deltas=(deltas or {}).get(0),  # one process: rank 0
            )
        messages = batch_bucket_specs([bucket_spec(b, layout) for b in buckets])
        if not deltas:
            self._cache = (signature, buckets, messages)
        return buckets, messages


def set_spec_digests(messages: Sequence[pb.PrepareRequest], digests: Mapping[int, Digest]) -> None:
    """Write each bucket's digest into the Prepare messages (``BucketSpec.digest``), in place; clear the others.

    The messages are the plan's, kept by :class:`Planner` from one sync to the next: every sync sets
    (or clears) the digests of all of its buckets, whether it declares them here or not at all.
    """
    for m in messages:
        specs = [m.bucket] if m.HasField("bucket") else list(m.buckets.buckets)
        for spec in specs:
            d = digests.get(spec.index)
            if d is None:
                spec.ClearField("digest")
            else:
                spec.digest.CopyFrom(digest_to_proto(d))
