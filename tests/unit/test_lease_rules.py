"""The lease rules of ``wsync_grpc.core.ownership``, on a clock the test moves (the module takes any clock)."""

from __future__ import annotations

import pytest

from wsync_grpc.core.errors import FailedPrecondition
from wsync_grpc.core.ownership import DEFAULT_LEASE_TTL_S, Ownership


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def own(clock: Clock) -> Ownership:
    return Ownership(clock=clock, wall=clock)


def test_the_first_claim_makes_the_owner_and_others_are_refused_naming_it(own: Ownership) -> None:
    assert own.view(busy=False) is None
    assert own.claim("a", busy=False, what="Init") is True
    with pytest.raises(FailedPrecondition) as e:
        own.claim("b", busy=False, what="Init")
    assert e.value.reason == "NOT_OWNER" and e.value.metadata["owner"] == "a" and "'a'" in e.value.message
    with pytest.raises(FailedPrecondition):
        own.check("b", busy=False, what="Cancel")
    own.check("a", busy=False, what="Cancel")  # the owner itself
    assert own.claim("a", busy=False, what="Init") is False  # re-Init by the owner changes nothing


def test_the_lease_lives_for_its_ttl_after_the_last_call_then_passes(own: Ownership, clock: Clock) -> None:
    own.claim("a", busy=False, what="Init", ttl_s=10.0)
    clock.now += 9.0
    own.check("a", busy=False, what="Prepare")  # renews
    clock.now += 9.0
    with pytest.raises(FailedPrecondition):
        own.check("b", busy=False, what="Init")
    view = own.view(busy=False)
    assert view is not None and view.expires_in_s == pytest.approx(1.0) and view.lease_ttl_s == 10.0
    clock.now += 1.5
    assert own.view(busy=False) is None
    generation = own.generation
    assert own.claim("b", busy=False, what="Init") is True
    assert own.owner == "b" and own.generation == generation + 1


def test_an_update_in_flight_keeps_the_owner_alive_past_the_ttl(own: Ownership, clock: Clock) -> None:
    own.claim("a", busy=False, what="Init")
    clock.now += DEFAULT_LEASE_TTL_S * 3
    with pytest.raises(FailedPrecondition):
        own.claim("b", busy=True, what="Init")
    view = own.view(busy=True)
    assert view is not None and view.expires_in_s is None


def test_an_open_keepalive_holds_the_lease_and_its_end_releases_it_at_once(own: Ownership, clock: Clock) -> None:
    own.claim("a", busy=False, what="KeepAlive")
    g1 = own.keepalive_opened()
    g2 = own.keepalive_opened()
    clock.now += DEFAULT_LEASE_TTL_S * 3
    view = own.view(busy=False)
    assert view is not None and view.keepalive_calls == 2 and view.expires_in_s is None
    own.keepalive_closed(g1)
    with pytest.raises(FailedPrecondition):
        own.check("b", busy=False, what="Init")  # one call still open
    own.keepalive_closed(g2)
    assert not own.alive(busy=False)
    own.claim("b", busy=False, what="Init")
    assert own.owner == "b"


def test_leave_ends_the_ttl_but_not_an_open_keepalive(own: Ownership) -> None:
    own.claim("a", busy=False, what="Init")
    own.expire()
    assert not own.alive(busy=False)
    own.claim("a", busy=False, what="KeepAlive")
    g = own.keepalive_opened()
    own.expire()
    assert own.alive(busy=False)  # still there: it re-forms its group
    own.keepalive_closed(g)
    assert not own.alive(busy=False)


def test_force_takes_the_engine_and_ends_the_old_owners_keepalives(own: Ownership) -> None:
    own.claim("a", busy=False, what="Init")
    g = own.keepalive_opened()
    assert own.claim("op", busy=True, what="Init", force=True) is True
    assert own.owner == "op" and own.generation != g
    own.keepalive_closed(g)  # the old call's end does not touch the new owner's lease
    assert own.alive(busy=False)
    assert own.force_release("op", busy=False) is None  # the owner itself: nothing to force
    generation = own.generation
    assert own.force_release("someone", busy=False) == "op"
    assert own.owner is None and own.generation == generation + 1
    assert own.force_release("someone", busy=False) is None  # no owner left
    own.claim("op", busy=False, what="Init")
    own.release()
    assert own.owner is None and own.view(busy=False) is None


def test_the_anonymous_owner_is_shared_by_every_caller_that_sends_no_name(own: Ownership) -> None:
    own.claim("", busy=False, what="Init")
    own.check("", busy=False, what="Prepare")
    with pytest.raises(FailedPrecondition) as e:
        own.claim("trainer-1", busy=False, what="Init")
    assert "anonymous owner" in e.value.message
