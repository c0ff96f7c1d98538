"""One update as the trainer runs it: an :class:`UpdateRequest` of one kind (:class:`BroadcastRequest`,
:class:`DiskRequest`), built once from the caller's arguments, with no field another kind needs.

The client's public methods take the caller's strings (``layout="flattened"``,
``apply_mode="staged"``, a checkpoint path as ``str`` or ``os.PathLike``);
each kind's ``create`` converts them once
(:mod:`wsync_grpc.trainer.options`) into the core's enums and the path as
sent, and every part of the trainer reads the request from then on. Its
:meth:`UpdateRequest.header` is the update's domain header, which
:func:`wsync_grpc.wire.convert.header_to_proto` turns into the wire's
``PrepareHeader``.

Units: sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import ApplyMode, Layout, Transport
from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.core.topology import SendTopology
from wsync_grpc.trainer.delta import DeltaPayload
from wsync_grpc.trainer.options import apply_mode_of, check_version, layout_of
from wsync_grpc.trainer.results import SyncProgress

log = logging.getLogger(__name__)

PHASES = ("planned", "prepared", "broadcast", "verified", "applied")
"""The phases ``TrainerClient.sync`` reports to ``on_phase`` as each ends (``"verified"``: staged only)."""


@dataclass(frozen=True, kw_only=True)
class UpdateRequest:
    """What every update has, whatever carries its bytes (a kind below: :class:`BroadcastRequest`,
    :class:`DiskRequest`); the caller's options converted once.

    Attributes:
        weight_version: the version the engines serve once it succeeded.
        apply_mode: when the engines apply.
        flush_cache: whether the engines flush their prefix/KV cache.
        update_id: the update's id (a fresh UUID, hex, unless the caller gave one).
        on_phase: called with each phase's name as it ends (:data:`PHASES`), or ``None``.
        transport: how the bytes travel (the kind's; a class attribute).
    """

    transport: ClassVar[Transport]
    weight_version: str
    apply_mode: ApplyMode
    flush_cache: bool = False
    update_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_phase: Callable[[str], None] | None = None

    @property
    def adapter_name(self) -> str:
        """The LoRA adapter the update loads; ``""`` for base weights (which change the fleet's version)."""
        raise NotImplementedError

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint the engines read, as they see it; ``None`` when the trainer sends the bytes."""
        return None

    def header(self, bucket_count: int = 0, total_bytes: int = 0, digests_follow: bool = False) -> UpdateHeader:
        """The update's domain header (``wsync.v1.PrepareHeader`` once converted at the wire).

        Args:
            bucket_count: buckets the Prepare stream declares (0 when the engines plan them).
            total_bytes: bytes those buckets put on the wire, in bytes (0 when the engines plan them).
            digests_follow: the buckets' digests are declared with Updates as they are hashed.
        """
        raise NotImplementedError

    def _header(
        self,
        layout: Layout,
        bucket_count: int,
        total_bytes: int,
        digests_follow: bool,
        checkpoint_path: str = "",
        adapter: LoraSpec | None = None,
    ) -> UpdateHeader:
        """The header of this kind's transport with the fields every update shares."""
        return UpdateHeader(
            update_id=self.update_id,
            weight_version=self.weight_version,
            layout=layout,
            apply_mode=self.apply_mode,
            bucket_count=bucket_count,
            total_bytes=total_bytes,
            incremental=False,
            transport=self.transport,
            checkpoint_path=checkpoint_path,
            adapter=adapter,
            digests_follow=digests_follow,
        )

    def header_for(self, header: UpdateHeader, target: str) -> UpdateHeader:
        """``header`` as engine ``target``'s Prepare sends it (the same for every engine, but a delta's)."""
        return header

    def report(self, phase: str) -> None:
        """Tell ``on_phase`` that ``phase`` ended; an exception it raises is logged, not raised."""
        if self.on_phase is None:
            return
        try:
            self.on_phase(phase)
        except Exception:
            log.exception("the on_phase callback failed for phase %r", phase)


@dataclass(frozen=True, kw_only=True)
class BroadcastRequest(UpdateRequest):
    """An update whose bytes the trainer sends over the weight-sync group (``TrainerClient.sync``, a live
    adapter's tensors, a catch-up).

    Attributes:
        layout: how buckets travel.
        bucket_bytes: bucket capacity, in bytes.
        dtype: the wire dtype of floating tensors; ``None`` keeps theirs.
        progress: called after every bucket, or ``None``.
        adapter: the live LoRA adapter whose tensors are sent (name and shape); ``None`` for base weights.
        topology: which trainer ranks send which bytes (default one process; a sharded trainer's
            ``gather`` or ``direct`` over its ranks); the trainer's alone, never on the wire.
        delta: the update's tensors in the wire dtype and, for a delta, its entries and base
            (:mod:`wsync_grpc.trainer.delta`); ``None``: the tensors as the source gives them, whole.
    """

    transport: ClassVar[Transport] = Transport.BROADCAST
    layout: Layout
    bucket_bytes: int
    dtype: torch.dtype | None = None
    progress: Callable[[SyncProgress], None] | None = None
    adapter: LoraSpec | None = None
    topology: SendTopology = field(default_factory=SendTopology)
    delta: DeltaPayload | None = None

    @classmethod
    def create(
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
        topology: SendTopology | None = None,
    ) -> BroadcastRequest:
        """A broadcast update from the caller's arguments.

        Args:
            layout, apply_mode: the caller's strings (:data:`~wsync_grpc.trainer.options.Layout`,
                :data:`~wsync_grpc.trainer.options.ApplyMode`), converted here once.
            update_id: ``None`` = a fresh UUID (hex).
            topology: ``None`` = one process.
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
            topology=topology or SendTopology(),
        )

    @property
    def adapter_name(self) -> str:
        """The live adapter's name; ``""`` for base weights."""
        return self.adapter.name if self.adapter is not None else ""

    def header(self, bucket_count: int = 0, total_bytes: int = 0, digests_follow: bool = False) -> UpdateHeader:
        """The header of a broadcast: the buckets the Prepare stream declares and their wire bytes (a delta's
        base version too; each engine's identity of it is :meth:`header_for`'s)."""
        h = self._header(self.layout, bucket_count, total_bytes, digests_follow, adapter=self.adapter)
        if self.delta is not None:  # deltas on: every update leaves the engines ready for the next delta
            h = dataclasses.replace(h, delta_base=True, base_weight_version=self.delta.base_version)
        return h

    def header_for(self, header: UpdateHeader, target: str) -> UpdateHeader:
        """``header`` as engine ``target``'s Prepare sends it: a delta names that engine's identity of its base."""
        if self.delta is None or not header.delta:
            return header
        return dataclasses.replace(header, base_weight_identity=self.delta.identities.get(target, ""))


@dataclass(frozen=True, kw_only=True)
class SharedMemoryRequest(BroadcastRequest):
    """An update whose bytes the trainer packs into a shared-memory segment on its engines' host
    (``TRANSPORT_SHARED_MEMORY``: :mod:`wsync_grpc.transports.shared_memory`); otherwise as
    :class:`BroadcastRequest` (the layout flattened)."""

    transport: ClassVar[Transport] = Transport.SHARED_MEMORY


@dataclass(frozen=True, kw_only=True)
class CudaIpcRequest(BroadcastRequest):
    """An update whose bytes the trainer packs into a ring in its GPU memory that the engines on that GPU open by
    CUDA IPC (``TRANSPORT_CUDA_IPC``: :mod:`wsync_grpc.transports.cuda_ipc`); otherwise as :class:`BroadcastRequest`
    (the layout flattened)."""

    transport: ClassVar[Transport] = Transport.CUDA_IPC


SENT_KINDS: Mapping[Transport, type[BroadcastRequest]] = {
    Transport.BROADCAST: BroadcastRequest,
    Transport.SHARED_MEMORY: SharedMemoryRequest,
    Transport.CUDA_IPC: CudaIpcRequest,
}
"""The request kind of each transport whose bytes the trainer sends."""


def sent_kind(transport: Transport) -> type[BroadcastRequest]:
    """The request kind (:data:`SENT_KINDS`) of an update whose bytes the trainer sends by ``transport``.

    Raises:
        ValueError: the trainer sends no bytes by ``transport`` (a disk update: :class:`DiskRequest`).
    """
    kind = SENT_KINDS.get(transport)
    if kind is None:
        raise ValueError(f"the trainer sends no bytes by transport {transport.value!r}")
    return kind


@dataclass(frozen=True, kw_only=True)
class DiskRequest(UpdateRequest):
    """An update every engine reads from a safetensors checkpoint itself (``TrainerClient.sync_from_disk``, a
    PEFT directory for ``TrainerClient.sync_adapter``, a catch-up from the fleet's checkpoint); the engines
    plan the buckets, no group is formed.

    Attributes:
        checkpoint_path: the checkpoint as the engines see it (the string sent).
        adapter: load the PEFT directory ``checkpoint_path`` as this LoRA adapter (its rank, alpha and target
            modules come from the directory's ``adapter_config.json``, read by each engine); ``""`` for base
            weights.
    """

    transport: ClassVar[Transport] = Transport.DISK
    checkpoint_path: str
    adapter: str = ""

    @classmethod
    def create(
        cls,
        checkpoint_path: str | os.PathLike[str],
        weight_version: str,
        apply_mode: str,
        *,
        flush_cache: bool = False,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
        adapter: str = "",
    ) -> DiskRequest:
        """A disk update from the caller's arguments.

        Args:
            checkpoint_path: the checkpoint as the engines see it; sent as ``os.fspath`` gives it.
            apply_mode: the caller's string, converted here once.
            update_id: ``None`` = a fresh UUID (hex).
            adapter: as the attribute.

        Raises:
            ValueError: an empty ``weight_version`` or path, an unknown ``apply_mode``.
        """
        check_version(weight_version)
        path = os.fspath(checkpoint_path)
        if not path:
            raise ValueError("checkpoint path is required")
        return cls(
            weight_version=weight_version,
            apply_mode=apply_mode_of(apply_mode),
            flush_cache=flush_cache,
            update_id=update_id or uuid.uuid4().hex,
            on_phase=on_phase,
            checkpoint_path=path,
            adapter=adapter,
        )

    @property
    def adapter_name(self) -> str:
        """The adapter the PEFT directory loads as; ``""`` for base weights."""
        return self.adapter

    @property
    def checkpoint(self) -> str:
        """:attr:`checkpoint_path`."""
        return self.checkpoint_path

    def header(self, bucket_count: int = 0, total_bytes: int = 0, digests_follow: bool = False) -> UpdateHeader:
        """The header of a disk update: no buckets declared (each engine plans its own), read tensor by tensor
        (``Layout.INDIVIDUAL``); an adapter by name only (the wire's ``LoraSpec`` with rank 0: the engine reads
        the rest from the directory)."""
        adapter = LoraSpec(self.adapter, 0, 0.0) if self.adapter else None
        return self._header(Layout.INDIVIDUAL, bucket_count, total_bytes, digests_follow, self.checkpoint_path, adapter)


def catch_up_request(
    weight_version: str,
    apply_mode: str,
    bucket_bytes: int,
    topology: SendTopology | None = None,
    transport: Transport = Transport.BROADCAST,
) -> BroadcastRequest:
    """The update of a catch-up (``TrainerClient.catch_up``): the fleet's current tensors to the members
    behind, flattened, in the client's bucket size, by ``transport`` (a broadcast over a group formed for them,
    or shared memory on their host: :data:`SENT_KINDS`); the one place it is built, so that a sharded trainer's
    other ranks plan the same buckets as rank 0.

    Raises:
        ValueError: an empty ``weight_version``, an unknown ``apply_mode``, a ``transport`` the trainer sends no
            bytes by (:func:`sent_kind`).
    """
    kind = sent_kind(transport)
    return kind.create(weight_version, "flattened", apply_mode, bucket_bytes, topology=topology)


def live_adapter_request(
    spec: LoraSpec,
    version: str,
    bucket_bytes: int,
    transport: Transport = Transport.BROADCAST,
    *,
    update_id: str | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> BroadcastRequest:
    """The update of a live LoRA adapter (``TrainerClient.sync_adapter`` with a PEFT model): its tensors,
    flattened, staged (an adapter always applies staged), ``bucket_bytes`` per bucket, by ``transport``
    (:data:`SENT_KINDS`: a broadcast over the weight-sync group, or shared memory on the engines' host).

    Raises:
        ValueError: an empty ``version``, a ``transport`` the trainer sends no bytes by (:func:`sent_kind`).
    """
    kind = sent_kind(transport)
    return kind.create(
        version, "flattened", "staged", bucket_bytes, update_id=update_id, on_phase=on_phase, adapter=spec
    )
