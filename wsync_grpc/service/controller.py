"""The update controller: one engine's weight-sync lifecycle over domain values, whatever the protocol.

:class:`UpdateController` owns what an update needs beyond one RPC: the
engine-wide state (:class:`~wsync_grpc.service.engine_state.EngineState`:
lifecycle, membership, ownership, buffers), the Prepare stream being read, and
the update in flight (:class:`~wsync_grpc.service.session.UpdateSession`). Its
methods are the contract's Init, Leave, Prepare, Update, Complete and Cancel
and the checksums, taking and returning domain values and raising domain
errors (:mod:`wsync_grpc.core.errors`); the gRPC servicer
(:mod:`wsync_grpc.service.servicer`) converts messages to and from them, in
the role KServe's ``DataPlane`` plays under its gRPC servicer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from opentelemetry.context import Context

from wsync_grpc.core.checksums import tensor_sha256s
from wsync_grpc.core.digests import Digest
from wsync_grpc.core.engine import Engine, FusedGroups, ServedChecksums
from wsync_grpc.core.errors import Aborted, AlreadyExists, InvalidArgument, Phase, domain_error
from wsync_grpc.core.header import UpdateHeader
from wsync_grpc.core.layout import Transport
from wsync_grpc.core.lifecycle import Event, Rpc, State, WrongState
from wsync_grpc.core.lora import LoraAdapters, adapter_param_specs
from wsync_grpc.core.membership import GroupParams
from wsync_grpc.core.ownership import Lease, describe
from wsync_grpc.core.timeouts import DEFAULT_PREPARE_TIMEOUT_S, ServerBounds
from wsync_grpc.core.validation import BucketSpecFields, UpdateValidator
from wsync_grpc.service.engine_state import EngineState
from wsync_grpc.service.membership import MasterAllowList
from wsync_grpc.service.outcome import CompleteResult, PrepareResult
from wsync_grpc.service.prepare import PrepareMessage, PrepareReader, cancelled_while_preparing
from wsync_grpc.service.session import UpdateSession
from wsync_grpc.transports import transport_for
from wsync_grpc.transports.context import PlanContext
from wsync_grpc.transports.disk.roots import CheckpointRoots

log = logging.getLogger(__name__)

Checksum = tuple[str, torch.dtype, tuple[int, ...], str]
"""``(name as asked, served dtype, shape, hex SHA-256 of its C-contiguous bytes)``."""


@dataclass(frozen=True)
class InitOutcome:
    """What Init did (``wsync.v1.InitResponse``).

    Attributes:
        already_joined: the engine was a member of this very group already (Init is idempotent).
        lease: the caller's lease (its credential goes back to it alone).
        join_seconds: how long the join took, in seconds (0 when already joined).
    """

    already_joined: bool
    lease: Lease
    join_seconds: float = 0.0


@dataclass(frozen=True)
class CancelOutcome:
    """What Cancel did (``wsync.v1.CancelResponse``).

    Attributes:
        cancelled: an update (or a Prepare being read) was abandoned.
        update_id: its id; empty when none was, or when a Prepare's header had not arrived yet.
        state: the lifecycle state afterwards.
    """

    cancelled: bool
    update_id: str
    state: State


@dataclass(frozen=True)
class UpdateOutcome:
    """What Update did (``wsync.v1.UpdateResponse``): the update's buckets and bytes declared so far."""

    update_id: str
    bucket_count: int
    total_bytes: int


class UpdateController:
    """One engine's weight-sync lifecycle (the protocol-agnostic side of ``wsync.v1.WeightSyncService``).

    Args:
        engine: the engine.
        prepare_timeout_s: bound on arming the receivers at Prepare, and on the silence between two
            messages of a Prepare stream, in seconds (a stream that stalls longer is stopped). Read at
            each Prepare.
        keep_buffers: keep receive buffers between updates (see
            :class:`~wsync_grpc.worker.buffers.BufferPool`); ``None``: on CPU workers only.
        checkpoint_roots: directories disk updates may read checkpoints from; empty: disk updates are
            refused with PERMISSION_DENIED.
        bounds: the operator's bounds (``None``: the defaults); the controller applies their update idle
            limit (read at each Prepare): an update idle for longer fails and its owner loses the engine
            (:meth:`~wsync_grpc.service.session.UpdateSession.armed`).
        allowed_masters: CIDR networks Init's master address must lie in
            (:class:`~wsync_grpc.service.membership.MasterAllowList`); empty: any.

    Attributes:
        state: the engine-wide state; its lock guards every method's changes.
        bounds: see above; assigning it applies from the next update.

    Raises:
        ValueError: a checkpoint root that is not a directory; an allowed master network that is not one.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        prepare_timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S,
        keep_buffers: bool | None = None,
        checkpoint_roots: Sequence[str] = (),
        bounds: ServerBounds | None = None,
        allowed_masters: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.checkpoint_roots = CheckpointRoots(checkpoint_roots)
        self.allowed_masters = MasterAllowList(allowed_masters)
        self.prepare_timeout_s = prepare_timeout_s
        self.state: EngineState[UpdateSession] = EngineState(engine, keep_buffers)
        self.bounds = bounds if bounds is not None else ServerBounds()
        self._lock = self.state.lock
        self._preparing: PrepareReader | None = None  # the Prepare stream being read, in PREPARING
        self._digests: dict[str, Checksum] = {}  # name -> checksum of the weights _digests_key names
        self._digests_key: tuple[str, int] | None = None

    @property
    def bounds(self) -> ServerBounds:
        """See the constructor; assigning it applies from the next update (the lease ttl cap at once)."""
        return self._bounds

    @bounds.setter
    def bounds(self, value: ServerBounds) -> None:
        self._bounds = value
        with self.state.lock:
            self.state.ownership.max_ttl_s = value.max_lease_ttl_s

    # --------------------------------------------------------------- Init/Leave

    def init(self, params: GroupParams, owner: str, credential: str, ttl_s: float, force: bool) -> InitOutcome:
        """Make the caller the owner and join the group ``params`` describe (see ``InitRequest``).

        Args:
            owner: the caller's display name.
            credential: the lease credential it presented (``""``: none).
            ttl_s: the lease's ttl, in seconds.
            force: take the engine from a live owner.

        A failed Init claims nothing: a lease it issued is void again.

        Raises:
            PermissionDenied: MASTER_NOT_ALLOWED (before anything changes or connects).
            FailedPrecondition: NOT_OWNER, WRONG_STATE.
            AlreadyExists: GROUP_MISMATCH (joined with other parameters by the same owner).
            WsyncError: the join failed (JOIN_TIMEOUT, GROUP_ERROR...); the engine is UNINITIALIZED again.
        """
        st, m = self.state, self.state.membership
        params = self.allowed_masters.check(params)
        with self._lock:
            previous = st.ownership.owner
            lease = st.claim(owner, credential, "Init", ttl_s, force)
            try:
                if lease.changed and force and previous is not None:
                    self._cancel_in_flight("", f"the engine was taken over from {describe(previous)} (forced)")
                if st.lifecycle.check(Rpc.INIT) == State.READY:
                    if params == m.params:
                        return InitOutcome(already_joined=True, lease=lease)
                    if not lease.changed:
                        raise AlreadyExists(
                            "GROUP_MISMATCH",
                            f"already joined group {m.params.group_name if m.params else ''!r} with other "
                            "parameters; call Leave first",
                        )
                    m.leave()  # the previous owner is gone: its group goes with it
                    st.lifecycle.fire(Event.LEAVE)
            except BaseException:
                st.ownership.undo(lease)
                raise
            st.lifecycle.fire(Event.JOIN)
            st.failed_update = None
        start = time.monotonic()
        try:
            groups = m.join(params)
        except BaseException as e:
            err = domain_error(e, Phase.JOIN)
            with self._lock:
                st.lifecycle.fire(Event.JOIN_FAILED)
                st.ownership.undo(lease)
                st.record_error(err)
            raise err from e
        with self._lock:
            m.joined(params, groups)
            st.lifecycle.fire(Event.JOINED)
        return InitOutcome(already_joined=False, lease=lease, join_seconds=time.monotonic() - start)

    def leave(self, credential: str, force: bool) -> bool:
        """Leave the weight-sync group (idempotent); whether the engine was a member.

        Args:
            credential: the lease credential the caller presented (``""``: none).

        Raises:
            FailedPrecondition: NOT_OWNER (unless ``force``), WRONG_STATE (an update in flight).
        """
        st = self.state
        with self._lock:
            if force:
                self._force_away(credential, "Leave")
            else:
                st.check_owner(credential, "Leave")
            state = st.lifecycle.check(Rpc.LEAVE)
            if st.ownership.holds(credential):
                st.ownership.expire()  # the owner left: its lease lives only while it keeps it alive
            if state == State.UNINITIALIZED:
                return False
            was_member = st.membership.leave()
            st.lifecycle.fire(Event.LEAVE)
            return was_member

    def _force_away(self, credential: str, what: str) -> None:
        """An operator's force: the live owner, unless the caller, loses the engine. Lock held."""
        lost = self.state.ownership.force_release(credential, self.state.busy)
        if lost is not None:
            log.warning("%s with force: %s loses the engine", what, describe(lost))

    # ------------------------------------------------------ Prepare/Update/Complete

    def prepare(
        self,
        stream: Iterator[PrepareMessage],
        stop_stream: Callable[[], None],
        trace_context: Context | None,
        credential: str = "",
    ) -> PrepareResult:
        """Read, validate and arm one update; return once every receiver is armed.

        Ownership is checked before any state changes: a caller presenting no credential of the live
        owner is refused before the stream is read, and the engine enters PREPARING only once the
        header has arrived and its caller is (or has just become) the owner. A Prepare that fails
        claims nothing (a lease it issued is void again).

        Args:
            stream: the Prepare stream's messages (a header first).
            stop_stream: ends ``stream`` (on a stall, or a Cancel while it is read).
            trace_context: the OpenTelemetry context of the Prepare's span, kept by the update.
            credential: the lease credential the caller presented (``""``: none).

        Returns:
            The armed update, with the caller's lease credential.

        Raises:
            WsyncError: NOT_OWNER, see :meth:`~wsync_grpc.service.prepare.PrepareReader.read`,
                :meth:`~wsync_grpc.transports.TransportPart.plan` and
                :meth:`~wsync_grpc.service.session.UpdateSession.wait_armed`; WRONG_STATE for a transport that
                needs the group before Init.
        """
        started = time.monotonic()
        st = self.state
        leases: list[Lease] = []
        with self._lock:
            st.check_owner(credential, "Prepare")
            st.lifecycle.check(Rpc.PREPARE)
        reader = PrepareReader(self.prepare_timeout_s)
        reader.on_owner = functools.partial(self._begin_prepare, reader, credential, leases)
        try:
            params = st.membership.params
            validator = update_validator(self.engine, params.trainer_ranks if params is not None else 1)
            reader.on_header = self._check_header
            header, buckets = reader.read(validator, stream, stop_stream)
            transport = transport_for(header.transport)
            if transport.needs_group and st.lifecycle.origin is not State.READY:
                raise WrongState(Rpc.PREPARE, st.lifecycle.origin, "a broadcast needs the group: call Init first")
            planned = transport.plan(header, validator, buckets, PlanContext(self.checkpoint_roots, reader.cancel))
            try:
                with self._lock:
                    if reader.cancel.is_set():
                        raise cancelled_while_preparing()
                    session = UpdateSession(st, planned, transport, validator, started, self.bounds.update_idle_s)
                    session.trace_context = trace_context
                    session.start()
            finally:
                planned.release()  # the receivers hold their own references to what planning opened
        except BaseException:
            with self._lock:
                if self._preparing is reader:
                    self._preparing = None
                    if st.lifecycle.state == State.PREPARING:
                        st.lifecycle.fire(Event.REJECTED)
                for lease in leases:
                    st.ownership.undo(lease)
            raise
        try:
            session.wait_armed(self.prepare_timeout_s)
        except BaseException:
            with self._lock:
                for lease in leases:
                    if st.update is None:
                        st.ownership.undo(lease)
            raise
        finally:
            with self._lock:
                self._preparing = None
        with self._lock:
            result = session.armed()
        return dataclasses.replace(result, lease_credential=leases[0].credential if leases else "")

    def _check_header(self, header: UpdateHeader) -> None:
        """What the engine's state says of a validated header, before any bucket is read: a delta must name the
        base served (:meth:`~wsync_grpc.service.engine_state.EngineState.check_delta_base`).

        Raises:
            FailedPrecondition, Unimplemented: see there.
        """
        with self._lock:
            self.state.check_delta_base(header)

    def _begin_prepare(self, reader: PrepareReader, credential: str, leases: list[Lease], owner: str) -> None:
        """The Prepare header named ``owner``: claim the engine for the caller, then enter PREPARING.

        The caller must own the engine (``credential``), or the engine must have no live owner (the
        caller then becomes it; its lease is appended to ``leases``).

        Raises:
            FailedPrecondition: NOT_OWNER; WRONG_STATE.
            Aborted: UPDATE_IN_PROGRESS.
        """
        with self._lock:
            lease = self.state.claim(owner, credential, "Prepare")
            try:
                self.state.lifecycle.begin(Rpc.PREPARE, Event.PREPARE)
            except BaseException:
                self.state.ownership.undo(lease)
                raise
            leases.append(lease)
            self._preparing = reader

    def update(
        self,
        credential: str,
        update_id: str,
        transport: Transport | None,
        specs: Sequence[BucketSpecFields],
        spec_digests: Sequence[Digest | None] = (),
        digests: Mapping[int, Digest] | None = None,
    ) -> UpdateOutcome:
        """Declare further buckets of the incremental update ``update_id`` (``spec_digests``: theirs, converted at
        the edge; empty: none), and ``digests`` of buckets already declared (bucket index -> digest).

        ``transport`` is how the declared buckets travel: ``None`` (unspecified on the wire) is the update's own;
        another than the update's is refused. Its part is asked (``check_update``) only where buckets are declared
        (first: a transport no part serves is UNIMPLEMENTED whatever the update's).

        Raises:
            FailedPrecondition: NOT_OWNER, WRONG_STATE, NO_UPDATE, UPDATE_ID_MISMATCH, NOT_INCREMENTAL,
                DIGESTS_NOT_FOLLOWING, COMPLETING.
            Unimplemented: TRANSPORT_UNIMPLEMENTED (a transport whose buckets cannot be declared).
            InvalidArgument: TRANSPORT_MISMATCH, EMPTY_UPDATE, UNKNOWN_BUCKET, DIGEST_CONFLICT, and what the
                validator refuses.
            WsyncError: in FAILED, the error that ended update ``update_id`` (as Complete's).
        """
        st = self.state
        with self._lock:
            st.check_owner(credential, "Update")
            ended = st.failed_error(update_id)
            if ended is not None:
                raise ended
            st.lifecycle.check(Rpc.UPDATE)
            upd = st.current(update_id)
            if specs:
                transport_for(transport or upd.header.transport).check_update()
            if transport is not None and transport is not upd.header.transport:
                raise InvalidArgument(
                    "TRANSPORT_MISMATCH",
                    f"update {update_id} travels by {upd.header.transport.name}, not {transport.name}",
                )
            if not specs and not digests:
                raise InvalidArgument("EMPTY_UPDATE", "UpdateRequest carries neither buckets nor digests")
            if specs:
                upd.check_accepts_buckets()
            if digests:
                upd.check_accepts_digests()
            if specs:
                upd.declare(specs, spec_digests)
            if digests:
                upd.declare_digests(digests)
            return UpdateOutcome(upd.header.update_id, len(upd.feed), upd.bytes)

    def begin_complete(
        self, credential: str, update_id: str, timeout_s: Callable[[float], float], verify_only: bool
    ) -> tuple[UpdateSession, float]:
        """Start Complete on update ``update_id``: no bucket may be declared any more.

        Args:
            timeout_s: the caller's bound on the wait, in seconds, given the engine's default (the group
                timeout); it may raise to refuse a bad duration before anything changes.

        Returns:
            The update, and the bound of :meth:`finish_complete`'s wait, in seconds.

        Raises:
            FailedPrecondition: NOT_OWNER, WRONG_STATE, NO_UPDATE, UPDATE_ID_MISMATCH.
            WsyncError: in FAILED, the error that ended update ``update_id``.
            Aborted: COMPLETE_IN_PROGRESS.
        """
        st = self.state
        with self._lock:
            st.check_owner(credential, "Complete")
            if st.lifecycle.check(Rpc.COMPLETE) == State.FAILED:
                raise st.failure_of(update_id)
            upd = st.current(update_id)
            timeout = timeout_s(st.membership.group_timeout_s)
            upd.begin_complete(verify_only)
        return upd, timeout

    @staticmethod
    def finish_complete(upd: UpdateSession, timeout_s: float, verify_only: bool, flush_cache: bool) -> CompleteResult:
        """Wait for every bucket (at most ``timeout_s`` seconds), then verify only, or apply and publish.

        Raises:
            DeadlineExceeded: RECEIVE_TIMEOUT.
            WsyncError: the receive or the apply failed (the update has failed).
        """
        return upd.verify(timeout_s) if verify_only else upd.complete(timeout_s, flush_cache)

    def cancel(self, credential: str, update_id: str, reason: str, force: bool) -> CancelOutcome:
        """Abandon the update in flight (idempotent); ``update_id`` empty: whatever is in flight.

        Raises:
            FailedPrecondition: NOT_OWNER (unless ``force``), WRONG_STATE (while applying).
        """
        st = self.state
        with self._lock:
            if not force:
                st.check_owner(credential, "Cancel")
            state = st.lifecycle.check(Rpc.CANCEL)
            outcome = self._cancel_in_flight(update_id, reason, state)
            if force:
                self._force_away(credential, "Cancel")
            return outcome

    def _cancel_in_flight(self, update_id: str, reason: str, state: State | None = None) -> CancelOutcome:
        """Abandon the update in flight (``update_id``: only if it names it; ``""``: any). Lock held."""
        lifecycle = self.state.lifecycle
        state = lifecycle.state if state is None else state
        reader = self._preparing
        err = Aborted("UPDATE_CANCELLED", f"the update was cancelled: {reason}")
        if state == State.PREPARING and reader is not None:
            # update_id naming another update (or given before the header told us
            # this one's) leaves the Prepare alone, as it leaves an armed update alone.
            if update_id and update_id != reader.update_id:
                return CancelOutcome(False, "", state)
            reader.cancel.set()
            if self.state.update is not None:  # the stream was read and the receivers are being armed
                self.state.update.fail(err)
            return CancelOutcome(True, reader.update_id or "", lifecycle.state)
        upd = self.state.update
        if upd is None or (update_id and update_id != upd.header.update_id):
            return CancelOutcome(False, "", state)
        upd.fail(err)
        return CancelOutcome(True, upd.header.update_id, lifecycle.state)

    # ------------------------------------------------------------------- checks

    def checksums(self, names: Sequence[str]) -> tuple[str, list[Checksum]]:
        """SHA-256 of each served tensor (every one when ``names`` is empty), read between two steps.

        Each name is digested and answered once, in the order first asked (a request repeating a
        name costs what asking it once does). Digests are kept for the weights they were taken
        from: until the next update applies (``updates_completed`` and the version change), while
        no update is in flight and the weights are not dirty, a name asked again is answered
        without reading the tensor again.

        Returns:
            The weight version served while they were read, and one :data:`Checksum` per distinct name.

        Raises:
            InvalidArgument: UNKNOWN_TENSOR.
        """
        specs = self.engine.parameter_specs()
        aliases = self.engine.aliases()
        wanted = list(dict.fromkeys(names)) or list(specs)
        for n in wanted:
            if aliases.get(n, n) not in specs:
                raise InvalidArgument(
                    "UNKNOWN_TENSOR", f"tensor {n[:120]!r} is not a parameter of the served model", tensor=n[:120]
                )
        key = self._weights_key()
        known = self._digests if key is not None and key == self._digests_key else {}
        missing = [n for n in wanted if n not in known]
        if isinstance(self.engine, ServedChecksums):
            fresh = self.engine.weight_checksums(missing) if missing else []
        else:
            with self.engine.weights_lock():  # read between two steps, hashed on lanes (one tensor each)
                served = [self.engine.get_weight(n) for n in missing]
                shas = tensor_sha256s(served)
                fresh = [(n, t.dtype, tuple(t.shape), sha) for n, t, sha in zip(missing, served, shas, strict=True)]
                del served
        digests = {**known, **{c[0]: c for c in fresh}}
        if key is not None and key == self._weights_key():  # nothing changed the weights meanwhile
            self._digests, self._digests_key = digests, key
        return self.state.weight_version, [digests[n] for n in wanted]

    def _weights_key(self) -> tuple[str, int] | None:
        """What identifies the served weights while they cannot change; ``None`` while they may
        (an update in flight, or dirty weights)."""
        with self._lock:
            s = self.state
            if s.update is not None or s.dirty or self._preparing is not None:
                return None
            return s.weight_version, s.updates_completed

    def shutdown(self) -> None:
        """Cancel any update in flight and leave the group (server shutdown)."""
        with self._lock:
            if self.state.update is not None:
                self.state.update.fail(Aborted("SHUTDOWN", "the engine is shutting down"))
            self.state.membership.leave()


def update_validator(engine: Engine, trainer_ranks: int = 1) -> UpdateValidator:
    """A fresh validator for one update of ``engine``: its tensors, ties, fused groups and LoRA targets.

    ``trainer_ranks`` is the joined group's (the buckets' ``src_rank`` must be below it).

    Every registered transport's rules apply (:func:`~wsync_grpc.transports.transport_for`; a disk update
    reads where the engine's roots allow); adapter updates only on an engine that serves adapters
    (:class:`~wsync_grpc.core.lora.LoraAdapters`).
    """
    fused = engine.fused_groups() if isinstance(engine, FusedGroups) else ()
    specs = None
    if isinstance(engine, LoraAdapters) and (lora := engine.lora_linears()):
        specs = functools.partial(adapter_param_specs, lora, max_rank=engine.lora_max_rank())
    return UpdateValidator(engine.parameter_specs(), engine.aliases(), fused, transport_for, specs, trainer_ranks)
