"""What :class:`~wsync_grpc.trainer.client.TrainerClient`'s operator calls return: one small dataclass per reply.

``status()``, ``pause()``, ``resume()``, ``checksums()``, ``init()``, ``leave()`` and ``cancel()``
return ``target -> view``, each view read from the engine's ``wsync.v1`` reply once, here, with
the domain's enums (:class:`~wsync_grpc.core.lifecycle.State`,
:class:`~wsync_grpc.core.engine.PauseMode`, :class:`~wsync_grpc.core.layout.Layout`...) and times
in seconds; so a user reads a status without learning ``wsync.v1``. Every view keeps the reply it
was read from as ``raw``, for the fields it does not carry; ``TrainerClient.stubs`` stays for
calls the client does not wrap.

Units: sizes in bytes, times in seconds (``*_s``), wall-clock times in seconds since the Unix
epoch (``*_unix_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import duration_pb2
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import PauseMode
from wsync_grpc.core.layout import ApplyMode, Layout
from wsync_grpc.core.lifecycle import State
from wsync_grpc.wire.convert import APPLY_MODES, LAYOUTS, PAUSE_MODES, backend_from_proto, from_proto

__all__ = [
    "CancelResult",
    "Checksums",
    "EngineError",
    "EngineGroup",
    "EngineInfo",
    "EngineOwner",
    "EngineStatus",
    "InitResult",
    "LeaveResult",
    "PauseResult",
    "ResumeResult",
    "TensorChecksum",
    "UpdateInFlight",
]


def _seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def _pause_mode(value: int) -> PauseMode | None:
    """The pause mode of a ``wsync.v1.PauseMode`` number; ``None`` for UNSPECIFIED (not paused)."""
    return None if value == 0 else from_proto(PAUSE_MODES, value, PauseMode.ABORT, "pause_mode")


@dataclass(frozen=True)
class EngineGroup:
    """The weight-sync group as one engine joined it (``wsync.v1.GroupInfo``).

    Attributes:
        group_name: the group's name (its store prefix).
        world_size: ranks in the group (the trainer's, then every engine's workers).
        ranks: the group ranks of this engine's workers, in worker order.
        backend: ``"gloo"`` or ``"nccl"``.
        master_address: the host of the group's store (the trainer's).
        master_port: the store's TCP port.
        devices: each worker's device (``"cpu"``, ``"cuda:0"``...), in worker order.
        timeout_s: the group's collective timeout, in seconds.
        raw: the reply's ``GroupInfo``.
    """

    group_name: str
    world_size: int
    ranks: tuple[int, ...]
    backend: str
    master_address: str
    master_port: int
    devices: tuple[str, ...]
    timeout_s: float
    raw: pb.GroupInfo

    @classmethod
    def from_proto(cls, g: pb.GroupInfo) -> EngineGroup:
        """Read ``g`` (an unknown backend number raises :class:`~wsync_grpc.core.errors.InvalidArgument`)."""
        return cls(
            group_name=g.group_name,
            world_size=g.world_size,
            ranks=tuple(g.ranks),
            backend=backend_from_proto(g.backend),
            master_address=g.master_address,
            master_port=g.master_port,
            devices=tuple(g.devices),
            timeout_s=_seconds(g.timeout),
            raw=g,
        )


@dataclass(frozen=True)
class EngineOwner:
    """The engine's owner: the client holding its lease (``wsync.v1.OwnerInfo``).

    Attributes:
        owner: its name as it sent it (``TrainerClient.owner``); ``""`` is the anonymous owner.
        since_unix_s: when it became the owner, in seconds since the Unix epoch.
        keepalive_calls: its ``KeepAlive`` calls open now (0: the lease lives on its ttl).
        lease_ttl_s: how long the ownership outlives its last call without a ``KeepAlive``, in seconds.
        expires_in_s: seconds left before the lease expires; ``None`` while a ``KeepAlive`` call is
            open or an update of the owner is in flight.
        raw: the reply's ``OwnerInfo``.
    """

    owner: str
    since_unix_s: float
    keepalive_calls: int
    lease_ttl_s: float
    expires_in_s: float | None
    raw: pb.OwnerInfo

    @classmethod
    def from_proto(cls, o: pb.OwnerInfo) -> EngineOwner:
        """Read ``o``."""
        return cls(
            owner=o.owner,
            since_unix_s=o.since_unix_seconds,
            keepalive_calls=o.keepalive_calls,
            lease_ttl_s=_seconds(o.lease_ttl),
            expires_in_s=_seconds(o.expires_in) if o.HasField("expires_in") else None,
            raw=o,
        )


@dataclass(frozen=True)
class EngineError:
    """An engine's last error (``wsync.v1.ErrorDetail``).

    Attributes:
        reason: machine-readable, UPPER_SNAKE_CASE (the ``google.rpc.ErrorInfo`` reason of the RPC
            that failed, e.g. ``"UPDATE_CANCELLED"``).
        message: the human-readable explanation.
        update_id: the update it happened in; ``""`` for a join.
        unix_s: when it happened, in seconds since the Unix epoch.
        raw: the reply's ``ErrorDetail``.
    """

    reason: str
    message: str
    update_id: str
    unix_s: float
    raw: pb.ErrorDetail

    @classmethod
    def from_proto(cls, e: pb.ErrorDetail) -> EngineError:
        """Read ``e``."""
        return cls(e.reason, e.message, e.update_id, e.unix_seconds, e)


@dataclass(frozen=True)
class EngineInfo:
    """The model an engine serves, and its load (``wsync.v1.EngineInfo``).

    Attributes:
        name: the engine's (model's) name.
        parameter_count: parameter elements served.
        parameter_bytes: size of the served parameters, in bytes.
        tensor_count: named tensors an update may carry.
        workers: the workers (group ranks) the engine contributes.
        running_requests: generation requests in flight.
        waiting_requests: requests queued for admission.
        raw: the reply's ``EngineInfo``.
    """

    name: str
    parameter_count: int
    parameter_bytes: int
    tensor_count: int
    workers: int
    running_requests: int
    waiting_requests: int
    raw: pb.EngineInfo

    @classmethod
    def from_proto(cls, e: pb.EngineInfo) -> EngineInfo:
        """Read ``e``."""
        return cls(
            e.name,
            e.parameter_count,
            e.parameter_bytes,
            e.tensor_count,
            e.workers,
            e.running_requests,
            e.waiting_requests,
            e,
        )


@dataclass(frozen=True)
class UpdateInFlight:
    """The update an engine is receiving (``wsync.v1.UpdateProgress``).

    Attributes:
        update_id: the update's id.
        weight_version: the version it installs.
        layout: how its buckets travel.
        apply_mode: when the engine applies it.
        buckets_expected: buckets declared so far.
        buckets_received: buckets received so far.
        bytes_expected: bytes declared so far, in bytes.
        bytes_received: bytes received so far, in bytes (per worker).
        elapsed_s: since its Prepare began, in seconds.
        incremental: whether its trainer may declare further buckets.
        raw: the reply's ``UpdateProgress``.
    """

    update_id: str
    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    buckets_expected: int
    buckets_received: int
    bytes_expected: int
    bytes_received: int
    elapsed_s: float
    incremental: bool
    raw: pb.UpdateProgress

    @classmethod
    def from_proto(cls, u: pb.UpdateProgress) -> UpdateInFlight:
        """Read ``u`` (UNSPECIFIED enums: the contract's defaults, flattened and staged)."""
        return cls(
            update_id=u.update_id,
            weight_version=u.weight_version,
            layout=from_proto(LAYOUTS, u.layout, Layout.FLATTENED, "layout"),
            apply_mode=from_proto(APPLY_MODES, u.apply_mode, ApplyMode.STAGED, "apply_mode"),
            buckets_expected=u.buckets_expected,
            buckets_received=u.buckets_received,
            bytes_expected=u.bytes_expected,
            bytes_received=u.bytes_received,
            elapsed_s=u.elapsed_seconds,
            incremental=u.incremental,
            raw=u,
        )


@dataclass(frozen=True)
class EngineStatus:
    """One engine's status (``TrainerClient.status()``; ``wsync.v1.GetStatusResponse``).

    Attributes:
        state: its lifecycle state (``State.READY``...).
        weight_version: the version served; ``""`` until the first successful update.
        paused: whether admission is paused.
        pause_mode: the pause in force; ``None`` while serving.
        dirty: whether a failed streaming update left the weights half-updated (the engine stays
            paused until an update succeeds).
        updates_completed: updates that succeeded since the engine started.
        engine: the model served and the engine's load.
        group: the weight-sync group; ``None`` when the engine is not a member.
        update: the update in flight; ``None`` when none.
        last_error: its last error; ``None`` when none happened yet.
        owner: its live owner; ``None`` when it has none (never owned, left, or the lease expired).
        raw: the ``GetStatusResponse`` itself.
    """

    state: State
    weight_version: str
    paused: bool
    pause_mode: PauseMode | None
    dirty: bool
    updates_completed: int
    engine: EngineInfo
    group: EngineGroup | None
    update: UpdateInFlight | None
    last_error: EngineError | None
    owner: EngineOwner | None
    raw: pb.GetStatusResponse

    @classmethod
    def from_proto(cls, r: pb.GetStatusResponse) -> EngineStatus:
        """Read ``r`` (:class:`~wsync_grpc.core.lifecycle.State`'s values are the ``LifecycleState`` numbers)."""
        return cls(
            state=State(r.state),
            weight_version=r.weight_version,
            paused=r.paused,
            pause_mode=_pause_mode(r.pause_mode),
            dirty=r.dirty,
            updates_completed=r.updates_completed,
            engine=EngineInfo.from_proto(r.engine),
            group=EngineGroup.from_proto(r.group) if r.HasField("group") else None,
            update=UpdateInFlight.from_proto(r.update) if r.HasField("update") else None,
            last_error=EngineError.from_proto(r.last_error) if r.HasField("last_error") else None,
            owner=EngineOwner.from_proto(r.owner) if r.HasField("owner") else None,
            raw=r,
        )


@dataclass(frozen=True)
class PauseResult:
    """What ``TrainerClient.pause()`` did on one engine (``wsync.v1.PauseResponse``).

    Attributes:
        already_paused: whether the engine was paused before the call.
        mode: the pause mode now in force.
        aborted_requests: requests this call aborted.
        drained_requests: requests this call waited for until they finished.
        frozen_requests: requests now frozen, to continue after resume.
        raw: the ``PauseResponse`` itself.
    """

    already_paused: bool
    mode: PauseMode | None
    aborted_requests: int
    drained_requests: int
    frozen_requests: int
    raw: pb.PauseResponse

    @classmethod
    def from_proto(cls, r: pb.PauseResponse) -> PauseResult:
        """Read ``r``."""
        return cls(r.already_paused, _pause_mode(r.mode), r.aborted_requests, r.drained_requests, r.frozen_requests, r)


@dataclass(frozen=True)
class ResumeResult:
    """What ``TrainerClient.resume()`` did on one engine (``wsync.v1.ResumeResponse``).

    Attributes:
        was_paused: ``False`` when the engine was already serving.
        resumed_requests: frozen requests that continue.
        raw: the ``ResumeResponse`` itself.
    """

    was_paused: bool
    resumed_requests: int
    raw: pb.ResumeResponse

    @classmethod
    def from_proto(cls, r: pb.ResumeResponse) -> ResumeResult:
        """Read ``r``."""
        return cls(r.was_paused, r.resumed_requests, r)


@dataclass(frozen=True)
class TensorChecksum:
    """The digest of one served tensor (``wsync.v1.TensorChecksum``).

    Attributes:
        name: the tensor's name, as asked (tied aliases: under the canonical name when all were asked).
        dtype: the torch dtype name it is served in (``"bfloat16"``).
        shape: its shape.
        sha256: hex SHA-256 of its bytes (C-contiguous, native little-endian, in its served dtype).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class Checksums:
    """``TrainerClient.checksums()`` of one engine (``wsync.v1.GetWeightChecksumsResponse``).

    Attributes:
        weight_version: the version the digests were taken from.
        checksums: the digests, in the order asked (or the engine's order).
        raw: the ``GetWeightChecksumsResponse`` itself.
    """

    weight_version: str
    checksums: tuple[TensorChecksum, ...]
    raw: pb.GetWeightChecksumsResponse

    @property
    def by_name(self) -> dict[str, str]:
        """name -> hex SHA-256."""
        return {c.name: c.sha256 for c in self.checksums}

    @classmethod
    def from_proto(cls, r: pb.GetWeightChecksumsResponse) -> Checksums:
        """Read ``r``."""
        sums = tuple(TensorChecksum(c.name, c.dtype, tuple(c.shape), c.sha256) for c in r.checksums)
        return cls(r.weight_version, sums, r)


@dataclass(frozen=True)
class InitResult:
    """How one engine joined the group at ``TrainerClient.init()`` (``wsync.v1.InitResponse``).

    Attributes:
        already_joined: whether the engine was already a member with identical parameters (nothing
            done but the ownership).
        group: the group as the engine joined it.
        join_seconds: how long forming the group took on the engine, in seconds (0 when already joined).
        owner: the engine's owner now (this client).
        raw: the ``InitResponse`` itself.
    """

    already_joined: bool
    group: EngineGroup
    join_seconds: float
    owner: EngineOwner | None
    raw: pb.InitResponse

    @classmethod
    def from_proto(cls, r: pb.InitResponse) -> InitResult:
        """Read ``r``."""
        owner = EngineOwner.from_proto(r.owner) if r.HasField("owner") else None
        return cls(r.already_joined, EngineGroup.from_proto(r.group), r.join_seconds, owner, r)


@dataclass(frozen=True)
class LeaveResult:
    """What ``TrainerClient.leave()`` did on one engine (``wsync.v1.LeaveResponse``).

    Attributes:
        was_member: ``False`` when the engine was not a member.
        raw: the ``LeaveResponse`` itself.
    """

    was_member: bool
    raw: pb.LeaveResponse

    @classmethod
    def from_proto(cls, r: pb.LeaveResponse) -> LeaveResult:
        """Read ``r``."""
        return cls(r.was_member, r)


@dataclass(frozen=True)
class CancelResult:
    """What ``TrainerClient.cancel()`` did on one engine (``wsync.v1.CancelResponse``).

    Attributes:
        cancelled: whether an update was in flight and is now abandoned.
        update_id: the update cancelled; ``""`` when none.
        state: the engine's lifecycle state after the call.
        raw: the ``CancelResponse`` itself.
    """

    cancelled: bool
    update_id: str
    state: State
    raw: pb.CancelResponse

    @classmethod
    def from_proto(cls, r: pb.CancelResponse) -> CancelResult:
        """Read ``r``."""
        return cls(r.cancelled, r.update_id, State(r.state), r)
