"""The disk case of the benchmarks: a checkpoint read by the engine vs the same weights broadcast.

One engine process serving a synthetic model (:mod:`bench.engine`, its
checkpoint root under the harness's temporary directory) and the trainer's
copy of the model, saved once as ``model.safetensors`` with
:func:`wsync_grpc.transports.disk.writer.save_checkpoint`. Each repetition runs, back to
back on the same processes:

- the ceiling: one raw broadcast of the model's bytes;
- ``broadcast``: :meth:`~wsync_grpc.trainer.client.TrainerClient.sync`, staged;
- ``disk``: :meth:`~wsync_grpc.trainer.client.TrainerClient.sync_from_disk` of
  the saved checkpoint, staged (the file is in the page cache after the first
  read: what an engine on the trainer's host, or a warm shared cache, sees);
- ``save_and_sync``: :meth:`~wsync_grpc.trainer.client.TrainerClient.save_and_sync`,
  i.e. writing the checkpoint (written beside and renamed into place) and then
  the disk update, what a trainer that syncs through the disk pays per step.

The disk update's ratio to the broadcast is taken per repetition. After the
last run every engine must serve the trainer's bytes.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from wsync_grpc.transports.disk.writer import save_checkpoint

if TYPE_CHECKING:
    from bench.run import Harness, Session

WAYS = ("broadcast", "disk", "save_and_sync")


def _disk(s: Session, path: str, save: bool) -> dict[str, Any]:
    s.version += 1
    t0 = time.monotonic()
    if save:
        r = s.client.save_and_sync(s.model.tensors.items(), path, f"bench-disk-{s.version}")
    else:
        r = s.client.sync_from_disk(path, f"bench-disk-{s.version}")
    wall = time.monotonic() - t0
    return {
        "seconds": wall,
        "prepare": r.prepare_seconds,
        "complete": r.complete_seconds,
        "apply": max(e.apply_seconds for e in r.engines.values()),
    }


def case_disk(h: Harness, model_name: str, reps: int) -> dict[str, Any]:
    """One engine serving ``model_name``: ceiling, broadcast, disk and save-and-sync, interleaved ``reps`` times."""
    from bench.run import _say, session

    _say(f"disk: {model_name}")
    with session(h, model_name) as s:
        directory = h.checkpoints / f"disk-{model_name}"
        t0 = time.monotonic()
        save_checkpoint(s.model.tensors.items(), directory)
        save_s = time.monotonic() - t0
        path = str(directory)
        for _ in range(2):  # warm-up: receive buffers of both kinds, the file in the page cache
            s.wsync("staged")
            _disk(s, path, save=False)
        rounds = []
        for _ in range(reps):
            raw = s.raw()
            broadcast = s.wsync("staged")
            disk = _disk(s, path, save=False)
            saved = _disk(s, path, save=True)
            rounds.append({"raw": raw, "broadcast": broadcast, "disk": disk, "save_and_sync": saved})
            _say(
                f"  ceiling {raw:.3f} s, broadcast {broadcast['seconds']:.3f} s, disk {disk['seconds']:.3f} s, "
                f"save+disk {saved['seconds']:.3f} s"
            )
        verified = s.verify()
        return {
            "model": model_name,
            "bytes": s.model.nbytes,
            "tensors": len(s.model.tensors),
            "first_save_s": save_s,
            "rounds": rounds,
            "verified": verified,
        }


def disk_ratio(d: dict[str, Any]) -> float:
    """Median over the rounds of (disk update time / the same round's broadcast time)."""
    return statistics.median(r["disk"]["seconds"] / r["broadcast"]["seconds"] for r in d["rounds"])
