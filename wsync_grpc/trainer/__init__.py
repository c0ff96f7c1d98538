"""The trainer side of wsync: :class:`TrainerClient` pushes weights into inference engines.

:class:`TrainerClient` (:mod:`.client`) adds to the generated stub what every
trainer would otherwise rewrite, one module per part: forming the group with
the trainer as rank 0 (:mod:`.membership`); one update and its failure
protocol (:mod:`.sync`), its bucket plan (:mod:`.planning`) and broadcasts
(:mod:`.broadcast`); calls fanned out to every engine (:mod:`.fleet`);
results and errors (:mod:`.results`); settings (:mod:`.settings`) and the
option literals with their protocol enums (:mod:`.options`).
"""

from wsync_grpc.trainer.client import TrainerClient
from wsync_grpc.trainer.fleet import DEFAULT_MAX_MESSAGE_BYTES
from wsync_grpc.trainer.options import (
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_RPC_TIMEOUT_S,
    ApplyMode,
    BackendName,
    Layout,
    PauseModeName,
)
from wsync_grpc.trainer.results import (
    TRAINER,
    ClientError,
    EngineCallError,
    EngineFailure,
    EngineSyncResult,
    InitError,
    SyncError,
    SyncProgress,
    SyncResult,
)

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_RPC_TIMEOUT_S",
    "TRAINER",
    "ApplyMode",
    "BackendName",
    "ClientError",
    "EngineCallError",
    "EngineFailure",
    "EngineSyncResult",
    "InitError",
    "Layout",
    "PauseModeName",
    "SyncError",
    "SyncProgress",
    "SyncResult",
    "TrainerClient",
]
