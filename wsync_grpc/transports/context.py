"""What the engine gives a transport's Prepare besides the stream: :class:`PlanContext`."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the disk package imports this module: at run time the field's type is not needed
    from wsync_grpc.transports.disk.roots import CheckpointRoots


@dataclass(frozen=True)
class PlanContext:
    """What the engine gives a transport's Prepare besides the stream
    (:meth:`TransportPart.plan <wsync_grpc.transports.TransportPart.plan>`).

    Attributes:
        roots: where the engine may read sources from (``wsync serve --checkpoint-root``); only a
            transport whose engine reads the bytes itself (disk) looks at them.
        cancel: set by a Cancel while the update is planned; a long planning stops at its next check.
    """

    roots: CheckpointRoots
    cancel: threading.Event
