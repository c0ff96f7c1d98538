"""The trainer side of wsync: :class:`TrainerClient` pushes weights into inference engines.

:class:`TrainerClient` (:mod:`.client`) is one facade over the parts every
trainer would otherwise rewrite, one module per concept: where the weights
come from (:mod:`.source`: names, dtypes and global shapes to plan with,
tensors per bucket while sending) and which trainer rank sends which bytes
(:mod:`.sender`); forming the group with the trainer's ranks first
(:mod:`.membership`); one update as the client was asked for it
(:mod:`.request`), its bucket plan (:mod:`.planning`), its calls over every
engine and failure protocol (:mod:`.protocol`), run as a broadcast
(:mod:`.sync`) or a disk read (:mod:`.disk`); calls fanned out to every engine
(:mod:`.fleet`); which engines take part in each update under the fleet policy, and
catching up those that fell behind (:mod:`.roster`); results and errors (:mod:`.results`) and the typed views of
the operator calls (:mod:`.views`); settings (:mod:`.settings`) and the option
literals with their one conversion into the core's enums (:mod:`.options`).
"""

from wsync_grpc.group.routes import route_address
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
from wsync_grpc.trainer.roster import FleetPolicy, Member
from wsync_grpc.trainer.sender import BroadcastSender, Sender
from wsync_grpc.trainer.settings import AUTO_MASTER_ADDRESS
from wsync_grpc.trainer.source import NamedTensors, TensorMeta, WeightSource
from wsync_grpc.trainer.views import (
    CancelResult,
    Checksums,
    EngineError,
    EngineGroup,
    EngineInfo,
    EngineOwner,
    EngineStatus,
    InitResult,
    LeaveResult,
    PauseResult,
    ResumeResult,
    TensorChecksum,
    UpdateInFlight,
)
from wsync_grpc.wire.keepalive import Keepalive

__all__ = [
    "AUTO_MASTER_ADDRESS",
    "DEFAULT_GROUP_TIMEOUT_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_RPC_TIMEOUT_S",
    "TRAINER",
    "ApplyMode",
    "BackendName",
    "BroadcastSender",
    "CancelResult",
    "Checksums",
    "ClientError",
    "EngineCallError",
    "EngineError",
    "EngineFailure",
    "EngineGroup",
    "EngineInfo",
    "EngineOwner",
    "EngineStatus",
    "EngineSyncResult",
    "FleetPolicy",
    "InitError",
    "InitResult",
    "Keepalive",
    "Layout",
    "LeaveResult",
    "Member",
    "NamedTensors",
    "PauseModeName",
    "PauseResult",
    "ResumeResult",
    "Sender",
    "SyncError",
    "SyncProgress",
    "SyncResult",
    "TensorChecksum",
    "TensorMeta",
    "TrainerClient",
    "UpdateInFlight",
    "WeightSource",
    "route_address",
]
