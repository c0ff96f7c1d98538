"""The lease rules of ``wsync_grpc.core.ownership``, on a clock the test moves (the module takes any clock).

The owner is whoever presents the lease credential the engine issued it; names are only shown.
"""

from __future__ import annotations

import pytest

from wsync_grpc.core.errors import FailedPrecondition
from wsync_grpc.core.ownership import DEFAULT_LEASE_TTL_S, Ownership, credential_generation


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


def test_the_first_claim_issues_a_credential_and_callers_without_it_are_refused_naming_the_owner(
    own: Ownership,
) -> None:
    assert own.view(busy=False) is None
    lease = own.claim("a", "", busy=False, what="Init")
    assert lease.changed and len(lease.credential) > 40 and credential_generation(lease.credential) == lease.generation
    with pytest.raises(FailedPrecondition) as e:
        own.claim("b", "", busy=False, what="Init")
    assert e.value.reason == "NOT_OWNER" and e.value.metadata["owner"] == "a" and "'a'" in e.value.message
    assert lease.credential not in e.value.message and lease.credential not in str(e.value.metadata)
    with pytest.raises(FailedPrecondition):
        own.check("", busy=False, what="Cancel")
    own.check(lease.credential, busy=False, what="Cancel")  # the owner itself
    again = own.claim("a", lease.credential, busy=False, what="Init")  # re-Init by the owner changes nothing
    assert not again.changed and again.credential == lease.credential and again.generation == lease.generation


def test_the_owners_name_proves_nothing(own: Ownership) -> None:
    """A second caller sending the owner's very name, without its credential, is refused."""
    own.claim("trainer-1", "", busy=False, what="Init")
    with pytest.raises(FailedPrecondition) as e:
        own.claim("trainer-1", "", busy=False, what="Prepare")
    assert e.value.reason == "NOT_OWNER" and "presents no lease credential" in e.value.message
    with pytest.raises(FailedPrecondition) as e:
        own.check("not-a-credential", busy=True, what="Complete")
    assert "is not the owner's" in e.value.message


def test_every_new_owner_gets_a_new_generation_and_an_old_credential_is_fenced(own: Ownership, clock: Clock) -> None:
    a = own.claim("a", "", busy=False, what="Init", ttl_s=10.0)
    clock.now += 11.0  # a's lease expired; b takes the engine
    b = own.claim("b", "", busy=False, what="Init")
    assert b.changed and b.generation == a.generation + 1 and b.credential != a.credential
    with pytest.raises(FailedPrecondition) as e:
        own.check(a.credential, busy=False, what="Complete")
    assert f"generation {a.generation}" in e.value.message and "ended lease" in e.value.message
    op = own.claim("operator", "", busy=False, what="Init", force=True)  # a force takeover: b is fenced too
    with pytest.raises(FailedPrecondition):
        own.check(b.credential, busy=False, what="Prepare")
    own.release()
    with pytest.raises(FailedPrecondition):  # a KeepAlive never revives an ended lease, owner or none
        own.check_holder(op.credential, what="KeepAlive")
    own.check_holder("", what="KeepAlive")  # presenting none is no claim to an old lease


def test_the_lease_lives_for_its_ttl_after_the_last_call_then_passes(own: Ownership, clock: Clock) -> None:
    a = own.claim("a", "", busy=False, what="Init", ttl_s=10.0)
    clock.now += 9.0
    own.check(a.credential, busy=False, what="Prepare")  # renews
    clock.now += 9.0
    with pytest.raises(FailedPrecondition):
        own.check("", busy=False, what="Init")
    view = own.view(busy=False)
    assert view is not None and view.expires_in_s == pytest.approx(1.0) and view.lease_ttl_s == 10.0
    assert view.generation == a.generation
    clock.now += 1.5
    assert own.view(busy=False) is None
    b = own.claim("b", "", busy=False, what="Init")
    assert own.owner == "b" and b.generation == a.generation + 1
    view = own.view(busy=False)
    assert view is not None and view.lease_ttl_s == DEFAULT_LEASE_TTL_S  # not a's ttl: a new lease, a new ttl


def test_ttls_are_clamped_to_the_operators_cap_the_default_included(own: Ownership) -> None:
    own.max_ttl_s = 5.0
    a = own.claim("a", "", busy=False, what="KeepAlive")  # no ttl asked: the default, clamped
    view = own.view(busy=False)
    assert view is not None and view.lease_ttl_s == 5.0
    own.claim("a", a.credential, busy=False, what="Init", ttl_s=3600.0 * 24 * 365 * 10)
    view = own.view(busy=False)
    assert view is not None and view.lease_ttl_s == 5.0


def test_a_failed_claim_is_undone_and_its_credential_void(own: Ownership) -> None:
    lease = own.claim("a", "", busy=False, what="Init")
    own.undo(lease)
    assert own.owner is None and own.view(busy=False) is None and not own.holds(lease.credential)
    b = own.claim("b", "", busy=False, what="Init")
    own.undo(own.claim("b", b.credential, busy=False, what="Init"))  # a renewal that failed: b keeps its lease
    assert own.holds(b.credential)


def test_an_update_in_flight_keeps_the_owner_alive_past_the_ttl(own: Ownership, clock: Clock) -> None:
    own.claim("a", "", busy=False, what="Init")
    clock.now += DEFAULT_LEASE_TTL_S * 3
    with pytest.raises(FailedPrecondition):
        own.claim("b", "", busy=True, what="Init")
    view = own.view(busy=True)
    assert view is not None and view.expires_in_s is None


def test_an_open_keepalive_holds_the_lease_and_its_end_releases_it_at_once(own: Ownership, clock: Clock) -> None:
    own.claim("a", "", busy=False, what="KeepAlive")
    g1 = own.keepalive_opened()
    g2 = own.keepalive_opened()
    clock.now += DEFAULT_LEASE_TTL_S * 3
    view = own.view(busy=False)
    assert view is not None and view.keepalive_calls == 2 and view.expires_in_s is None
    own.keepalive_closed(g1)
    with pytest.raises(FailedPrecondition):
        own.check("", busy=False, what="Init")  # one call still open
    own.keepalive_closed(g2)
    assert not own.alive(busy=False)
    own.claim("b", "", busy=False, what="Init")
    assert own.owner == "b"


def test_leave_ends_the_ttl_but_not_an_open_keepalive(own: Ownership) -> None:
    a = own.claim("a", "", busy=False, what="Init")
    own.expire()
    assert not own.alive(busy=False)
    assert not own.claim("a", a.credential, busy=False, what="KeepAlive").changed  # the same lease, held again
    g = own.keepalive_opened()
    own.expire()
    assert own.alive(busy=False)  # still there: it re-forms its group
    own.keepalive_closed(g)
    assert not own.alive(busy=False)


def test_force_takes_the_engine_and_ends_the_old_owners_keepalives(own: Ownership) -> None:
    own.claim("a", "", busy=False, what="Init")
    g = own.keepalive_opened()
    op = own.claim("op", "", busy=True, what="Init", force=True)
    assert op.changed and own.owner == "op" and own.generation != g
    own.keepalive_closed(g)  # the old call's end does not touch the new owner's lease
    assert own.alive(busy=False)
    assert own.force_release(op.credential, busy=False) is None  # the owner itself: nothing to force
    generation = own.generation
    assert own.force_release("", busy=False) == "op"
    assert own.owner is None and own.generation == generation + 1
    assert own.force_release("", busy=False) is None  # no owner left
    own.claim("op", "", busy=False, what="Init")
    own.release()
    assert own.owner is None and own.view(busy=False) is None


def test_an_anonymous_owner_is_still_one_caller(own: Ownership) -> None:
    anon = own.claim("", "", busy=False, what="Init")
    own.check(anon.credential, busy=False, what="Prepare")
    with pytest.raises(FailedPrecondition) as e:
        own.check("", busy=False, what="Prepare")  # another caller that sends no name is not that owner
    assert "anonymous owner" in e.value.message
