"""`KvBlockPool`: private blocks, prefix hits, deduplication, LRU eviction and its events."""

from __future__ import annotations

import pytest

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.protocols import KvAllCleared, KvBlockRemoved, KvBlockStored
from dynamo.mocker.kv_cache import KvBlockPool


def chain(n: int, offset: int = 0) -> list[int]:
    return compute_block_hashes(list(range(offset, offset + 4 * n)), 4)


def released_chain(size: int, n: int) -> tuple[KvBlockPool, list[int]]:
    """A pool of `size` blocks that computed `chain(n)` for a request that has finished:
    the chain is cached and evictable."""
    pool = KvBlockPool(size)
    a = chain(n)
    pool.allocate(n)
    pool.commit(a, None)
    pool.release(a)
    return pool, a


def test_commit_turns_private_blocks_into_announced_cached_blocks() -> None:
    pool = KvBlockPool(8)
    assert pool.allocate(3)
    hashes = chain(2)
    pool.commit(hashes, None)
    assert (pool.private_blocks, pool.cached_blocks, pool.active_blocks) == (1, 2, 3)
    assert pool.take_events() == [KvBlockStored(block_hashes=hashes, parent_hash=None)]
    assert pool.take_events() == []
    assert pool.match_prefix(chain(3)) == 2


def test_released_blocks_stay_cached_until_space_is_needed_then_go_tail_first() -> None:
    pool, a = released_chain(4, 3)
    pool.take_events()
    assert (pool.active_blocks, pool.evictable_blocks, pool.free_blocks) == (0, 3, 1)
    assert pool.usage == 0.0
    assert pool.allocate(2)  # one free block, then one eviction: the chain's tail
    assert pool.take_events() == [KvBlockRemoved(block_hashes=[a[2]])]
    assert pool.match_prefix(a) == 2
    assert pool.allocate(2)
    assert pool.take_events() == [KvBlockRemoved(block_hashes=[a[1], a[0]])]
    assert not pool.allocate(1)  # everything is private now
    assert pool.match_prefix(a) == 0


def test_referenced_blocks_are_never_evicted() -> None:
    pool, a = released_chain(3, 2)
    pool.acquire(a[:1])  # a new request reuses the first block
    assert not pool.can_allocate(3)
    assert pool.can_allocate(2)
    assert not pool.can_allocate(2, reusing=a[1:])  # pinning a[1] removes it from evictable
    assert pool.allocate(2)
    assert pool.is_cached(a[0]) and not pool.is_cached(a[1])
    assert pool.refcount(a[0]) == 1


def test_identical_blocks_computed_twice_are_stored_once() -> None:
    pool = KvBlockPool(8)
    a = chain(2)
    pool.allocate(4)
    pool.commit(a, None)  # request 1
    pool.commit(a, None)  # request 2 computed the same prompt concurrently
    assert (pool.cached_blocks, pool.private_blocks) == (2, 0)
    assert pool.used_blocks == 2  # the duplicates were freed
    assert [h for e in pool.take_events() for h in e.block_hashes] == a
    assert pool.refcount(a[0]) == 2


def test_consecutive_events_are_merged_per_chain() -> None:
    pool = KvBlockPool(8)
    a, b = chain(3), chain(1, offset=500)
    pool.allocate(4)
    pool.commit(a[:1], None)
    pool.commit(a[1:], a[0])
    pool.commit(b, None)
    assert pool.take_events() == [
        KvBlockStored(block_hashes=a, parent_hash=None),
        KvBlockStored(block_hashes=b, parent_hash=None),
    ]


def test_clear_is_refused_while_blocks_are_referenced() -> None:
    pool = KvBlockPool(8)
    a = chain(2)
    pool.allocate(2)
    pool.commit(a, None)
    assert not pool.clear()
    pool.release(a)
    pool.take_events()
    assert pool.clear()
    assert pool.take_events() == [KvAllCleared()]
    assert pool.cached_blocks == 0 and pool.free_blocks == 8


def test_disabled_prefix_caching_never_hits() -> None:
    pool = KvBlockPool(8, enable_prefix_caching=False)
    assert pool.match_prefix(chain(2)) == 0
    pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.commit(chain(1), None)


def test_bad_counts_are_refused() -> None:
    pool = KvBlockPool(2)
    with pytest.raises(ValueError):
        pool.free(1)
    with pytest.raises(ValueError):
        pool.commit(chain(1), None)
    with pytest.raises(ValueError):
        KvBlockPool(0)
