"""The receivers of an update whose workers are threads of the servicer's process (the reference engine's).

A broadcast update gets one :class:`~wsync_grpc.transports.broadcast.receiver.WorkerReceiver`
per worker, on the worker's group membership; a disk update one
:class:`~wsync_grpc.transports.disk.receiver.DiskReceiver` per worker, which needs
no group. Both offer what the session reads (progress, ``staged``,
``apply_swaps``, ``release``); the engine's worker processes, when it has
them, run their own (:mod:`wsync_grpc.service.remote`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from wsync_grpc.core.engine import Engine
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.lora import LoraAdapters
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.transports.broadcast.receiver import WorkerReceiver
from wsync_grpc.transports.disk.receiver import DiskReceiver
from wsync_grpc.worker.feed import BucketFeed

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
        files: a disk update's tensor name -> file (:func:`~wsync_grpc.transports.disk.checkpoint.plan_disk_update`).
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
            for i, device in enumerate(engine.membership.devices[: 1 if header.adapter else None])
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


def apply_local(adapter: Engine, header: UpdateHeader, receivers: Sequence[LocalReceiver]) -> None:
    """Apply what ``receivers`` staged: base weights, or the adapter ``header`` names. Weights lock held.

    Base weights: each worker's staged tensors are copied into the served
    ones (:meth:`~wsync_grpc.core.engine.Engine.load_weights`) or swapped in; a streaming
    update was applied as it arrived. An adapter: worker 0's tensors are handed
    to :meth:`~wsync_grpc.core.lora.LoraAdapters.load_adapter` all at once.

    Raises:
        ValueError, KeyError: from the engine (see those methods).
    """
    if header.adapter is not None:
        assert isinstance(adapter, LoraAdapters), "validated at Prepare"
        tensors = [pair for named in receivers[0].staged for pair in named]
        receivers[0].tensors_applied = adapter.load_adapter(header.adapter, header.weight_version, tensors)
        return
    if header.streaming:
        return
    for r in receivers:
        for named in r.staged:
            r.tensors_applied += adapter.load_weights(r.worker, named)
        r.tensors_applied += r.apply_swaps()
