"""KV cache tiers in the router: the indexer's per-tier books, the tier-weighted overlap
the scheduler scores with, and the weights' way from the frontend's flags."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kv_cards import BLOCK_SIZE, worker_card

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.indexer import KvIndexer
from dynamo.llm.kv_router.router import build_kv_router
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.tiers import TierMatch, TierWeights
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvMedium,
    PreprocessedRequest,
    RouterEvent,
)

B = 4
HASHES = compute_block_hashes(list(range(1, 21)), B)  # 5 full blocks
GPU, CPU, DISK = KvMedium.GPU, KvMedium.CPU, KvMedium.STORAGE


def stored(worker: int, event_id: int, hashes: list[int], medium: KvMedium = GPU) -> RouterEvent:
    return RouterEvent(worker, event_id, KvBlockStored(block_hashes=hashes, medium=medium))


def removed(worker: int, event_id: int, hashes: list[int], medium: KvMedium = GPU) -> RouterEvent:
    return RouterEvent(worker, event_id, KvBlockRemoved(block_hashes=hashes, medium=medium))


# --------------------------------------------------------------------------- indexer


def test_a_block_may_be_held_in_two_tiers_and_leaves_them_one_by_one() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(stored(1, 1, HASHES[3:], CPU))  # offloaded copies of the tail
    assert index.tiers_of(1, HASHES[4]) == {GPU, CPU}
    assert index.tier_counts(1) == {"GPU": 5, "CPU": 2, "STORAGE": 0}
    assert index.block_count(1) == 5, "a block in two tiers is one block"
    index.apply(removed(1, 2, HASHES[3:]))  # evicted from the device, kept on host
    assert index.tiers_of(1, HASHES[4]) == {CPU}
    assert index.holders(HASHES[4]) == {1}
    scores = index.find_matches(HASHES)
    assert scores.get(1) == 5, "the match runs on through the host tier"
    assert scores.device_blocks(1) == 3
    assert scores.tier_match(1) == TierMatch((GPU, GPU, GPU, CPU, CPU))
    index.apply(removed(1, 3, HASHES[4:], CPU))  # dropped from the host tier too
    assert index.holders(HASHES[4]) == set()
    assert index.find_matches(HASHES).get(1) == 4
    assert index.tier_counts(1) == {"GPU": 3, "CPU": 1, "STORAGE": 0}


def test_a_block_loaded_back_to_the_device_counts_as_on_the_device() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES, CPU))
    assert index.find_matches(HASHES).device_blocks(1) == 0
    index.apply(stored(1, 1, HASHES[:2]))  # onboarded
    scores = index.find_matches(HASHES)
    assert (scores.get(1), scores.device_blocks(1)) == (5, 2)
    index.apply(stored(1, 2, HASHES[2:]))
    scores = index.find_matches(HASHES)
    assert scores.tier_match(1) is None, "all on the device: no per-block tiers to report"


def test_removal_from_a_tier_that_does_not_hold_the_block_is_ignored() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES))
    index.apply(removed(1, 1, HASHES, CPU))
    assert index.find_matches(HASHES).scores == {1: 5}
    assert index.stats.removals_ignored == 5


def test_a_workers_match_may_start_in_one_tier_and_go_on_in_another() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES[:1], DISK))
    index.apply(stored(1, 1, HASHES[1:3]))
    index.apply(stored(2, 0, HASHES))
    scores = index.find_matches(HASHES)
    assert scores.scores == {1: 3, 2: 5}
    assert scores.tier_match(1) == TierMatch((DISK, GPU, GPU))
    assert scores.tier_match(2) is None


def test_clear_and_leaving_forget_every_tier() -> None:
    index = KvIndexer(B)
    index.apply(stored(1, 0, HASHES[:2]))
    index.apply(stored(1, 1, HASHES[2:], CPU))
    index.apply(RouterEvent(1, 2, KvAllCleared()))
    assert index.find_matches(HASHES).scores == {}
    assert index.tier_counts(1) == {"GPU": 0, "CPU": 0, "STORAGE": 0}
    index.apply(stored(1, 3, HASHES, DISK))
    index.remove_worker(1)
    assert index.find_matches(HASHES).scores == {} and index.num_unique_blocks() == 0


def test_tier_match_weighs_each_block_by_its_tier() -> None:
    match = TierMatch((GPU, CPU, CPU, DISK))
    weights = TierWeights(host=0.5, disk=0.25)
    assert match.device_prefix == 1
    assert match.weighted(weights) == pytest.approx(1 + 0.5 + 0.5 + 0.25)
    value = weights.value(match, device=1, matched=4)
    assert value == (pytest.approx(2.25), 2, 1)
    assert weights.value(None, device=3, matched=3) == (3.0, 0, 0)
    with pytest.raises(ValueError, match="host"):
        TierWeights(host=1.5)


# --------------------------------------------------------------------------- scoring

PROMPT = list(range(1000, 1064))  # 4 blocks of the cards' 16 tokens
PROMPT_HASHES = compute_block_hashes(PROMPT, BLOCK_SIZE)


def tiered_scheduler(tier_weights: TierWeights | None = None) -> KvScheduler:
    """Worker 1 holds the prompt on its device, 2 on host memory only, 3 on disk only,
    4 nothing."""
    scheduler = KvScheduler(BLOCK_SIZE, tier_weights=tier_weights, rng=random.Random(0))
    scheduler.apply_event(stored(1, 0, PROMPT_HASHES))
    scheduler.apply_event(stored(2, 0, PROMPT_HASHES))
    scheduler.apply_event(stored(2, 1, PROMPT_HASHES, CPU))
    scheduler.apply_event(removed(2, 2, PROMPT_HASHES))  # evicted to the host tier
    scheduler.apply_event(stored(3, 0, PROMPT_HASHES, DISK))
    return scheduler


def test_a_host_tier_hit_scores_between_a_device_hit_and_a_miss() -> None:
    scores = {s.worker_id: s for s in tiered_scheduler().score(PROMPT, [1, 2, 3, 4])}
    device, host, disk, miss = scores[1], scores[2], scores[3], scores[4]
    assert device.cost < host.cost < disk.cost < miss.cost
    assert (device.prefill_blocks, host.prefill_blocks) == (0.0, pytest.approx(4 * 0.25))
    assert disk.prefill_blocks == pytest.approx(4 * 0.75)
    assert miss.prefill_blocks == 4
    # overlap_blocks stays the device-tier count; the other tiers are counted apart.
    assert (host.overlap_blocks, host.host_blocks, host.disk_blocks) == (0, 4, 0)
    assert (disk.overlap_blocks, disk.host_blocks, disk.disk_blocks) == (0, 0, 4)
    assert (device.overlap_blocks, device.weighted_overlap, device.host_blocks) == (4, 4.0, 0)
    assert host.weighted_overlap == pytest.approx(3.0)


def test_the_weights_decide_the_cost_of_an_offloaded_hit() -> None:
    free = tiered_scheduler(TierWeights(host=1.0, disk=0.0))
    scores = {s.worker_id: s for s in free.score(PROMPT, [1, 2, 3, 4])}
    assert scores[2].cost == scores[1].cost, "host weight 1: as good as a device hit"
    assert scores[3].cost == scores[4].cost, "disk weight 0: no better than a miss"


def test_a_routed_request_books_its_offloaded_blocks_as_coming_to_the_device() -> None:
    """The worker loads the prefix back into its device tier: the router's books and its
    anticipation say so, and the tally counts the host blocks apart from device hits."""
    scheduler = tiered_scheduler()
    decision = scheduler.schedule("r", PROMPT, [2, 4])
    assert (decision.worker_id, decision.overlap_blocks) == (2, 0)
    assert scheduler.anticipated.block_count(2) == 4
    routed = scheduler.debug_state()["workers"][f"{2:016x}"]["routed"]
    assert (routed["overlap_blocks"], routed["host_blocks"]) == (0, 4)


def test_offloaded_stores_do_not_confirm_anticipated_device_blocks() -> None:
    scheduler = KvScheduler(BLOCK_SIZE)
    scheduler.schedule("r", PROMPT, [1])
    scheduler.apply_event(stored(1, 0, PROMPT_HASHES, CPU))
    assert scheduler.anticipated.block_count(1) == 4
    scheduler.apply_event(stored(1, 1, PROMPT_HASHES))
    assert scheduler.anticipated.block_count(1) == 0


def test_the_router_chooses_the_host_tier_holder_over_an_idle_empty_worker() -> None:
    router = build_kv_router(worker_card(2), rng=random.Random(0))
    router.update_card(worker_card(4))
    router.apply_event(stored(2, 0, PROMPT_HASHES, CPU))
    request = PreprocessedRequest(request_id="r", model="m", token_ids=PROMPT)
    assert router.scheduler.schedule("r", request.token_ids, [2, 4]).worker_id == 2


# --------------------------------------------------------------------------- flags


async def test_the_frontend_flags_reach_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo.frontend.__main__ import build_parser, config_from_args
    from dynamo.frontend.engine import routing

    built: dict[str, Any] = {}

    async def fake_create_kv_router(runtime: object, card: Any, client: object, **kw: Any):
        kw.pop("replica_sync")
        router = build_kv_router(card, **kw)
        built["router"] = router
        return router

    monkeypatch.setattr(routing, "create_kv_router", fake_create_kv_router)
    args = build_parser().parse_args(
        "--router-mode kv --kv-host-tier-weight 0.5 --kv-disk-tier-weight 0.1".split()
    )
    settings = config_from_args(args).router
    unused = object()
    await routing.make_router_factory(settings, unused)(worker_card(1), unused)  # type: ignore[arg-type]
    assert built["router"].scheduler.tier_weights == TierWeights(host=0.5, disk=0.1)


def test_the_tier_weight_flags_default_to_dynamos_and_refuse_values_above_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dynamo.frontend.__main__ import build_parser, config_from_args

    settings = config_from_args(build_parser().parse_args([])).router
    assert (settings.kv_host_tier_weight, settings.kv_disk_tier_weight) == (0.75, 0.25)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-host-tier-weight", "1.5"])
    assert "--kv-host-tier-weight" in capsys.readouterr().err


def test_a_tier_weight_of_zero_is_accepted_on_the_command_line() -> None:
    """0 is the documented "no better than a miss" (the benchmark's router-blind setup)."""
    from dynamo.frontend.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--kv-host-tier-weight", "0", "--kv-disk-tier-weight", "0"])
    settings = config_from_args(args).router
    assert (settings.kv_host_tier_weight, settings.kv_disk_tier_weight) == (0.0, 0.0)
