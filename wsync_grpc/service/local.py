"""The receivers of an update whose workers are threads of the servicer's process (the reference engine's).

A broadcast update gets one :class:`~wsync_grpc.worker.receiver.WorkerReceiver`
per worker, on the worker's group membership; a disk update one
:class:`~wsync_grpc.worker.disk_receiver.DiskReceiver` per worker, which needs
no group. Both offer what the session reads (progress, ``staged``,
``apply_swaps``, ``release``); the engine's worker processes, when it has
them, run their own (:mod:`wsync_grpc.service.remote`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.worker.disk_receiver import DiskReceiver
from wsync_grpc.worker.feed import BucketFeed
from wsync_grpc.worker.receiver import WorkerReceiver

LocalReceiver = WorkerReceiver | DiskReceiver
"""A receiver running in this process."""


def local_receivers(
    engine: EngineState,
    header: UpdateHeader,
    feed: BucketFeed,
    files: Mapping[str, Path],
    cancel: threading.Event,
    on_event: Callable[[LocalReceiver], None],
) -> list[LocalReceiver]:
    """One receiver per worker for the update ``header`` describes (not started).

    Args:
        files: a disk update's tensor name -> file (:func:`~wsync_grpc.worker.checkpoint.plan_disk_update`).
    """
    if header.disk:
        return [
            DiskReceiver(
                worker=i,
                device=device,
                adapter=engine.adapter,
                feed=feed,
                files=files,
                apply_mode=header.apply_mode,
                cancel=cancel,
                on_event=on_event,
            )
            for i, device in enumerate(engine.membership.devices)
        ]
    return [
        WorkerReceiver(
            worker=i,
            group=g,
            adapter=engine.adapter,
            feed=feed,
            layout=header.layout,
            apply_mode=header.apply_mode,
            cancel=cancel,
            pool=engine.pools[i],
            on_event=on_event,
        )
        for i, g in enumerate(engine.membership.groups)
    ]
