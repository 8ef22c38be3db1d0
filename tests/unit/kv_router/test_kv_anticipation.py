"""Anticipated blocks: a prompt routed to a worker counts as cached there until its events
confirm it, its request fails before its first output, or the TTL passes; without events
(approximate mode) the router's own decisions are the index, and they expire."""

from __future__ import annotations

import random

import pytest
from kv_cards import BLOCK_SIZE

from dynamo.llm.kv_router.anticipation import (
    DEFAULT_ANTICIPATION_TTL_S,
    DEFAULT_APPROXIMATE_TTL_S,
    AnticipatedBlocks,
    CachePrediction,
)
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.protocols import KvAllCleared, KvBlockStored, RouterEvent
from dynamo.testing.clocks import FakeClock

B = BLOCK_SIZE
TENANT = list(range(5000, 5000 + 4 * B))  # a 4-block shared prefix


def prompt(question: int) -> list[int]:
    return [*TENANT, 90_000 + question, 7, 8]


def scheduler(clock: FakeClock, prediction: CachePrediction | None = None) -> KvScheduler:
    return KvScheduler(B, clock=clock, rng=random.Random(0), prediction=prediction)


def overlaps(s: KvScheduler, tokens: list[int], workers: list[int]) -> dict[int, int]:
    return {score.worker_id: score.overlap_blocks for score in s.score(tokens, workers)}


# ----------------------------------------------------------------------------- the book


def test_the_book_extends_a_prefix_without_gaps_and_expires_in_order() -> None:
    clock = FakeClock()
    book = AnticipatedBlocks(ttl_s=5.0, clock=clock)
    book.add(1, [10, 11, 12])
    assert book.extend_prefix(1, [10, 11, 12, 13], 0) == 3
    assert book.extend_prefix(1, [10, 99, 12], 0) == 1  # a gap ends the prefix
    assert book.extend_prefix(1, [10, 11, 12], 1) == 3  # continues after a cached start
    assert book.extend_prefix(2, [10, 11], 0) == 0  # another worker's book
    clock.now += 3.0
    book.add(1, [20])
    clock.now += 2.5  # 10..12 are 5.5 s old, 20 is 2.5 s old
    assert book.block_count(1) == 1 and book.extend_prefix(1, [10], 0) == 0
    assert book.stats()["expired"] == 3


def test_re_adding_a_block_renews_its_ttl() -> None:
    clock = FakeClock()
    book = AnticipatedBlocks(ttl_s=5.0, clock=clock)
    book.add(1, [10, 11])
    clock.now += 4.0
    book.add(1, [10])
    clock.now += 4.0
    assert book.extend_prefix(1, [10, 11], 0) == 1  # 10 renewed, 11 expired


def test_the_ttl_depends_on_the_mode_unless_set() -> None:
    assert CachePrediction().resolved_ttl_s == DEFAULT_ANTICIPATION_TTL_S
    assert CachePrediction(kv_events=False).resolved_ttl_s == DEFAULT_APPROXIMATE_TTL_S
    assert CachePrediction(kv_events=False, ttl_s=3.0).resolved_ttl_s == 3.0
    with pytest.raises(ValueError, match="TTL"):
        CachePrediction(ttl_s=0)


# ----------------------------------------------------------------------------- events mode


def test_a_routed_prefix_counts_as_cached_after_its_request_ended_before_events() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    first = s.schedule("a", prompt(1), [1, 2])
    assert first.overlap_blocks == 0
    s.mark_prefill_completed("a", 1)
    s.free("a")  # done; no event has arrived yet
    assert overlaps(s, prompt(2), [1, 2]) == {first.worker_id: 4, 3 - first.worker_id: 0}
    assert s.schedule("b", prompt(2), [1, 2]).worker_id == first.worker_id


def test_events_confirm_anticipated_blocks() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    assert s.anticipated.block_count(worker) == 4
    hashes = compute_block_hashes(prompt(1), B)
    s.apply_event(RouterEvent(worker, 0, KvBlockStored(block_hashes=hashes)))
    assert s.anticipated.block_count(worker) == 0
    assert s.anticipated.stats()["confirmed"] == 4
    assert overlaps(s, prompt(2), [worker])[worker] == 4  # now from the index


def test_a_request_that_fails_before_its_first_output_drops_what_it_brought() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    s.free("a")  # failed, cancelled or refused before any output
    assert s.anticipated.block_count(worker) == 0
    assert s.anticipated.stats()["dropped"] == 4
    assert overlaps(s, prompt(2), [1, 2]) == {1: 0, 2: 0}


def test_a_failure_keeps_blocks_another_request_in_flight_holds() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    assert s.schedule("b", prompt(2), [1, 2]).worker_id == worker  # pinned by "a"
    s.free("a")  # "a" fails; "b" still computes the same prefix there
    assert s.anticipated.block_count(worker) == 4


def test_a_retried_request_moves_its_anticipation() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    first = s.schedule("a", prompt(1), [1, 2]).worker_id
    other = 3 - first
    assert s.schedule("a", prompt(1), [other]).worker_id == other  # re-placed
    assert s.anticipated.block_count(first) == 0
    assert s.anticipated.block_count(other) == 4


def test_anticipation_expires_without_confirmation() -> None:
    clock = FakeClock()
    s = scheduler(clock, CachePrediction(ttl_s=2.0))
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    s.mark_prefill_completed("a", 1)
    s.free("a")
    clock.now += 1.9
    assert overlaps(s, prompt(2), [worker])[worker] == 4
    clock.now += 0.2
    assert s.anticipated.stats()["blocks"] == 0  # expired blocks are not reported
    assert overlaps(s, prompt(2), [worker])[worker] == 0


def test_confirmed_blocks_are_not_written_down_again() -> None:
    """Blocks the events reported are the index's: an eviction event must be able to
    remove them, which an anticipation entry would hide for its TTL."""
    clock = FakeClock()
    s = scheduler(clock)
    hashes = compute_block_hashes(prompt(1), B)
    s.apply_event(RouterEvent(1, 0, KvBlockStored(block_hashes=hashes)))
    assert s.schedule("a", prompt(2), [1, 2]).worker_id == 1
    assert s.anticipated.block_count(1) == 0


def test_a_cleared_cache_keeps_nothing_anticipated() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    s.apply_event(RouterEvent(worker, 0, KvAllCleared()))
    assert s.anticipated.block_count(worker) == 0


def test_remove_worker_forgets_its_anticipation() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    s.remove_worker(worker)
    assert s.anticipated.block_count(worker) == 0


def test_the_debug_view_shows_anticipation() -> None:
    clock = FakeClock()
    s = scheduler(clock)
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    state = s.debug_state()
    assert state["kv_events"] is True
    assert state["anticipated"]["blocks"] == 4 and state["anticipated"]["added"] == 4
    assert state["workers"][f"{worker:016x}"]["anticipated_blocks"] == 4


# ----------------------------------------------------------------------------- approximate


def test_approximate_mode_follows_its_own_decisions_until_the_ttl() -> None:
    clock = FakeClock()
    s = scheduler(clock, CachePrediction(kv_events=False))
    worker = s.schedule("a", prompt(1), [1, 2]).worker_id
    s.mark_prefill_completed("a", 1)
    s.free("a")
    clock.now += 60.0
    assert s.schedule("b", prompt(2), [1, 2]).worker_id == worker  # renews the prefix
    s.mark_prefill_completed("b", 1)
    s.free("b")
    clock.now += DEFAULT_APPROXIMATE_TTL_S - 1.0  # 119 s after "b", 179 s after "a"
    assert overlaps(s, prompt(3), [worker])[worker] == 4
    clock.now += 2.0
    assert overlaps(s, prompt(3), [worker])[worker] == 0  # the index expired
