"""The :class:`~wsync_grpc.trainer.client.TrainerClient`'s updates from checkpoints: disk and LoRA adapters.

:meth:`CheckpointUpdates.sync_from_disk` has every engine read a safetensors
checkpoint (:mod:`wsync_grpc.trainer.disk`); :meth:`CheckpointUpdates.save_and_sync`
writes one first; :meth:`CheckpointUpdates.sync_adapter` loads or replaces a
LoRA adapter on every engine, from a PEFT directory they read or from a live
PEFT model whose tensors are broadcast like any bucket. All of them are one
committed update (staged: on every engine or on none).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from wsync_grpc.core.lora import LoraSpec
from wsync_grpc.trainer.adapters import adapter_tensors
from wsync_grpc.trainer.disk import DiskSyncRunner, checkpoint_path_of, save_checkpoint
from wsync_grpc.trainer.options import ApplyMode, check_request
from wsync_grpc.trainer.results import SyncResult
from wsync_grpc.trainer.settings import ClientSettings
from wsync_grpc.trainer.sync import SyncRunner, UpdateRequest


class CheckpointUpdates:
    """Disk and adapter updates of :class:`~wsync_grpc.trainer.client.TrainerClient` (one of its base classes)."""

    _settings: ClientSettings
    _sync: SyncRunner
    _disk: DiskSyncRunner

    _exclusive: Callable[[], AbstractContextManager[None]]
    """Holds the client's op lock for one update (TrainerClient's)."""

    def sync_from_disk(
        self,
        checkpoint_path: str | os.PathLike[str],
        weight_version: str,
        *,
        apply_mode: ApplyMode = "staged",
        flush_cache: bool = False,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> SyncResult:
        """Have every engine load the safetensors checkpoint at ``checkpoint_path`` as ``weight_version``.

        SGLang's ``update_weights_from_disk`` and vLLM's ``reload_weights``, as
        one committed update (:mod:`wsync_grpc.trainer.disk`): a header-only
        ``Prepare`` (``TRANSPORT_DISK``) everywhere, each engine validating
        every tensor from the files' headers before reading any; then, as for
        :meth:`sync`, ``Complete(verify_only)`` everywhere and the applying
        ``Complete`` only once every engine holds the whole checkpoint. No
        group is formed (no Init): each engine reads the files itself, inside
        the roots its operator allowed (``wsync serve --checkpoint-root``).

        Args:
            checkpoint_path: a directory (with ``model.safetensors.index.json``,
                or ``*.safetensors`` files) or one ``.safetensors`` file, as the
                engines see it; relative paths are taken under each engine's
                first checkpoint root.
            weight_version, apply_mode, flush_cache, update_id, on_phase: as for :meth:`sync`
                (``on_phase`` gets ``"prepared"``, ``"verified"``, ``"applied"``).

        Returns:
            A :class:`SyncResult` (``wire_bytes`` 0; ``payload_bytes`` the checkpoint's tensors, in bytes).

        Raises:
            ValueError: empty ``weight_version`` or path, or a bad ``apply_mode``.
            SyncError: some engine refused or failed (PERMISSION_DENIED for a path outside its
                roots, NOT_FOUND, INVALID_ARGUMENT for a pickle file or tensors that do not fit
                its model...); the update was cancelled everywhere.
            RuntimeError: another sync is running in this client.
        """
        return self._from_disk(checkpoint_path, weight_version, apply_mode, flush_cache, update_id, on_phase, None)

    def save_and_sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        directory: str | os.PathLike[str],
        weight_version: str,
        *,
        engine_path: str | None = None,
        **kwargs: Any,
    ) -> SyncResult:
        """Save ``named_tensors`` as ``directory/model.safetensors``, then :meth:`sync_from_disk` it.

        Args:
            named_tensors: as for :meth:`sync` (tied tensors are written once).
            directory: where to write, on a disk the engines see too.
            weight_version: as for :meth:`sync`.
            engine_path: the directory as the engines see it; ``None`` = ``directory``.
            kwargs: further arguments of :meth:`sync_from_disk`.

        Raises:
            as :func:`~wsync_grpc.trainer.disk.save_checkpoint` and :meth:`sync_from_disk`.
        """
        save_checkpoint(named_tensors, directory)
        return self.sync_from_disk(checkpoint_path_of(directory, engine_path), weight_version, **kwargs)

    def sync_adapter(
        self,
        adapter: Any,
        name: str,
        version: str,
        *,
        update_id: str | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> SyncResult:
        """Load (or replace) LoRA adapter ``name`` as ``version`` on every engine, as one committed update.

        Generation requests then name it (``GenerateRequest.adapter``); a
        replaced adapter never computes another token for anyone (requests
        running with it recompute their context with the new one). Each engine
        validates the adapter against its base model (target modules, shapes,
        rank) before anything changes; a bad one is refused with
        ``INVALID_ARGUMENT`` and the old one keeps serving.

        Args:
            adapter: a PEFT directory as the engines see it (``save_pretrained``'s output:
                ``adapter_config.json`` and ``adapter_model.safetensors``), read by each engine inside
                its checkpoint roots; or a live ``peft.PeftModel`` whose active LoRA adapter's
                tensors are broadcast (this forms the weight-sync group, as :meth:`sync` does).
            name: the adapter's name on the engines (letters, digits, ``.``, ``-``, ``_``).
            version: its version, reported with every answer it produces.
            update_id, on_phase: as for :meth:`sync`.

        Raises:
            ValueError: an empty version, or an object that is neither a path nor a PEFT LoRA model.
            SyncError: some engine refused or failed; the update was cancelled everywhere.
            RuntimeError: another sync is running in this client.
        """
        if isinstance(adapter, str | os.PathLike):  # its spec comes from the directory's adapter_config.json
            return self._from_disk(adapter, version, "staged", False, update_id, on_phase, LoraSpec(name, 0, 0.0))
        check_request(version, "flattened", "staged")
        spec, tensors = adapter_tensors(adapter, name)
        request = UpdateRequest(
            weight_version=version,
            layout="flattened",
            apply_mode="staged",
            bucket_bytes=self._settings.bucket_bytes,
            dtype=None,
            flush_cache=False,
            progress=None,
            update_id=update_id or uuid.uuid4().hex,
            on_phase=on_phase,
            adapter=spec,
        )
        with self._exclusive():
            return self._sync.run(tensors.items(), request)

    def _from_disk(
        self,
        path: str | os.PathLike[str],
        weight_version: str,
        apply_mode: ApplyMode,
        flush_cache: bool,
        update_id: str | None,
        on_phase: Callable[[str], None] | None,
        adapter: LoraSpec | None,
    ) -> SyncResult:
        """One disk update of base weights or, ``adapter`` set, of that adapter (see :meth:`sync_from_disk`)."""
        check_request(weight_version, "individual", apply_mode)
        request = UpdateRequest(
            weight_version=weight_version,
            layout="individual",
            apply_mode=apply_mode,
            bucket_bytes=0,
            dtype=None,
            flush_cache=flush_cache,
            progress=None,
            update_id=update_id or uuid.uuid4().hex,
            on_phase=on_phase,
            checkpoint_path=checkpoint_path_of(path, None),
            adapter=adapter,
        )
        with self._exclusive():
            return self._disk.run((), request)
