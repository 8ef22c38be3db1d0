"""Which model cards the frontend tries to load again, and when: the bookkeeping behind
"a card that failed to load is retried with backoff instead of hiding its worker",
driven by a clock the test moves."""

from __future__ import annotations

from frontend_support import make_card

from dynamo.frontend.models.card_retry import CardRetries
from dynamo.llm.protocols import ModelCard
from dynamo.runtime.backoff import Backoff
from dynamo.testing.clocks import FakeClock


def card(instance_id: int = 1, digest: str = "a" * 32) -> ModelCard:
    return make_card(instance_id, tokenizer_digest=digest)


def retries() -> tuple[CardRetries, FakeClock]:
    clock = FakeClock()
    return CardRetries(Backoff(initial_s=0.5, maximum_s=2.0), clock=clock), clock


def test_a_failed_card_is_due_again_after_a_doubling_delay() -> None:
    pending, clock = retries()
    assert pending.seconds_until_next() is None
    delays = []
    for _ in range(4):
        entry = pending.failed(card())
        delays.append(entry.due - clock.now)
        clock.now = entry.due
    assert delays == [0.5, 1.0, 2.0, 2.0]
    assert pending.due() == [card()] and len(pending) == 1


def test_nothing_is_due_before_its_time() -> None:
    pending, clock = retries()
    pending.failed(card())
    clock.now += 0.4
    assert pending.due() == []
    assert abs((pending.seconds_until_next() or 0) - 0.1) < 1e-9


def test_a_card_that_loaded_or_left_is_not_retried() -> None:
    pending, clock = retries()
    pending.failed(card(1))
    pending.failed(card(2))
    pending.forget(card(1))
    clock.now += 1
    assert pending.due() == [card(2)]
    assert card(1) not in pending and card(2) in pending


def test_a_card_published_again_differently_starts_over() -> None:
    pending, clock = retries()
    for _ in range(3):
        pending.failed(card())
    entry = pending.failed(card(digest="b" * 32))
    assert (entry.failures, entry.due - clock.now) == (1, 0.5)


def test_a_reconnect_makes_every_pending_card_due_soon() -> None:
    pending, clock = retries()
    for _ in range(5):
        entry = pending.failed(card())  # next try 2 s away
    assert entry.due - clock.now == 2.0
    pending.hurry()
    assert pending.seconds_until_next() == 0.5
    clock.now += 0.5
    assert pending.due() == [card()]
    assert pending.failed(card()).failures == 1  # the schedule starts over
