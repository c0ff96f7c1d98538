"""The lifecycle state machine, enumerated pair by pair (pure, no I/O)."""

from __future__ import annotations

import itertools
import threading

import pytest
from wsync.v1 import weight_sync_pb2 as pb

from wsync_grpc.core.lifecycle import (
    ALLOWED,
    BUSY,
    TRANSITIONS,
    WITHOUT_GROUP,
    Event,
    IllegalTransition,
    Lifecycle,
    Rpc,
    State,
    UpdateInProgress,
    WrongState,
)


def test_states_match_the_contract_enum() -> None:
    for s in State:
        assert pb.LifecycleState.Name(s.value) == f"LIFECYCLE_STATE_{s.name}"
    assert len(State) == len(pb.LifecycleState.keys()) - 1  # all but UNSPECIFIED


def test_rpcs_match_the_contract_service() -> None:
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["WeightSyncService"].methods}
    assert {r.value for r in Rpc} == methods


@pytest.mark.parametrize(("state", "rpc"), list(itertools.product(State, Rpc)))
def test_every_state_rpc_pair(state: State, rpc: Rpc) -> None:
    lc = Lifecycle(state)
    if state in ALLOWED[rpc]:
        assert lc.check(rpc) == state
    elif state in BUSY.get(rpc, frozenset()):
        with pytest.raises(UpdateInProgress) as busy:
            lc.check(rpc)
        assert state.name in str(busy.value)
    else:
        with pytest.raises(WrongState) as wrong:
            lc.check(rpc)
        assert state.name in str(wrong.value) and rpc.value in str(wrong.value)
    assert lc.state == state  # a check never changes the state


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_state_event_pair(state: State, event: Event) -> None:
    lc = Lifecycle(state)
    if (state, event) in TRANSITIONS:
        assert lc.fire(event) == TRANSITIONS[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            lc.fire(event)
        assert lc.state == state
        assert lc.fire_if(event) is None and lc.state == state


def test_begin_refuses_without_changing_state() -> None:
    lc = Lifecycle(State.RECEIVING)
    with pytest.raises(UpdateInProgress):
        lc.begin(Rpc.PREPARE, Event.PREPARE)
    assert lc.state == State.RECEIVING
    lc = Lifecycle(State.JOINING)
    with pytest.raises(WrongState):
        lc.begin(Rpc.PREPARE, Event.PREPARE)
    assert lc.state == State.JOINING


@pytest.mark.parametrize("origin", [State.UNINITIALIZED, State.READY, State.FAILED])
def test_an_update_ends_where_it_started_without_a_group(origin: State) -> None:
    """A disk update needs no group: rejected, the state is as it was; applied, READY only with the group."""
    lc = Lifecycle(origin)
    lc.begin(Rpc.PREPARE, Event.PREPARE)
    assert lc.origin == origin
    assert lc.fire(Event.REJECTED) == origin
    lc.begin(Rpc.PREPARE, Event.PREPARE)
    for event in (Event.ARMED, Event.ALL_RECEIVED, Event.APPLY):
        lc.fire(event)
    assert lc.fire(Event.APPLIED) == (State.READY if origin == State.READY else State.UNINITIALIZED)
    lc.begin(Rpc.PREPARE, Event.PREPARE)
    lc.fire(Event.ARMED)
    assert lc.fire(Event.FAIL) == State.FAILED
    assert (State.PREPARING, Event.REJECTED, origin) in WITHOUT_GROUP or origin == State.READY


def test_every_state_is_reachable_and_can_get_back_to_ready() -> None:
    reach = {State.UNINITIALIZED}
    frontier = [State.UNINITIALIZED]
    while frontier:
        s = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src == s and dst not in reach:
                reach.add(dst)
                frontier.append(dst)
    assert reach == set(State)
    # From every state some path leads back to READY (nothing is a dead end).
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            s = todo.pop()
            for (src, _), dst in TRANSITIONS.items():
                if src == s and dst not in seen:
                    seen.add(dst)
                    todo.append(dst)
        assert State.READY in seen or start == State.READY, start


def test_one_prepare_wins_a_race() -> None:
    lc = Lifecycle(State.READY)
    wins: list[int] = []
    losses: list[int] = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        try:
            lc.begin(Rpc.PREPARE, Event.PREPARE)
            wins.append(i)
        except UpdateInProgress:
            losses.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wins) == 1 and len(losses) == 7
    assert lc.state == State.PREPARING
