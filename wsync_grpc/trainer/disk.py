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

:func:`~wsync_grpc.transports.disk.writer.save_checkpoint` (the disk
transport's writing side) writes named tensors as one safetensors file,
atomically, for ``TrainerClient.save_and_sync``.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from wsync_grpc.trainer.options import apply_mode_name, layout_name
from wsync_grpc.trainer.protocol import UpdateProtocol
from wsync_grpc.trainer.request import UpdateRequest
from wsync_grpc.trainer.results import SyncResult


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


__all__: Sequence[str] = ["DiskSyncRunner"]
