"""Disk updates from the trainer: every engine reads one safetensors checkpoint, committed as a broadcast is.

The stateless ``update_weights_from_disk(base_url, checkpoint_path)`` that RL
frameworks write for SGLang and vLLM, with wsync's guarantees:
:class:`DiskSyncRunner` sends a header-only ``Prepare`` (``TRANSPORT_DISK``,
``checkpoint_path``) to every engine at once; each engine validates every
tensor of the checkpoint against its model from the files' headers and
starts reading; then the same commit as a broadcast's
(:class:`~wsync_grpc.trainer.protocol.UpdateProtocol`): for a staged update
``Complete(verify_only)`` everywhere, then the applying ``Complete`` only once
every engine holds the whole checkpoint, so that the fleet serves the new
version everywhere or nowhere. No group is needed: no Init, no rank, no byte
on the wire. A failure cancels the update everywhere and raises one
:class:`~wsync_grpc.trainer.results.SyncError`, as for a broadcast.

:func:`save_checkpoint` writes named tensors as one safetensors file,
atomically (a reader never sees half a file; one still reading the previous
file keeps reading it).

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from wsync_grpc.core.planning import unique_tensors
from wsync_grpc.trainer.options import apply_mode_name, layout_name
from wsync_grpc.trainer.protocol import UpdateProtocol
from wsync_grpc.trainer.request import UpdateRequest
from wsync_grpc.trainer.results import SyncResult

CHECKPOINT_FILE = "model.safetensors"
"""The file :func:`save_checkpoint` writes (a Hugging Face single-file checkpoint's name)."""


def save_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike[str]) -> Path:
    """Write ``named_tensors`` to ``directory/model.safetensors`` (created if needed); return the file.

    Tensors sharing memory (tied embeddings) are written once, under their
    first name, as :meth:`~wsync_grpc.trainer.client.TrainerClient.sync` sends
    them (:func:`~wsync_grpc.core.planning.unique_tensors`). Tensors are
    detached, made contiguous and moved to CPU. The file is written beside its
    final name and renamed into place, so an engine never reads half of it.

    Raises:
        ValueError: no tensors, or a name given twice.
        OSError: the directory cannot be written.
    """
    out = {meta.name: t.detach().to("cpu").contiguous() for meta, t in unique_tensors(named_tensors)}
    if not out:
        raise ValueError("nothing to save: no tensors given")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".wsync-", suffix=".safetensors.tmp", dir=d)
    os.close(fd)
    try:
        save_file(out, tmp)
        os.replace(tmp, d / CHECKPOINT_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return d / CHECKPOINT_FILE


class DiskSyncRunner:
    """Runs one disk update at a time over the client's engines (the caller holds the client's op lock).

    Args:
        calls: the update's calls over the engines and its failure protocol (shared with broadcasts).
    """

    def __init__(self, calls: UpdateProtocol) -> None:
        self._calls = calls

    def run(self, request: UpdateRequest) -> SyncResult:
        """Have every engine read ``request.checkpoint_path`` and commit it, as one trace.

        Raises:
            SyncError: some engine refused or failed; the update was cancelled everywhere.
            ClientError: the client was closed.
        """
        return self._calls.run(request, lambda: self._run(request))

    def _run(self, request: UpdateRequest) -> SyncResult:
        calls = self._calls
        calls.hold_engines()
        # A header-only Prepare: every engine replies once it validated the checkpoint (stage "prepare").
        prepared = calls.prepare(request, request.header())
        c = calls.transfer_and_commit(request, prepared, None)  # the engines read the bytes themselves
        first = next(iter(prepared.replies.values()))
        result = SyncResult(
            update_id=request.update_id,
            weight_version=request.weight_version,
            layout=layout_name(request.layout),
            apply_mode=apply_mode_name(request.apply_mode),
            bucket_count=first.bucket_count,
            tensor_count=first.tensor_count,
            payload_bytes=first.total_bytes,
            wire_bytes=0,
            init_seconds=0.0,
            plan_seconds=0.0,
            prepare_seconds=prepared.seconds,
            broadcast_seconds=0.0,
            pack_seconds=0.0,
            complete_seconds=c.done - c.started,
            verify_seconds=c.verify_s,
            total_seconds=c.done - prepared.started,
            engines=c.results,
        )
        return calls.applied(request, result)


__all__: Sequence[str] = ["CHECKPOINT_FILE", "DiskSyncRunner", "save_checkpoint"]
