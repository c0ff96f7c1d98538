"""What an engine keeps across updates: lifecycle, group membership, receive buffers, served version, dirt.

:class:`EngineState` is shared by the servicer and the update in flight
(:class:`~wsync_grpc.service.session.UpdateSession`) and guarded by one
re-entrant lock. Locking order: that lock first, then the engine's own
(admission, weights lock); never the other way round.

The update session depends on this state, never the other way round: the
state names only what it reads of the update in flight (:class:`InFlight`),
and the session records its outcome through the state's methods
(:meth:`EngineState.start_update`, :meth:`EngineState.record_applied`,
:meth:`EngineState.record_failed`, :meth:`EngineState.mark_dirty`) instead of
writing the state's fields.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Generic, Protocol, TypeVar

from wsync_grpc.core.engine import Engine, PauseMode, PauseOutcome, RemoteWorkers
from wsync_grpc.core.errors import DeadlineExceeded, FailedPrecondition, WsyncError
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.lifecycle import Event, Lifecycle, State
from wsync_grpc.core.ownership import Lease, Ownership, OwnerView
from wsync_grpc.core.timeouts import DEFAULT_PAUSE_TIMEOUT_S
from wsync_grpc.service.membership import Membership
from wsync_grpc.service.metrics import EngineMetrics
from wsync_grpc.service.status import EngineFacts, ErrorRecord, Progress, StatusSnapshot
from wsync_grpc.worker.buffers import BufferPool

log = logging.getLogger(__name__)


def may_step(engine: Engine) -> bool:
    """Whether requests in flight may still run inference steps: serving, or paused in WAIT mode."""
    return engine.pause_mode() in (None, PauseMode.WAIT)


class InFlight(Protocol):
    """What the engine-wide state reads of the update in flight (:class:`~wsync_grpc.service.session.UpdateSession`).

    Attributes:
        header: the update's validated header.
        error: why the update failed; ``None`` while it has not.
        auto_paused: the update paused the engine (a streaming update) and resumes it afterwards; an
            operator's pause clears it.
        keeps_base: the engine's workers keep the update's tensors as the base of a later delta
            (``PrepareHeader.delta_base``, workers that cannot read back what they serve).
    """

    header: UpdateHeader
    error: WsyncError | None
    auto_paused: bool
    keeps_base: bool

    def progress(self) -> Progress:
        """Where the update stands (GetStatus). Lock held."""
        ...


UpdateT = TypeVar("UpdateT", bound=InFlight)
"""The type of the update in flight (the servicer's: :class:`~wsync_grpc.service.session.UpdateSession`)."""


class EngineState(Generic[UpdateT]):
    """The engine-wide state of the weight-sync service, guarded by :attr:`lock`.

    Generic in the type of the update in flight, of which it reads only :class:`InFlight`: the servicer's
    is ``EngineState[UpdateSession]``, and hands back its :class:`~wsync_grpc.service.session.UpdateSession`.

    Args:
        engine: the engine.
        keep_buffers: keep receive buffers between updates (see
            :class:`~wsync_grpc.worker.buffers.BufferPool`); ``None``: on CPU
            workers only.

    Attributes:
        engine: the engine.
        lifecycle: the lifecycle state machine.
        lock: the re-entrant lock that guards everything here.
        membership: the workers' membership of the weight-sync group.
        pools: each worker's receive buffers, in worker order.
        facts: what the engine serves (fixed).
        weight_version: the version of the weights served.
        weight_identity: the identity issued to the base weights served by the last update that applied them
            (``wsync.v1.GetStatusResponse.weight_identity``; a delta must name it); ``""``: none since the engine
            started, or the weights are dirty.
        dirty: a failed update left the weights half-updated.
        dirty_paused: the engine is paused because of dirty weights, not by an operator.
        updates_completed: updates applied since the engine started.
        last_error: the last error reported (a failed update or Init).
        update: the update in flight, from the moment its receivers start to its apply or failure.
        failed_update: the last update that failed, until the next Init (Complete reports its error).
        ownership: the engine's owner and its lease (:mod:`wsync_grpc.core.ownership`).
        metrics: the engine's Prometheus metrics (:mod:`wsync_grpc.service.metrics`), served when asked.
    """

    def __init__(self, engine: Engine, keep_buffers: bool | None = None) -> None:
        self.engine = engine
        self.lifecycle = Lifecycle()
        self.lock = threading.RLock()
        specs = engine.parameter_specs()
        devices = list(engine.worker_devices())
        self.membership = Membership(devices, engine if isinstance(engine, RemoteWorkers) else None)
        self.pools = [BufferPool(d, d.type == "cpu" if keep_buffers is None else keep_buffers) for d in devices]
        self.facts = EngineFacts.of(engine.name, specs, len(devices))
        self.weight_version = ""
        self.weight_identity = ""
        self.worker_base_identity = ""
        """The identity of the weights the workers keep a copy of, as the base of a delta (an engine whose workers
        cannot read back what they serve); ``""``: none."""
        self.dirty = False
        self.dirty_paused = False
        self.updates_completed = 0
        self.last_error: ErrorRecord | None = None
        self.update: UpdateT | None = None
        self.failed_update: UpdateT | None = None
        self.ownership = Ownership()
        self.metrics = EngineMetrics()
        self.metrics.watch_state(self.snapshot, lambda: self.receive_buffer_bytes)

    @property
    def busy(self) -> bool:
        """An update (or the owner's Init joining the group) is in flight: the owner is alive. Lock held."""
        return self.update is not None or self.lifecycle.state is State.JOINING

    def check_owner(self, credential: str, what: str) -> None:
        """Refuse a caller presenting ``credential`` when another owner is alive (renew the lease when it is
        the owner's). Lock held.

        Raises:
            FailedPrecondition: NOT_OWNER.
        """
        self.ownership.check(credential, self.busy, what=what)

    def claim(self, caller: str, credential: str, what: str, ttl_s: float | None = None, force: bool = False) -> Lease:
        """Keep the owner presenting ``credential``, or make ``caller`` the owner with a new lease unless another
        owner is alive (see :meth:`Ownership.claim`). Lock held.

        Raises:
            FailedPrecondition: NOT_OWNER.
        """
        return self.ownership.claim(caller, credential, self.busy, what=what, ttl_s=ttl_s, force=force)

    def owner_view(self) -> OwnerView | None:
        """The live owner, as GetStatus reports it; ``None`` when there is none. Lock held."""
        return self.ownership.view(self.busy)

    def record_error(self, err: WsyncError, update_id: str = "") -> None:
        """Remember ``err`` as the last error (GetStatus reports it)."""
        self.last_error = ErrorRecord.of(err, update_id)

    def current(self, update_id: str) -> UpdateT:
        """The update in flight, which ``update_id`` must name.

        Raises:
            FailedPrecondition: NO_UPDATE, UPDATE_ID_MISMATCH.
        """
        upd = self.update
        if upd is None:
            raise FailedPrecondition("NO_UPDATE", "no update is in flight")
        if update_id != upd.header.update_id:
            raise FailedPrecondition(
                "UPDATE_ID_MISMATCH",
                f"update_id {update_id!r} does not name the update in flight ({upd.header.update_id!r})",
            )
        return upd

    def check_delta_base(self, h: UpdateHeader) -> None:
        """A delta (``h.delta``) applies only to the base it names, on clean weights this engine can read. Lock held.

        Raises:
            FailedPrecondition: ENGINE_DIRTY; BASE_VERSION_MISMATCH, the engine serves another version, or the same
                label with another identity (weights another trainer wrote, an engine restarted, a forced resume);
                NO_DELTA_BASE, the engine's weights live in worker processes that kept no copy of them (the update
                that wrote them did not ask: ``PrepareHeader.delta_base``).
        """
        if not h.delta:
            return
        if self.dirty:
            raise FailedPrecondition(
                "ENGINE_DIRTY",
                "the weights are dirty (a failed streaming update): only a whole update repairs them, not a delta",
            )
        if h.base_weight_version != self.weight_version or h.base_weight_identity != self.weight_identity:
            raise FailedPrecondition(
                "BASE_VERSION_MISMATCH",
                f"the delta's base is version {h.base_weight_version!r} (identity {h.base_weight_identity[:40]!r}), "
                f"but the engine serves {self.weight_version!r} (identity {self.weight_identity!r}): send a whole "
                "update",
                served_version=self.weight_version,
                served_identity=self.weight_identity,
            )
        if isinstance(self.engine, RemoteWorkers) and self.worker_base_identity != self.weight_identity:
            raise FailedPrecondition(
                "NO_DELTA_BASE",
                "this engine's workers cannot read back the weights they serve and kept no copy of them: the update "
                "that wrote them did not ask for one (PrepareHeader.delta_base); send a whole update that does",
            )

    def start_update(self, update: UpdateT) -> None:
        """``update`` becomes the update in flight (its receivers are about to start). Lock held."""
        self.update = update

    def record_applied(self, update: UpdateT, base: bool) -> None:
        """The update in flight was applied: count it, move to READY, resume the engine when it paused for it.

        ``base``: it carried base weights, whose version it publishes and which it leaves clean (an adapter
        neither changes nor cleans them). Lock held.
        """
        if base:
            self.weight_version = update.header.weight_version
            self.weight_identity = uuid.uuid4().hex
            self.worker_base_identity = self.weight_identity if update.keeps_base else ""
            self.dirty = False
        self.updates_completed += 1
        self.update = None
        self.lifecycle.fire(Event.APPLIED)
        if update.auto_paused or (base and self.dirty_paused):
            self.engine.resume()
        self.dirty_paused = self.dirty_paused and not base

    def record_failed(self, update: UpdateT, err: WsyncError) -> None:
        """The update in flight failed with ``err``: leave the group, move to FAILED, remember the update (until
        the next Init: Complete reports its error) and the error (GetStatus). Lock held."""
        self.membership.leave()  # remote workers abandon their receive as they leave
        if update.keeps_base:
            self.worker_base_identity = ""  # the workers drop their copy with the update (a delta may be in it)
        self.lifecycle.fire(Event.FAIL)
        self.update = None
        self.failed_update = update
        self.record_error(err, update.header.update_id)

    def mark_dirty(self, auto_paused: bool) -> None:
        """Flag half-updated weights and keep the engine paused until an update succeeds (``auto_paused``: the
        failed update had paused the engine itself). Lock held."""
        self.dirty = True
        self.weight_identity = self.worker_base_identity = ""
        if may_step(self.engine):  # serving, or a WAIT pause whose requests still run
            self.dirty_paused = not self.engine.is_paused()
            self.engine.pause(PauseMode.KEEP, DEFAULT_PAUSE_TIMEOUT_S)
        elif auto_paused:
            self.dirty_paused = True  # the update's own freeze now holds because of the dirt

    def update_that_failed(self, update_id: str) -> UpdateT | None:
        """In FAILED: update ``update_id`` when it is the one that failed the engine; else ``None``. Lock held."""
        failed = self.failed_update
        if (
            self.lifecycle.state == State.FAILED
            and failed is not None
            and failed.error is not None
            and update_id == failed.header.update_id
        ):
            return failed
        return None

    def failed_error(self, update_id: str) -> WsyncError | None:
        """In FAILED: the error that ended update ``update_id``, when it is the one that failed the engine; else
        ``None``. Lock held."""
        failed = self.update_that_failed(update_id)
        return failed.error if failed is not None else None

    def failure_of(self, update_id: str) -> WsyncError:
        """In FAILED: the error that ended update ``update_id``, or WRONG_STATE when it names no failed update."""
        error = self.failed_error(update_id)
        if error is not None:
            return error
        return FailedPrecondition("WRONG_STATE", "Complete is not allowed in state FAILED: no such update")

    def snapshot(self) -> StatusSnapshot:
        """Everything GetStatus reports, read under the lock."""
        with self.lock:
            state = self.lifecycle.state
            paused = self.engine.is_paused()
            mode = self.engine.pause_mode()
            progress = self.update.progress() if self.update is not None else None
            running, waiting = self.engine.request_counts()
            return StatusSnapshot(
                state=state,
                paused=paused,
                pause_mode=mode,
                dirty=self.dirty,
                weight_version=self.weight_version,
                weight_identity=self.weight_identity,
                updates_completed=self.updates_completed,
                group=self.membership.params,
                devices=tuple(str(d) for d in self.membership.devices),
                update=progress,
                last_error=self.last_error,
                engine=self.facts,
                running_requests=running,
                waiting_requests=waiting,
                owner=self.owner_view(),
            )

    def pause(self, mode: PauseMode, timeout_s: float) -> tuple[bool, PauseOutcome, PauseMode]:
        """An operator's pause: stop admission; requests in flight go as ``mode`` says.

        The operator's pause then holds after the update in flight and after
        dirty weights are repaired. The drain of a WAIT pause is bounded by
        ``timeout_s`` seconds.

        Returns:
            Whether the engine was paused already, the engine's outcome, and the mode in force.

        Raises:
            DeadlineExceeded: DRAIN_TIMEOUT; the engine stays paused.
        """
        with self.lock:
            already = self.engine.is_paused()
            if self.update is not None:
                self.update.auto_paused = False  # the operator's pause now holds after the update
            self.dirty_paused = False
        try:
            outcome = self.engine.pause(mode, timeout_s)
        except TimeoutError as e:
            raise DeadlineExceeded(
                "DRAIN_TIMEOUT",
                f"requests in flight did not finish within {timeout_s:g} s; the engine stays paused "
                f"and they keep running (Pause with mode ABORT ends them): {e}",
            ) from None
        return already, outcome, self.engine.pause_mode() or mode

    def resume(self, force: bool) -> tuple[bool, int]:
        """An operator's resume: admit requests again.

        Returns:
            Whether the engine was paused, and how many requests resumed.

        Raises:
            FailedPrecondition: STREAMING_UPDATE_IN_FLIGHT; ENGINE_DIRTY (unless ``force``).
        """
        with self.lock:
            upd = self.update
            if upd is not None and upd.header.streaming:
                raise FailedPrecondition(
                    "STREAMING_UPDATE_IN_FLIGHT",
                    f"a streaming update is changing the weights (state {self.lifecycle.state.name}); "
                    "Resume after Complete or Cancel",
                )
            if self.dirty and not force:
                raise FailedPrecondition(
                    "ENGINE_DIRTY",
                    "a failed update left the weights half-updated; run a complete update, "
                    "or Resume with force = true to serve them anyway",
                )
            was_paused = self.engine.is_paused()
            resumed = self.engine.resume() if was_paused else 0
            self.dirty_paused = False
            if self.dirty:
                log.warning("resumed with dirty weights (forced by the operator)")
            return was_paused, resumed

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of receive buffers the workers keep for the next update, in bytes."""
        return sum(p.free_bytes for p in self.pools)
