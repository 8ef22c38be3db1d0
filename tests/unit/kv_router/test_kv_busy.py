"""Busy workers in the KV router (`BusyThresholds`): skipped before scoring, and when
every candidate is busy the request is refused (`AllWorkersBusyError`) with nothing booked.

Claims: a worker reporting a KV usage or a waiting queue at a threshold gets no new
request, even one whose prefix it caches; the router's own bookings since the last report
count towards the usage, and those beyond what the worker runs at once towards its
queue (a burst between reports); a report older than the TTL, or none,
never makes a worker busy; thresholds are off by default; all busy refuses, books nothing
and is counted; `KvRouter.select` refuses the same way, for requests without tokens too;
`/debug/kv` shows the thresholds and why each worker is busy.
"""

from __future__ import annotations

import random

import pytest
from kv_cards import BLOCK_SIZE, worker_card

from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.router import build_kv_router
from dynamo.llm.kv_router.scheduler import KvScheduler
from dynamo.llm.kv_router.worker_spec import KvWorkerSpec
from dynamo.llm.protocols import (
    KvBlockStored,
    LoadMetrics,
    PreprocessedRequest,
    RouterEvent,
)
from dynamo.llm.router import AllWorkersBusyError
from dynamo.testing.clocks import FakeClock

B = BLOCK_SIZE
PROMPT = list(range(1000, 1064))  # 4 blocks
TTL_S = 5.0


def scheduler(clock: FakeClock, **busy: float | int | None) -> KvScheduler:
    return KvScheduler(
        B,
        rng=random.Random(0),
        clock=clock,
        load_metrics_ttl_s=TTL_S,
        busy=BusyThresholds(**busy),  # type: ignore[arg-type]
    )


def load(worker: int, *, usage: float = 0.0, waiting: int = 0, total: int = 100) -> LoadMetrics:
    return LoadMetrics(
        worker_id=worker,
        waiting_requests=waiting,
        active_blocks=int(usage * total),
        total_blocks=total,
        kv_usage=usage,
    )


def cache_on(sched: KvScheduler, worker: int, tokens: list[int]) -> None:
    hashes = compute_block_hashes(tokens, B)
    sched.apply_event(RouterEvent(worker, 0, KvBlockStored(block_hashes=hashes)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_usage": 0.0}, "in \\(0, 1\\]"),
        ({"kv_usage": 1.5}, "in \\(0, 1\\]"),
        ({"waiting_requests": 0}, ">= 1"),
    ],
)
def test_thresholds_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BusyThresholds(**kwargs)  # type: ignore[arg-type]


def test_a_worker_over_the_kv_threshold_is_skipped_despite_its_cache() -> None:
    clock = FakeClock()
    sched = scheduler(clock, kv_usage=0.9)
    cache_on(sched, 1, PROMPT)  # worker 1 would win on overlap and on active blocks:
    sched.update_load(load(1, usage=0.95, total=10))  # 9 blocks, but nearly full
    sched.update_load(load(2, usage=0.5))  # 50 blocks
    assert sched.schedule("r", PROMPT, [1, 2]).worker_id == 2
    assert sched.busy_reason(1) == "KV cache 95% full"
    assert sched.busy_reason(2) is None


def test_a_worker_with_a_deep_queue_is_skipped() -> None:
    clock = FakeClock()
    sched = scheduler(clock, waiting_requests=8)
    cache_on(sched, 1, PROMPT)
    sched.update_load(load(1, waiting=8))
    sched.update_load(load(2, waiting=7))
    assert sched.schedule("r", PROMPT, [1, 2]).worker_id == 2
    assert sched.busy_reason(1) == "8 requests waiting"


def test_when_every_worker_is_busy_nothing_is_booked() -> None:
    clock = FakeClock()
    sched = scheduler(clock, kv_usage=0.9, waiting_requests=4)
    sched.update_load(load(1, usage=0.9))
    sched.update_load(load(2, waiting=5))
    with pytest.raises(AllWorkersBusyError, match="all 2 workers are busy") as info:
        sched.schedule("r", PROMPT, [1, 2])
    assert "KV cache 90% full" in str(info.value) and "5 requests waiting" in str(info.value)
    assert sched.sequences.worker_of("r") is None
    assert sched.busy_refusals == 1
    assert sched.routed == {}


def test_the_routers_own_bookings_count_towards_the_usage() -> None:
    """A burst placed between two reports: the report still says 10 %, but the blocks
    booked since fill the worker past the threshold."""
    clock = FakeClock()
    sched = scheduler(clock, kv_usage=0.5)
    sched.update_load(load(1, usage=0.1, total=20))
    sched.update_load(load(2, usage=0.1, total=20))
    placed = [
        sched.schedule(f"r{i}", [i * 1000 + t for t in range(64)], [1, 2]).worker_id
        for i in range(4)
    ]
    assert sorted(placed) == [1, 1, 2, 2]  # 4 blocks each: 8 of 20 booked per worker
    assert sched.busy_reason(1) is None
    sched.schedule("r4", list(range(5000, 5064)), [1])  # 12 of 20 on worker 1
    assert sched.busy_reason(1) == "KV cache 60% full"
    cached = list(range(6000, 6128))  # 8 blocks worker 1 caches: it would win on cost
    cache_on(sched, 1, cached)
    assert sched.schedule("r5", cached, [1, 2]).worker_id == 2


def test_requests_booked_beyond_what_a_worker_runs_at_once_count_as_waiting() -> None:
    """A burst between two reports: the report still says nothing waits, but the worker
    runs 2 requests at once (its card's max_num_seqs) and the router booked a third."""
    clock = FakeClock()
    sched = scheduler(clock, waiting_requests=1)
    sched.update_worker(KvWorkerSpec(1, B, max_num_seqs=2))
    sched.update_load(load(1))
    for i in range(2):
        sched.schedule(f"r{i}", [i * 1000 + t for t in range(64)], [1])
    assert sched.busy_reason(1) is None
    sched.schedule("r2", list(range(5000, 5064)), [1])
    assert sched.busy_reason(1) == "1 requests waiting"
    with pytest.raises(AllWorkersBusyError):
        sched.schedule("r3", list(range(6000, 6064)), [1])
    sched.free("r0")
    assert sched.busy_reason(1) is None


def test_an_old_report_or_none_never_makes_a_worker_busy() -> None:
    clock = FakeClock()
    sched = scheduler(clock, kv_usage=0.5)
    sched.update_load(load(1, usage=1.0))
    clock.now += TTL_S + 0.1
    assert sched.busy_reason(1) is None  # stale
    assert sched.busy_reason(2) is None  # never reported
    assert sched.schedule("r", PROMPT, [1]).worker_id == 1


def test_thresholds_are_off_by_default() -> None:
    sched = KvScheduler(B, rng=random.Random(0))
    sched.update_load(load(1, usage=1.0, waiting=1000))
    assert sched.schedule("r", PROMPT, [1]).worker_id == 1
    assert sched.debug_state()["workers"][f"{1:016x}"]["busy"] is None


@pytest.mark.parametrize("tokens", [PROMPT, []])
async def test_the_router_refuses_when_every_worker_is_busy(tokens: list[int]) -> None:
    router = build_kv_router(worker_card(1), busy=BusyThresholds(kv_usage=0.8))
    router.update_load(load(1, usage=0.85))
    request = PreprocessedRequest(request_id="r", model="m", token_ids=tokens)
    with pytest.raises(AllWorkersBusyError):
        await router.select(request, [1])
    assert request.routing is None
    state = router.debug_state()
    assert state["busy_thresholds"] == {"kv_usage": 0.8, "waiting_requests": None}
    assert state["busy_refusals"] == 1
    assert state["workers"][f"{1:016x}"]["busy"] == "KV cache 85% full"
