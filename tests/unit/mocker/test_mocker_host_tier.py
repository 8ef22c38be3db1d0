"""The mocker's second KV tier: eviction into host memory, its LRU, loading back (onboarding)
and its cost, and the KV events of each move."""

from __future__ import annotations

from pathlib import Path

import pytest
from mocker_support import FAST, EventLog, collect, config, prompt, request

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.protocols import KvBlockRemoved, KvBlockStored, KvMedium
from dynamo.mocker import MockEngine, TimingModel
from dynamo.mocker.args import parse_args
from dynamo.mocker.host_tier import HostTier
from dynamo.mocker.kv_cache import KvBlockPool
from dynamo.mocker.model_info import ModelInfo

CPU = KvMedium.CPU


def chain(n: int, offset: int = 0) -> list[int]:
    return compute_block_hashes(list(range(offset, offset + 4 * n)), 4)


def released_chain(size: int, n: int, host_blocks: int) -> tuple[KvBlockPool, list[int]]:
    """A pool of `size` device blocks (and a host tier) that computed `chain(n)` for a
    request that has finished: the chain is cached and evictable."""
    pool = KvBlockPool(size, host_blocks=host_blocks)
    a = chain(n)
    pool.allocate(n)
    pool.commit(a, None)
    pool.release(a)
    pool.take_events()
    return pool, a


# --------------------------------------------------------------------------- the pool


def test_an_evicted_block_moves_to_the_host_tier_with_its_events() -> None:
    pool, a = released_chain(4, 3, host_blocks=8)
    assert pool.allocate(3)  # one free block, then two evictions: the chain's tail first
    assert pool.take_events() == [
        KvBlockRemoved(block_hashes=[a[2], a[1]]),
        KvBlockStored(block_hashes=[a[2]], parent_hash=a[1], medium=CPU),
        KvBlockStored(block_hashes=[a[1]], parent_hash=a[0], medium=CPU),
    ]
    assert pool.host is not None and len(pool.host) == 2
    assert not pool.is_cached(a[1]), "no longer on the device"
    assert pool.match_prefix(a) == 3, "but still a prefix hit, through the host tier"


def test_the_host_tier_drops_its_least_recently_used_block_when_full() -> None:
    pool, a = released_chain(4, 3, host_blocks=1)
    assert pool.allocate(3)
    assert pool.take_events() == [
        KvBlockRemoved(block_hashes=[a[2], a[1]]),
        KvBlockStored(block_hashes=[a[2]], parent_hash=a[1], medium=CPU),
        KvBlockRemoved(block_hashes=[a[2]], medium=CPU),  # dropped: gone from the worker
        KvBlockStored(block_hashes=[a[1]], parent_hash=a[0], medium=CPU),
    ]
    assert pool.match_prefix(a) == 2
    assert pool.host is not None and pool.host.stats.dropped == 1


def test_a_host_tier_hit_is_loaded_back_into_device_blocks() -> None:
    pool, a = released_chain(4, 3, host_blocks=8)
    pool.allocate(3)
    pool.free(3)
    pool.take_events()
    # Loading a[1] and a[2] back needs two device blocks besides a[0]'s.
    assert pool.can_allocate(1, reusing=a)
    assert not pool.can_allocate(2, reusing=a)
    assert pool.acquire(a) == 2
    assert [pool.refcount(h) for h in a] == [1, 1, 1]
    assert pool.take_events() == [KvBlockStored(block_hashes=[a[1], a[2]], parent_hash=a[0])]
    assert pool.host is not None and a[1] in pool.host, "the host copy stays"
    pool.release(a)
    assert pool.allocate(3)  # evicting them again: already on host, only removed here
    events = pool.take_events()
    assert all(not isinstance(e, KvBlockStored) for e in events)


def test_clear_empties_the_host_tier_too() -> None:
    pool, a = released_chain(4, 3, host_blocks=8)
    pool.allocate(3)
    pool.free(3)
    assert pool.clear()
    assert pool.match_prefix(a) == 0
    assert pool.host is not None and len(pool.host) == 0


def test_no_host_tier_without_prefix_caching_or_blocks() -> None:
    assert KvBlockPool(4, host_blocks=0).host is None
    assert KvBlockPool(4, enable_prefix_caching=False, host_blocks=8).host is None
    with pytest.raises(ValueError):
        HostTier(0)


# --------------------------------------------------------------------------- the engine

ONBOARDED: list[int] = []


class RecordingTiming(TimingModel):
    """`FAST`, recording the tokens each step loads back (the cost it is charged)."""

    def onboard_seconds(self, tokens: int) -> float:
        if tokens:
            ONBOARDED.append(tokens)
        return super().onboard_seconds(tokens)


async def run_a_b_a(**overrides: object) -> tuple[MockEngine, EventLog, int]:
    """Prompt a, then b (which evicts a from the device), then a again: the cached tokens
    of the second a."""
    log = EventLog()
    engine = await MockEngine(
        config(num_gpu_blocks=12, max_model_len=40, **overrides), on_kv_events=log
    ).start()
    a, b = prompt(32, 100), prompt(32, 300)
    try:
        await collect(engine, request("a", a, max_tokens=4))
        await collect(engine, request("b", b, max_tokens=4))
        again = await collect(engine, request("a2", a, max_tokens=1))
    finally:
        await engine.stop()
    usage = again[-1].completion_usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return engine, log, usage.prompt_tokens_details.cached_tokens


async def test_a_prefix_evicted_to_the_host_tier_is_onboarded_and_counted_as_cached() -> None:
    _, _, without = await run_a_b_a()
    assert without < 28
    ONBOARDED.clear()
    timing = RecordingTiming(speed_up=FAST.speed_up, quantum_ms=0)
    engine, log, cached = await run_a_b_a(kv_host_blocks=32, timing=timing)
    assert cached == 28, "all 7 full blocks of the 32-token prompt but the last token's"
    onboarded = engine.counters.onboarded_tokens
    assert 0 < onboarded <= 28 and onboarded % 4 == 0
    assert engine.counters.cached_prompt_tokens >= cached
    assert sum(ONBOARDED) == onboarded, "the step that admits it pays for the copy"
    a_hashes = set(compute_block_hashes(prompt(32, 100), 4))
    to_host = {
        h
        for e in log.events
        if isinstance(e, KvBlockStored) and e.medium is CPU
        for h in e.block_hashes
    }
    assert to_host & a_hashes, "a's evicted blocks were announced stored on the host tier"
    back = [e for e in log.events if isinstance(e, KvBlockStored) and e.medium is KvMedium.GPU]
    assert set(back[-1].block_hashes) <= a_hashes, "and loaded back on the device"


def test_loading_back_costs_less_than_computing() -> None:
    timing = TimingModel()
    assert timing.kv_onboard_ms_per_token < timing.prefill_ms_per_token
    assert timing.onboard_seconds(1000) == pytest.approx(1000 * 0.005 / 1000)
    assert TimingModel(speed_up=10).onboard_seconds(1000) == pytest.approx(0.0005)
    with pytest.raises(ValueError):
        TimingModel(kv_onboard_ms_per_token=-1)


def test_the_flags_reach_the_engine_config() -> None:
    args = parse_args(["--kv-host-blocks", "64", "--kv-onboard-ms-per-token", "0.002"])
    cfg = args.engine.engine_config(ModelInfo(Path("."), 500, (2,), frozenset({0, 1, 2}), 8192))
    assert (cfg.kv_host_blocks, cfg.timing.kv_onboard_ms_per_token) == (64, 0.002)
    assert parse_args([]).engine.kv_host_blocks == 0
