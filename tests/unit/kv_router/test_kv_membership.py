"""WorkerMembership: whose events a router believes as workers come, go and die."""

from __future__ import annotations

from dynamo.llm.kv_router.membership import WorkerMembership
from dynamo.testing.clocks import FakeClock


def test_live_workers_are_accepted_and_leavers_are_reported_once() -> None:
    members = WorkerMembership(grace_s=5, clock=FakeClock())
    assert members.set_live([1, 2]) == []
    assert members.accepts(1) and members.accepts(2)
    assert members.set_live([2]) == [1]
    assert members.set_live([2]) == []


def test_a_departed_worker_stays_out_until_it_is_live_again() -> None:
    members = WorkerMembership(grace_s=5, clock=FakeClock())
    members.set_live([1])
    members.set_live([])
    assert not members.accepts(1), "late or replayed events must not resurrect it"
    members.set_live([1])  # lease restored after a partition
    assert members.accepts(1)


def test_unconfirmed_workers_expire_after_the_grace_period() -> None:
    clock = FakeClock()
    members = WorkerMembership(grace_s=5, clock=clock)
    assert members.accepts(7)  # events of a worker we have not seen live (yet)
    clock.now += 4
    assert members.expire() == []
    clock.now += 1
    assert members.expire() == [7]
    assert not members.accepts(7)


def test_an_unconfirmed_worker_that_becomes_live_never_expires() -> None:
    clock = FakeClock()
    members = WorkerMembership(grace_s=5, clock=clock)
    members.accepts(7)
    members.set_live([7])
    clock.now += 60
    assert members.expire() == []
    assert members.accepts(7)
