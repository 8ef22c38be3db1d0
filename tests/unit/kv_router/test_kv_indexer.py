"""KvIndexer: events in, per-worker leading overlap out."""

from __future__ import annotations

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.indexer import KvIndexer
from dynamo.llm.protocols import KvAllCleared, KvBlockRemoved, KvBlockStored, RouterEvent

B = 4
PROMPT = list(range(1, 21))  # 5 full blocks
HASHES = compute_block_hashes(PROMPT, B)


def stored(worker: int, event_id: int, hashes: list[int]) -> RouterEvent:
    return RouterEvent(worker, event_id, KvBlockStored(block_hashes=hashes))


def removed(worker: int, event_id: int, hashes: list[int]) -> RouterEvent:
    return RouterEvent(worker, event_id, KvBlockRemoved(block_hashes=hashes))


def test_overlap_counts_leading_blocks_per_worker() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(stored(2, 0, HASHES[:2]))
    scores = index.find_matches_for_tokens(PROMPT)
    assert scores.scores == {1: 5, 2: 2}
    assert scores.best() == 5
    assert scores.get(3) == 0
    # A prompt sharing only the first two blocks matches at most two on anyone.
    other = PROMPT[:8] + [99] * 12
    assert index.find_matches_for_tokens(other).scores == {1: 2, 2: 2}


def test_partial_last_block_is_never_matched() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    assert index.find_matches_for_tokens(PROMPT[:11]).scores == {1: 2}


def test_only_leading_matches_count() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES[1:]))  # everything but the first block
    assert index.find_matches(HASHES).scores == {}
    index.apply(stored(1, 1, HASHES[:1]))  # the ancestor arrives late
    assert index.find_matches(HASHES).scores == {1: 5}


def test_remove_cuts_the_match_at_the_removed_block() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(removed(1, 1, [HASHES[2]]))
    assert index.find_matches(HASHES).scores == {1: 2}
    assert index.block_count(1) == 4
    index.apply(removed(1, 2, [12345]))  # never stored: ignored
    assert index.stats.removals_ignored == 1


def test_clear_forgets_blocks_but_keeps_the_worker() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(stored(2, 0, HASHES))
    index.apply(RouterEvent(1, 1, KvAllCleared()))
    assert index.find_matches(HASHES).scores == {2: 5}
    assert 1 in index.workers() and index.block_count(1) == 0
    assert index.holders(HASHES[0]) == {2}


def test_remove_worker_releases_its_bit_for_reuse() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(stored(2, 0, HASHES[:1]))
    index.remove_worker(1)
    assert index.workers() == [2]
    assert index.find_matches(HASHES).scores == {2: 1}
    index.apply(stored(3, 0, HASHES[:3]))  # takes worker 1's old bit
    assert index.find_matches(HASHES).scores == {2: 1, 3: 3}
    assert index.num_unique_blocks() == 3


def test_stale_event_ids_are_dropped_and_clear_restarts_the_sequence() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 5, HASHES[:2]))
    index.apply(removed(1, 5, HASHES[:2]))  # replayed duplicate id: ignored
    assert index.find_matches(HASHES).scores == {1: 2}
    assert index.stats.events_stale == 1
    # A restarted relay begins again at 0 with a clear, then counts up.
    index.apply(RouterEvent(1, 0, KvAllCleared()))
    index.apply(stored(1, 1, HASHES[:1]))
    assert index.find_matches(HASHES).scores == {1: 1}


def test_store_is_idempotent() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(stored(1, 1, HASHES))
    assert index.block_count(1) == 5
    assert index.stats.blocks_stored == 5
