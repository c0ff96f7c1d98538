"""One update as the trainer runs it: :class:`UpdateRequest`, built once from the caller's arguments.

The client's public methods take the caller's strings (``layout="flattened"``,
``apply_mode="staged"``, a checkpoint path as ``str`` or ``os.PathLike``);
:class:`UpdateRequest`'s constructors convert them once
(:mod:`wsync_grpc.trainer.options`) into the core's enums and the path as
sent, and every part of the trainer reads the request from then on. Its
:meth:`UpdateRequest.header` is the update's domain header, which
:func:`wsync_grpc.wire.convert.header_to_proto` turns into the wire's
``PrepareHeader``.

Units: sizes in bytes.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.trainer.options import apply_mode_of, check_version, layout_of
from wsync_grpc.trainer.results import SyncProgress

log = logging.getLogger(__name__)

PHASES = ("planned", "prepared", "broadcast", "verified", "applied")
"""The phases ``TrainerClient.sync`` reports to ``on_phase`` as each ends (``"verified"``: staged only)."""


@dataclass(frozen=True)
class UpdateRequest:
    """One update, as the client was asked for it (options converted, bucket size and id resolved).

    Attributes:
        weight_version: the version the engines serve once it succeeded.
        layout: how buckets travel (a disk update: :attr:`Layout.INDIVIDUAL`, tensor by tensor).
        apply_mode: when the engines apply.
        bucket_bytes: bucket capacity, in bytes (0 for a disk update: the engines plan).
        dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
        flush_cache: whether the engines flush their prefix/KV cache.
        progress: called after every bucket, or ``None``.
        update_id: the update's id.
        on_phase: called with each phase's name as it ends (:data:`PHASES`), or ``None``.
        transport: how the bytes travel: broadcast over the group, or read by each engine from disk.
        checkpoint_path: a disk update's checkpoint, as the engines see it (the string sent);
            empty for a broadcast.
        adapter: the LoRA adapter the update loads; ``None`` for base weights.
    """

    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    bucket_bytes: int
    dtype: torch.dtype | None
    flush_cache: bool
    progress: Callable[[SyncProgress], None] | None
    update_id: str
    on_phase: Callable[[str], None] | None = None
    transport: Transport = Transport.BROADCAST
    checkpoint_path: str = ""
    adapter: LoraSpec | None = None

    @classmethod
    def broadcast(
        cls,
        weight_version: str,
        layout: str,
        apply_mode: str,
        bucket_bytes: int,
        *,
        dtype: torch.dtype | None = None,
        flush_cache: bool = False,
        progress: Callable[[SyncProgress], None] | None = None,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        adapter: LoraSpec | None = None,
    ) -> UpdateRequest:
        """A broadcast update (``TrainerClient.sync``, or a live adapter's tensors).

        Args:
            layout, apply_mode: the caller's strings (:data:`~wsync_grpc.trainer.options.Layout`,
                :data:`~wsync_grpc.trainer.options.ApplyMode`), converted here once.
            update_id: ``None`` = a fresh UUID (hex).
            others: as the attributes.

        Raises:
            ValueError: an empty ``weight_version``, an unknown ``layout`` or ``apply_mode``.
        """
        check_version(weight_version)
        return cls(
            weight_version=weight_version,
            layout=layout_of(layout),
            apply_mode=apply_mode_of(apply_mode),
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            flush_cache=flush_cache,
            progress=progress,
            update_id=update_id or uuid.uuid4().hex,
            on_phase=on_phase,
            adapter=adapter,
        )

    @classmethod
    def disk(
        cls,
        checkpoint_path: str | os.PathLike[str],
        weight_version: str,
        apply_mode: str,
        *,
        flush_cache: bool = False,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        adapter: LoraSpec | None = None,
    ) -> UpdateRequest:
        """A disk update: every engine reads ``checkpoint_path`` (``TrainerClient.sync_from_disk``).

        Args:
            checkpoint_path: the checkpoint as the engines see it; sent as ``os.fspath`` gives it.
            apply_mode: the caller's string, converted here once.
            update_id: ``None`` = a fresh UUID (hex).

        Raises:
            ValueError: an empty ``weight_version`` or path, an unknown ``apply_mode``.
        """
        check_version(weight_version)
        path = os.fspath(checkpoint_path)
        if not path:
            raise ValueError("checkpoint path is required")
        return cls(
            weight_version=weight_version,
            layout=Layout.INDIVIDUAL,
            apply_mode=apply_mode_of(apply_mode),
            bucket_bytes=0,
            dtype=None,
            flush_cache=flush_cache,
            progress=None,
            update_id=update_id or uuid.uuid4().hex,
            on_phase=on_phase,
            transport=Transport.DISK,
            checkpoint_path=path,
            adapter=adapter,
        )

    def header(self, bucket_count: int = 0, total_bytes: int = 0, digests_follow: bool = False) -> UpdateHeader:
        """The update's domain header (``wsync.v1.PrepareHeader`` once converted at the wire).

        Args:
            bucket_count: buckets the Prepare stream declares (0 for a disk update).
            total_bytes: bytes those buckets put on the wire, in bytes (0 for a disk update).
            digests_follow: the buckets' digests are declared with Updates as they are hashed.
        """
        return UpdateHeader(
            update_id=self.update_id,
            weight_version=self.weight_version,
            layout=self.layout,
            apply_mode=self.apply_mode,
            bucket_count=bucket_count,
            total_bytes=total_bytes,
            incremental=False,
            transport=self.transport,
            checkpoint_path=self.checkpoint_path,
            adapter=self.adapter,
            digests_follow=digests_follow,
        )

    def report(self, phase: str) -> None:
        """Tell ``on_phase`` that ``phase`` ended; an exception it raises is logged, not raised."""
        if self.on_phase is None:
            return
        try:
            self.on_phase(phase)
        except Exception:
            log.exception("the on_phase callback failed for phase %r", phase)
