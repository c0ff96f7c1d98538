"""GetStatus's messages, built from plain values: a snapshot of the engine in, ``wsync.v1`` messages out.

Nothing here reads the engine, the group or a clock: the servicer takes a
:class:`StatusSnapshot` under its lock and :func:`status_response` turns it
into a ``GetStatusResponse``, so the mapping is testable on its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.engine import ParamSpec, PauseMode
from wsync_grpc.core.errors import WsyncError
from wsync_grpc.core.layout import ApplyMode, Layout
from wsync_grpc.core.lifecycle import State
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.ownership import OwnerView
from wsync_grpc.service.membership import group_info
from wsync_grpc.wire.convert import APPLY_MODES, LAYOUTS, PAUSE_MODES, duration, state_to_proto


@dataclass(frozen=True)
class ErrorRecord:
    """The last error an engine reported (``wsync.v1.ErrorDetail``).

    Attributes:
        reason: UPPER_SNAKE_CASE reason.
        message: what went wrong, for a person.
        update_id: the update it ended; ``""`` for an Init.
        unix_seconds: when, in seconds since the Unix epoch.
    """

    reason: str
    message: str
    update_id: str = ""
    unix_seconds: float = 0.0

    @classmethod
    def of(cls, err: WsyncError, update_id: str = "") -> ErrorRecord:
        """The record of ``err``, now."""
        return cls(err.reason, err.message, update_id, time.time())


@dataclass(frozen=True)
class EngineFacts:
    """What an engine serves, fixed for its lifetime (``wsync.v1.EngineInfo`` less the request counts).

    Attributes:
        name: the adapter's name.
        parameter_count: elements over every served tensor.
        parameter_bytes: bytes over every served tensor, in bytes.
        tensor_count: served tensors (tied aliases not counted).
        workers: the engine's workers.
    """

    name: str
    parameter_count: int
    parameter_bytes: int
    tensor_count: int
    workers: int

    @classmethod
    def of(cls, name: str, specs: Mapping[str, ParamSpec], workers: int) -> EngineFacts:
        """The facts of an engine called ``name`` serving ``specs`` on ``workers`` workers."""
        return cls(
            name=name,
            parameter_count=sum(s.numel for s in specs.values()),
            parameter_bytes=sum(s.nbytes for s in specs.values()),
            tensor_count=len(specs),
            workers=workers,
        )


@dataclass(frozen=True)
class Progress:
    """The update in flight (``wsync.v1.UpdateProgress``).

    ``buckets_received`` and ``bytes_received`` are those of the slowest
    worker; sizes in bytes, times in seconds.
    """

    update_id: str
    weight_version: str
    layout: Layout
    apply_mode: ApplyMode
    buckets_expected: int
    buckets_received: int
    bytes_expected: int
    bytes_received: int
    elapsed_seconds: float
    incremental: bool


@dataclass(frozen=True)
class StatusSnapshot:
    """Everything GetStatus reports, read at one moment.

    Attributes:
        state: the lifecycle state.
        paused: whether admission is stopped.
        pause_mode: the mode of the pause in force; ``None`` when serving.
        dirty: whether a failed update left the weights half-updated.
        weight_version: the version being served.
        weight_identity: the identity of the base weights served (``""``: none issued, or dirty).
        updates_completed: updates applied since the engine started.
        group: the joined group's parameters; ``None`` when not a member.
        devices: the workers' devices (``str(torch.device)``), in worker order.
        update: the update in flight, if any.
        last_error: the last error reported, if any.
        engine: the engine's fixed facts.
        running_requests: requests running inference steps.
        waiting_requests: requests waiting for admission.
        owner: the live owner; ``None`` when there is none.
    """

    state: State
    paused: bool
    pause_mode: PauseMode | None
    dirty: bool
    weight_version: str
    updates_completed: int
    group: GroupParams | None
    devices: tuple[str, ...]
    update: Progress | None
    last_error: ErrorRecord | None
    engine: EngineFacts
    running_requests: int
    waiting_requests: int
    owner: OwnerView | None = None
    weight_identity: str = ""


def owner_info(o: OwnerView) -> pb.OwnerInfo:
    """The ``wsync.v1.OwnerInfo`` of ``o`` (``expires_in`` unset while the lease cannot expire)."""
    msg = pb.OwnerInfo(
        owner=o.owner,
        since_unix_seconds=o.since_unix_s,
        keepalive_calls=o.keepalive_calls,
        lease_ttl=duration(o.lease_ttl_s),
        generation=o.generation,
    )
    if o.expires_in_s is not None:
        msg.expires_in.CopyFrom(duration(o.expires_in_s))
    return msg


def error_detail(e: ErrorRecord) -> pb.ErrorDetail:
    """The ``wsync.v1.ErrorDetail`` of ``e``."""
    return pb.ErrorDetail(reason=e.reason, message=e.message, update_id=e.update_id, unix_seconds=e.unix_seconds)


def progress_message(p: Progress) -> pb.UpdateProgress:
    """The ``wsync.v1.UpdateProgress`` of ``p``."""
    return pb.UpdateProgress(
        update_id=p.update_id,
        weight_version=p.weight_version,
        layout=LAYOUTS[p.layout],
        apply_mode=APPLY_MODES[p.apply_mode],
        buckets_expected=p.buckets_expected,
        buckets_received=p.buckets_received,
        bytes_expected=p.bytes_expected,
        bytes_received=p.bytes_received,
        elapsed_seconds=p.elapsed_seconds,
        incremental=p.incremental,
    )


def engine_info(facts: EngineFacts, running_requests: int = 0, waiting_requests: int = 0) -> pb.EngineInfo:
    """The ``wsync.v1.EngineInfo`` of ``facts`` with the current request counts."""
    return pb.EngineInfo(
        name=facts.name,
        parameter_count=facts.parameter_count,
        parameter_bytes=facts.parameter_bytes,
        tensor_count=facts.tensor_count,
        workers=facts.workers,
        running_requests=running_requests,
        waiting_requests=waiting_requests,
    )


def status_response(s: StatusSnapshot) -> pb.GetStatusResponse:
    """The ``wsync.v1.GetStatusResponse`` of ``s``.

    The optional parts (pause mode, group, update, last error, owner) are set only when ``s`` has them.
    """
    resp = pb.GetStatusResponse(
        state=state_to_proto(s.state),
        paused=s.paused,
        dirty=s.dirty,
        weight_version=s.weight_version,
        weight_identity=s.weight_identity,
        updates_completed=s.updates_completed,
        engine=engine_info(s.engine, s.running_requests, s.waiting_requests),
    )
    if s.pause_mode is not None:
        resp.pause_mode = PAUSE_MODES[s.pause_mode]
    if s.group is not None:
        resp.group.CopyFrom(group_info(s.group, s.devices))
    if s.update is not None:
        resp.update.CopyFrom(progress_message(s.update))
    if s.last_error is not None:
        resp.last_error.CopyFrom(error_detail(s.last_error))
    if s.owner is not None:
        resp.owner.CopyFrom(owner_info(s.owner))
    return resp
