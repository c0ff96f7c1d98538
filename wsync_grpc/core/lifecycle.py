"""The weight-update lifecycle: a small, pure state machine (no I/O).

The servicer asks :meth:`Lifecycle.check` whether an RPC is allowed in the
current state and drives the state with :meth:`Lifecycle.fire`. Both the
RPC rules (:data:`ALLOWED`, :data:`BUSY`) and the transitions
(:data:`TRANSITIONS`) are plain tables, so tests can enumerate every
(state, RPC) and (state, event) pair.

A disallowed RPC raises :class:`WrongState` (a FAILED_PRECONDITION error)
or, for a second update while one is in flight, :class:`UpdateInProgress`
(ABORTED); neither changes the state. Admission (paused / serving) is a
separate, orthogonal flag owned by the engine.
"""

from __future__ import annotations

import enum
import threading

from wsync_grpc.core.errors import Aborted, FailedPrecondition


class State(enum.Enum):
    """Lifecycle states; the values are the ``wsync.v1.LifecycleState`` numbers."""

    UNINITIALIZED = 1
    JOINING = 2
    READY = 3
    PREPARING = 4
    RECEIVING = 5
    RECEIVED = 6
    APPLYING = 7
    FAILED = 8


class Rpc(enum.Enum):
    """The ``wsync.v1.WeightSyncService`` RPCs."""

    INIT = "Init"
    PREPARE = "Prepare"
    UPDATE = "Update"
    COMPLETE = "Complete"
    PAUSE = "Pause"
    RESUME = "Resume"
    GET_STATUS = "GetStatus"
    CANCEL = "Cancel"
    LEAVE = "Leave"
    GET_WEIGHT_CHECKSUMS = "GetWeightChecksums"
    WATCH = "Watch"
    KEEP_ALIVE = "KeepAlive"
    LIST_ADAPTERS = "ListAdapters"
    UNLOAD_ADAPTER = "UnloadAdapter"


class Event(enum.Enum):
    """What moves the state machine."""

    JOIN = "join"  # Init starts forming the group
    JOINED = "joined"  # every worker joined
    JOIN_FAILED = "join_failed"  # the group did not form
    PREPARE = "prepare"  # a Prepare stream starts
    ARMED = "armed"  # metadata valid, receivers posted
    REJECTED = "rejected"  # metadata invalid / stream broken / cancelled while preparing
    MORE_BUCKETS = "more_buckets"  # Update declared further buckets
    ALL_RECEIVED = "all_received"  # every declared bucket arrived
    APPLY = "apply"  # Complete starts applying
    APPLIED = "applied"  # Complete succeeded, new version published
    FAIL = "fail"  # receive/apply failed, timed out or was cancelled
    LEAVE = "leave"  # Leave tore the group down


S = State
ALL_STATES = frozenset(State)
IN_FLIGHT = frozenset({S.PREPARING, S.RECEIVING, S.RECEIVED, S.APPLYING})
"""States in which an update is in flight."""

ALLOWED: dict[Rpc, frozenset[State]] = {
    Rpc.INIT: frozenset({S.UNINITIALIZED, S.READY, S.FAILED}),  # READY: idempotent or ALREADY_EXISTS
    Rpc.PREPARE: frozenset({S.UNINITIALIZED, S.READY, S.FAILED}),  # a broadcast also needs the group: READY
    Rpc.UPDATE: frozenset({S.RECEIVING, S.RECEIVED}),
    Rpc.COMPLETE: frozenset({S.RECEIVING, S.RECEIVED, S.FAILED}),  # FAILED: reports the update's error
    Rpc.PAUSE: ALL_STATES,
    Rpc.RESUME: ALL_STATES,
    Rpc.GET_STATUS: ALL_STATES,
    Rpc.CANCEL: ALL_STATES - {S.APPLYING},
    Rpc.LEAVE: frozenset({S.UNINITIALIZED, S.READY, S.FAILED}),
    Rpc.GET_WEIGHT_CHECKSUMS: ALL_STATES,
    Rpc.WATCH: frozenset({S.RECEIVING, S.RECEIVED, S.APPLYING}),  # after Prepare replied, until the update ends
    Rpc.KEEP_ALIVE: ALL_STATES,
    Rpc.LIST_ADAPTERS: ALL_STATES,
    Rpc.UNLOAD_ADAPTER: ALL_STATES,  # not the adapter an update in flight loads (ADAPTER_UPDATE_IN_FLIGHT)
}
"""RPC -> the states it is allowed in."""

BUSY: dict[Rpc, frozenset[State]] = {Rpc.PREPARE: IN_FLIGHT}
"""RPC -> states in which it is refused as a concurrent update (ABORTED) rather than
as a wrong order (FAILED_PRECONDITION)."""

TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.UNINITIALIZED, Event.JOIN): S.JOINING,
    (S.FAILED, Event.JOIN): S.JOINING,
    (S.JOINING, Event.JOINED): S.READY,
    (S.JOINING, Event.JOIN_FAILED): S.UNINITIALIZED,
    (S.READY, Event.PREPARE): S.PREPARING,
    (S.UNINITIALIZED, Event.PREPARE): S.PREPARING,  # a disk update needs no group
    (S.FAILED, Event.PREPARE): S.PREPARING,
    (S.PREPARING, Event.ARMED): S.RECEIVING,
    (S.PREPARING, Event.REJECTED): S.READY,
    (S.RECEIVING, Event.MORE_BUCKETS): S.RECEIVING,
    (S.RECEIVED, Event.MORE_BUCKETS): S.RECEIVING,
    (S.RECEIVING, Event.ALL_RECEIVED): S.RECEIVED,
    (S.RECEIVED, Event.APPLY): S.APPLYING,
    (S.APPLYING, Event.APPLIED): S.READY,
    (S.PREPARING, Event.FAIL): S.FAILED,  # a receiver failed while being armed
    (S.RECEIVING, Event.FAIL): S.FAILED,
    (S.RECEIVED, Event.FAIL): S.FAILED,
    (S.APPLYING, Event.FAIL): S.FAILED,
    (S.READY, Event.LEAVE): S.UNINITIALIZED,
    (S.FAILED, Event.LEAVE): S.UNINITIALIZED,
}
"""(state, event) -> next state. Pairs not listed are illegal."""

WITHOUT_GROUP: dict[tuple[State, Event, State], State] = {
    (S.PREPARING, Event.REJECTED, S.UNINITIALIZED): S.UNINITIALIZED,
    (S.PREPARING, Event.REJECTED, S.FAILED): S.FAILED,
    (S.APPLYING, Event.APPLIED, S.UNINITIALIZED): S.UNINITIALIZED,
    (S.APPLYING, Event.APPLIED, S.FAILED): S.UNINITIALIZED,
}
"""(state, event, state the update started from) -> next state, where it differs from :data:`TRANSITIONS`.

An update that started without a group (a disk update, from UNINITIALIZED or
FAILED) ends without one: a rejected Prepare leaves the state as it was, an
applied update ends in UNINITIALIZED. A failed one ends in FAILED like any other.
"""


class WrongState(FailedPrecondition):
    """An RPC is not allowed in the current state (FAILED_PRECONDITION, reason WRONG_STATE)."""

    def __init__(self, rpc: Rpc, state: State, why: str = "") -> None:
        allowed = ", ".join(s.name for s in State if s in ALLOWED[rpc])
        message = f"{rpc.value} is not allowed in state {state.name} ({why or f'allowed in: {allowed}'})"
        super().__init__("WRONG_STATE", message, state=state.name, rpc=rpc.value)
        self.rpc = rpc
        self.state = state


class UpdateInProgress(Aborted):
    """A second update was attempted while one is in flight (ABORTED, reason UPDATE_IN_PROGRESS)."""

    def __init__(self, rpc: Rpc, state: State) -> None:
        message = (
            f"{rpc.value} refused: another update is in flight (state {state.name}); "
            "wait for it to complete or Cancel it"
        )
        super().__init__("UPDATE_IN_PROGRESS", message, state=state.name)
        self.rpc = rpc
        self.state = state


class IllegalTransition(RuntimeError):
    """An internal event does not apply to the current state (a servicer bug)."""


class Lifecycle:
    """Thread-safe holder of the current :class:`State`."""

    def __init__(self, state: State = State.UNINITIALIZED) -> None:
        self._state = state
        self._origin = State.READY
        self._lock = threading.Lock()

    @property
    def origin(self) -> State:
        """The state the last update started from (READY, or UNINITIALIZED/FAILED for a disk update without a group)."""
        return self._origin

    @property
    def state(self) -> State:
        """The current state."""
        return self._state

    def check(self, rpc: Rpc) -> State:
        """Return the current state if ``rpc`` is allowed in it.

        Raises:
            UpdateInProgress: ``rpc`` starts an update and one is in flight.
            WrongState: ``rpc`` is not allowed in the current state.
        """
        with self._lock:
            return self._check(rpc)

    def _check(self, rpc: Rpc) -> State:
        state = self._state
        if state in ALLOWED[rpc]:
            return state
        if state in BUSY.get(rpc, frozenset()):
            raise UpdateInProgress(rpc, state)
        raise WrongState(rpc, state)

    def begin(self, rpc: Rpc, event: Event) -> State:
        """Atomically check ``rpc`` and fire ``event``; return the new state.

        Raises:
            UpdateInProgress, WrongState: as :meth:`check`; the state is unchanged.
        """
        with self._lock:
            self._check(rpc)
            return self._fire(event)

    def fire(self, event: Event) -> State:
        """Apply ``event``; return the new state.

        Raises:
            IllegalTransition: ``event`` does not apply to the current state.
        """
        with self._lock:
            return self._fire(event)

    def fire_if(self, event: Event) -> State | None:
        """Apply ``event`` if it applies to the current state; return the new state or ``None``."""
        with self._lock:
            if (self._state, event) not in TRANSITIONS:
                return None
            return self._fire(event)

    def _fire(self, event: Event) -> State:
        try:
            nxt = TRANSITIONS[(self._state, event)]
        except KeyError:
            raise IllegalTransition(f"event {event.value} in state {self._state.name}") from None
        if event is Event.PREPARE:
            self._origin = self._state
        self._state = WITHOUT_GROUP.get((self._state, event, self._origin), nxt)
        return self._state
