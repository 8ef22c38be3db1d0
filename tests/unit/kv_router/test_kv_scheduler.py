"""KvScheduler / KvRouter: overlap wins, speculation looks fuller, temperature samples."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from kv_cards import BLOCK_SIZE, worker_card

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.router import build_kv_router
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.scheduler_defaults import DEFAULT_OVERLAP_SCORE_WEIGHT
from dynamo.llm.kv_router.selection import WorkerScore, choose, softmax_weights
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec
from dynamo.llm.protocols import (
    KvBlockStored,
    LLMEngineOutput,
    LoadMetrics,
    PreprocessedRequest,
    RouterEvent,
    RoutingHints,
    SpeculativeInfo,
)
from dynamo.llm.router import Router
from dynamo.testing.clocks import FakeClock

B = BLOCK_SIZE
PROMPT = list(range(1000, 1064))  # exactly 4 blocks


def cache_on(scheduler: KvScheduler, worker: int, tokens: list[int], event_id: int = 0) -> None:
    hashes = compute_block_hashes(tokens, B)
    scheduler.apply_event(RouterEvent(worker, event_id, KvBlockStored(block_hashes=hashes)))


def request(rid: str, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(request_id=rid, model="m", token_ids=tokens)


async def test_picks_the_worker_with_the_cached_prefix() -> None:
    router = build_kv_router(worker_card(1), rng=random.Random(0))
    router.update_card(worker_card(2))
    cache_on(router.scheduler, 2, PROMPT)
    req = request("r1", [*PROMPT, 7, 8, 9])
    assert await router.select(req, [1, 2]) == 2
    assert req.routing == RoutingHints(backend_instance_id=2, overlap_blocks=4)
    scores = {s.worker_id: s for s in router.scheduler.score(req.token_ids, [1, 2])}
    assert (scores[1].overlap_blocks, scores[1].prefill_blocks) == (0, 5)
    assert (scores[2].overlap_blocks, scores[2].prefill_blocks) == (4, 1)


async def test_select_keeps_existing_routing_hints() -> None:
    router = build_kv_router(worker_card(1))
    req = request("r1", PROMPT)
    req.routing = RoutingHints(prefill_instance_id=9)
    await router.select(req, [1])
    assert req.routing == RoutingHints(
        backend_instance_id=1, prefill_instance_id=9, overlap_blocks=0
    )


def test_deeper_speculation_looks_fuller() -> None:
    scheduler = KvScheduler(B, rng=random.Random(0))
    scheduler.update_worker(KvWorkerSpec(1, B))
    scheduler.update_worker(
        KvWorkerSpec(2, B, SpeculativeInfo(method="eagle3", num_speculative_tokens=4))
    )
    scores = {s.worker_id: s for s in scheduler.score(PROMPT, [1, 2])}
    assert scores[1].active_blocks == 4  # 64 tokens, no slots ahead
    assert scores[2].active_blocks == 5  # ceil((64 + 4) / 16)
    assert scores[2].cost > scores[1].cost
    picks = set()
    for i in range(20):  # identical (empty) caches, so only the slots decide
        picks.add(scheduler.schedule(f"r{i}", PROMPT, [1, 2]).worker_id)
        scheduler.free(f"r{i}")
    assert picks == {1}
    # With requests in flight, the speculating worker's books include its slots.
    scheduler.schedule("a", PROMPT, [2])
    scheduler.schedule("b", [*PROMPT[1:], 5], [1])
    loads = scheduler.sequences.loads()
    assert (loads[1].active_blocks, loads[2].active_blocks) == (4, 5)


def test_a_worker_that_recomputes_a_hits_last_block_is_credited_one_block_less() -> None:
    """vLLM drops the last block of a prefix hit for Eagle-family drafters (the card's
    `drops_last_prefix_block`): the router predicts the blocks the engine reuses."""
    scheduler = KvScheduler(B, rng=random.Random(0))
    eagle = SpeculativeInfo("eagle3", 2, drops_last_prefix_block=True)
    scheduler.update_worker(KvWorkerSpec(1, B, SpeculativeInfo("ngram", 2)))
    scheduler.update_worker(KvWorkerSpec(2, B, eagle))
    for worker in (1, 2):
        cache_on(scheduler, worker, PROMPT, event_id=worker)
    scores = {s.worker_id: s for s in scheduler.score([*PROMPT, 7], [1, 2])}
    assert (scores[1].overlap_blocks, scores[1].prefill_blocks) == (4, 1)
    assert (scores[2].overlap_blocks, scores[2].prefill_blocks) == (3, 2)
    assert scores[2].cached_blocks == 3


def test_load_spreads_when_no_cache_matches() -> None:
    scheduler = KvScheduler(B, overlap_score_weight=1.0, rng=random.Random(1))
    picks = Counter(
        scheduler.schedule(f"r{i}", [i * 1000 + t for t in range(40)], [1, 2, 3]).worker_id
        for i in range(30)
    )
    assert picks == Counter({1: 10, 2: 10, 3: 10})
    assert {load.active_requests for load in scheduler.sequences.loads().values()} == {10}


def test_a_prefix_in_flight_attracts_requests_sharing_it() -> None:
    """Before its first KV event arrives, a prefix being prefilled on a worker counts as
    overlap there, so a burst of requests sharing it does not split over workers."""
    scheduler = KvScheduler(B, overlap_score_weight=1.0, rng=random.Random(3))
    for group in range(10):
        prefix = [group * 10_000 + t for t in range(8 * B)]
        first = scheduler.schedule(f"g{group}a", [*prefix, 1, 2, 3], [1, 2])
        second = scheduler.schedule(f"g{group}b", [*prefix, 4, 5, 6], [1, 2])
        assert second.worker_id == first.worker_id
        assert (first.overlap_blocks, second.overlap_blocks) == (0, 8)
        scheduler.free(f"g{group}a")
        scheduler.free(f"g{group}b")


def test_overlap_weight_trades_cache_hits_for_balance() -> None:
    scheduler = KvScheduler(B, overlap_score_weight=1.0, rng=random.Random(2))
    cache_on(scheduler, 1, PROMPT)
    for i in range(3):  # load worker 1 with unrelated requests: 3 x 4 blocks
        scheduler.schedule(f"busy{i}", [50_000 + i * 100 + t for t in range(64)], [1])
    # Worker 1: 1 * 0 + (12 + 4) = 16; worker 2: 1 * 4 + 4 = 8 -> balance wins.
    assert scheduler.schedule("x", PROMPT, [1, 2]).worker_id == 2
    scheduler.free("x")
    scheduler.overlap_score_weight = 5.0  # worker 1: 16, worker 2: 24 -> cache wins
    assert scheduler.schedule("y", PROMPT, [1, 2]).worker_id == 1


def test_the_default_weight_keeps_a_tenant_on_its_home_worker_busy_with_another() -> None:
    """The case behind the default of 2.0: a tenant's home worker runs one request of
    another tenant, a second worker is idle. Home: 1 block to prefill, 18 active (9 of
    the other request, 9 of this one): w + 18. Idle: 9 blocks to prefill, 9 active:
    9w + 9. At w = 1 the idle worker wins (18 < 19) and the prefix is computed a second
    time, evicting some other tenant's; at 2.0 the home wins (20 < 27)."""
    home = [70_000 + t for t in range(8 * B)]
    other = [80_000 + t for t in range(8 * B)]
    for weight, expected in ((1.0, 2), (DEFAULT_OVERLAP_SCORE_WEIGHT, 1)):
        scheduler = KvScheduler(B, overlap_score_weight=weight, rng=random.Random(0))
        cache_on(scheduler, 1, home)
        scheduler.schedule("other", [*other, 5], [1])
        scores = {s.worker_id: s.cost for s in scheduler.score([*home, 6], [1, 2])}
        assert scores == {1: 1 * weight + 18, 2: 9 * weight + 9}
        assert scheduler.schedule("mine", [*home, 6], [1, 2]).worker_id == expected


def test_ties_are_broken_at_random() -> None:
    scheduler = KvScheduler(B, rng=random.Random(3))
    picks = Counter()
    for i in range(200):
        picks[scheduler.schedule(f"r{i}", PROMPT, [1, 2]).worker_id] += 1
        scheduler.free(f"r{i}")
    assert set(picks) == {1, 2}
    assert 60 < picks[1] < 140


def test_softmax_weights_follow_the_formula() -> None:
    weights = softmax_weights([10.0, 20.0, 30.0], temperature=0.5)
    expected = [math.exp(-x / 0.5) for x in (0.0, 0.5, 1.0)]
    total = sum(expected)
    assert weights == pytest.approx([e / total for e in expected])
    assert softmax_weights([3.0, 3.0], 1.0) == [0.5, 0.5]
    hot = softmax_weights([10.0, 20.0, 30.0], temperature=10.0)
    assert max(hot) - min(hot) < max(weights) - min(weights)  # higher T is flatter
    with pytest.raises(ValueError):
        softmax_weights([1.0], 0.0)


def test_temperature_sampling_matches_the_distribution() -> None:
    scores = [WorkerScore(w, 0, 0, 0, 0, cost) for w, cost in ((1, 10.0), (2, 20.0), (3, 30.0))]
    rng = random.Random(4)
    draws = Counter(choose(scores, 0.5, rng).worker_id for _ in range(20_000))
    expected = softmax_weights([10.0, 20.0, 30.0], 0.5)
    for worker, p in zip((1, 2, 3), expected, strict=True):
        assert draws[worker] / 20_000 == pytest.approx(p, abs=0.015)
    assert {choose(scores, 0.0, rng).worker_id for _ in range(50)} == {1}


def test_recent_load_metrics_add_unbooked_load() -> None:
    clock = FakeClock(now=0.0)
    scheduler = KvScheduler(B, rng=random.Random(5), clock=clock, load_metrics_ttl_s=5)
    scheduler.update_load(LoadMetrics(worker_id=1, active_blocks=50))
    assert scheduler.schedule("a", PROMPT, [1, 2]).worker_id == 2
    scheduler.free("a")
    clock.now = 10.0  # the report is stale now: back to a tie
    scores = scheduler.score(PROMPT, [1, 2])
    assert scores[0].cost == scores[1].cost


def test_a_report_older_than_a_release_is_not_charged() -> None:
    """A worker's report taken while our request still ran must not count that request's
    blocks once we released it (they would look like another frontend's load)."""
    clock = FakeClock(now=0.0)
    scheduler = KvScheduler(B, rng=random.Random(6), clock=clock)
    scheduler.schedule("a", PROMPT, [1])
    scheduler.update_load(LoadMetrics(worker_id=1, active_blocks=4))  # counts "a"
    clock.now = 0.1
    scheduler.free("a")
    scores = scheduler.score(PROMPT, [1, 2])
    assert scores[0].cost == scores[1].cost, "the report predates the release"
    clock.now = 0.7
    scheduler.update_load(LoadMetrics(worker_id=1, active_blocks=30))  # fresh: other load
    scores = scheduler.score(PROMPT, [1, 2])
    assert scores[0].active_blocks == scores[1].active_blocks + 30


async def test_router_lifecycle_releases_books() -> None:
    router = build_kv_router(worker_card(1, k=2))
    assert isinstance(router, Router)
    req = request("r", PROMPT)
    await router.select(req, [1])
    seqs = router.scheduler.sequences.get(1)
    assert seqs is not None
    assert (seqs.active_blocks, seqs.prefill_tokens) == (5, 64)  # ceil(66/16)
    router.on_first_output("r", LLMEngineOutput(token_ids=[1]))
    assert seqs.prefill_tokens == 0 and seqs.active_blocks == 5
    router.on_finished("r")
    router.on_finished("r")  # a second call is harmless
    assert (seqs.active_blocks, seqs.active_requests) == (0, 0)
    await router.close()


async def test_retried_request_is_rebooked_not_leaked() -> None:
    router = build_kv_router(worker_card(1))
    await router.select(request("r", PROMPT), [1])
    await router.select(request("r", PROMPT), [1])
    seqs = router.scheduler.sequences.get(1)
    assert seqs is not None and seqs.active_requests == 1
    router.on_finished("r")
    assert seqs.active_blocks == 0


async def test_feeds_apply_events_cards_and_metrics() -> None:
    async def source() -> AsyncIterator[object]:
        yield worker_card(2, k=3)
        yield RouterEvent(2, 0, KvBlockStored(block_hashes=compute_block_hashes(PROMPT, B)))
        yield "garbage"  # logged and skipped, the feed keeps going
        yield LoadMetrics(worker_id=1, active_blocks=1)

    router = build_kv_router(worker_card(1))
    await asyncio.wait_for(router.feed(source()), 1.0)  # type: ignore[arg-type]
    assert router.scheduler.indexer.find_matches_for_tokens(PROMPT).scores == {2: 4}
    assert router.scheduler.speculative_depth_of(2, 1) == 3
    await router.close()
    with pytest.raises(RuntimeError):
        router.feed(source())  # type: ignore[arg-type]


async def test_close_cancels_endless_feeds() -> None:
    never = asyncio.Event()

    async def endless() -> AsyncIterator[RouterEvent]:
        await never.wait()
        yield RouterEvent(1, 0, KvBlockStored(block_hashes=[]))

    router = build_kv_router(worker_card(1))
    task = router.feed(endless())
    await router.close()
    assert task.cancelled()


def test_remove_worker_forgets_cache_and_books() -> None:
    scheduler = KvScheduler(B)
    cache_on(scheduler, 1, PROMPT)
    scheduler.schedule("a", PROMPT, [1])
    scheduler.remove_worker(1)
    assert scheduler.indexer.find_matches_for_tokens(PROMPT).scores == {}
    assert scheduler.sequences.get(1) is None
    assert not scheduler.free("a")


class Attachment:
    name = "feed"

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    def debug_state(self) -> dict[str, object]:
        return {"events": 3}


async def test_debug_state_reports_cache_load_and_predicted_hits() -> None:
    router = build_kv_router(worker_card(1), rng=random.Random(0))
    router.update_card(worker_card(2))
    cache_on(router.scheduler, 1, PROMPT)
    router.update_load(LoadMetrics(worker_id=2, active_blocks=7, total_blocks=100))
    attachment = Attachment()
    router.attach(attachment)
    hit = request("hit", PROMPT)
    assert await router.select(hit, [1, 2]) == 1

    state = router.debug_state()
    one, two = state["workers"][f"{1:016x}"], state["workers"][f"{2:016x}"]
    assert (one["cached_blocks"], one["active_requests"]) == (4, 1)
    assert one["routed"] == {
        "requests": 1,
        "request_blocks": 4,
        "overlap_blocks": 4,
        "host_blocks": 0,
        "disk_blocks": 0,
        "hit_rate": 1.0,
    }
    assert one["cached_blocks_by_tier"] == {"GPU": 4, "CPU": 0, "STORAGE": 0}
    assert state["tier_weights"] == {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}
    assert two["cached_blocks"] == 0 and two["load"]["active_blocks"] == 7
    assert state["routing"]["hit_rate"] == 1.0 and state["unique_blocks"] == 4
    assert state["feed"] == {"events": 3}

    await router.close()
    assert attachment.closed, "close() closes what the router owns"


def test_an_adaptive_workers_reported_k_rebooks_its_requests_in_flight() -> None:
    """An adaptive worker (`--speculation-adapt`) says the K in force in its load reports:
    the speculative slots booked for its requests follow it, and a worker whose card does
    not adapt keeps the card's K whatever its reports say."""
    scheduler = KvScheduler(B, rng=random.Random(0))
    adaptive = SpeculativeInfo(
        method="ngram", num_speculative_tokens=3, schedule=[[1, 64, 3]], adaptive=True
    )
    scheduler.update_worker(KvWorkerSpec(1, B, adaptive))
    scheduler.update_worker(KvWorkerSpec(2, B, SpeculativeInfo("ngram", 3)))
    prompt = list(range(2000, 2000 + 3 * B - 1))  # 4 blocks with K >= 2, 3 with K = 0
    scheduler.schedule("a", prompt, [1])
    scheduler.schedule("b", prompt, [2])
    books = {w: scheduler.sequences.get(w) for w in (1, 2)}
    assert books[1].active_blocks == books[2].active_blocks == 4  # the schedule's K = 3
    for k, blocks in ((0, 3), (2, 4), (0, 3)):
        for worker in (1, 2):
            scheduler.update_load(LoadMetrics(worker_id=worker, num_speculative_tokens=k))
        assert scheduler.speculative_depth_of(1) == k
        assert books[1].get("a").num_speculative_tokens == k
        assert books[1].active_blocks == blocks
        assert scheduler.speculative_depth_of(2) == 3 and books[2].active_blocks == 4
    scheduler.schedule("c", [*prompt, 1, 2], [1])  # booked at the K in force
    assert books[1].get("c").num_speculative_tokens == 0
    scheduler.update_load(LoadMetrics(worker_id=1, num_speculative_tokens=9))
    assert scheduler.speculative_depth_of(1) == 3  # capped at the card's static K
    scheduler.update_load(LoadMetrics(worker_id=1))  # a report without K changes nothing
    assert scheduler.speculative_depth_of(1) == 3
