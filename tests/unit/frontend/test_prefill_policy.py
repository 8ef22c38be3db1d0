"""Conditional disaggregation: the per-request decision (`DisaggSettings.decide`), the
routers' previews it reads, and `DisaggregatedEngineClient` acting on it."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from dynamo.frontend.engine.disagg import DisaggregatedEngineClient
from dynamo.frontend.engine.prefill_policy import (
    DisaggSettings,
    PrefillDecision,
    PrefillMode,
    PrefillReason,
)
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.llm.kv_router.busy import BusyThresholds
from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.router import KvRouter, build_kv_router
from dynamo.llm.protocols import (
    FinishReason,
    KvBlockStored,
    LLMEngineOutput,
    LoadMetrics,
    ModelCard,
    PreprocessedRequest,
    RouterEvent,
    SamplingOptions,
)
from dynamo.llm.router import PlacementPreview
from dynamo.testing.engines import InMemoryEngineClient

BLOCK = 16
SETTINGS = DisaggSettings(local_prefill_tokens=100, prefill_queue_tokens=1000)


def preview(cached: int = 0, queued: int = 0) -> PlacementPreview:
    return PlacementPreview(worker_id=1, cached_tokens=cached, queued_prefill_tokens=queued)


@pytest.mark.parametrize(
    ("prompt", "decode", "prefill", "reason"),
    [
        (100, preview(), preview(), PrefillReason.SHORT_PROMPT),  # at the threshold
        (101, preview(), preview(), PrefillReason.LONG_PROMPT),
        (500, preview(cached=400), preview(), PrefillReason.CACHED_ON_DECODE),
        (500, preview(cached=399), preview(), PrefillReason.LONG_PROMPT),
        (500, preview(queued=999), preview(queued=1000), PrefillReason.PREFILL_POOL_BUSY),
        (500, preview(queued=1000), preview(queued=5000), PrefillReason.LONG_PROMPT),
        (500, preview(), preview(queued=999), PrefillReason.LONG_PROMPT),
        (500, None, None, PrefillReason.LONG_PROMPT),  # routers without books
        (50, None, None, PrefillReason.SHORT_PROMPT),
        (500, None, preview(queued=5000), PrefillReason.LONG_PROMPT),  # decode load unknown
    ],
)
def test_decide(
    prompt: int,
    decode: PlacementPreview | None,
    prefill: PlacementPreview | None,
    reason: PrefillReason,
) -> None:
    decision = SETTINGS.decide(prompt, decode, prefill)
    assert decision.reason is reason
    assert decision.remote is (reason is PrefillReason.LONG_PROMPT)


def test_remote_mode_and_zero_thresholds() -> None:
    remote = DisaggSettings(mode=PrefillMode.REMOTE)
    assert remote.decide(1, preview(cached=1), None).reason is PrefillReason.ALWAYS_REMOTE
    strict = DisaggSettings(local_prefill_tokens=0, prefill_queue_tokens=0)
    assert strict.decide(64, preview(cached=64), None).reason is PrefillReason.CACHED_ON_DECODE
    assert strict.decide(64, preview(cached=63), None).reason is PrefillReason.LONG_PROMPT
    busy = strict.decide(64, preview(), preview(queued=10**6))
    assert busy.reason is PrefillReason.LONG_PROMPT  # 0 turns the queue rule off
    clipped = strict.decide(10, preview(cached=32), None)  # a cache beyond the prompt
    assert clipped.decode_cached_tokens == 10


def card(instance_id: int, component: str) -> ModelCard:
    return ModelCard(
        name="m", namespace="ns", component=component, endpoint="generate",
        instance_id=instance_id, kv_block_size=BLOCK,
    )  # fmt: skip


def kv_router(component: str, *workers: int, busy: BusyThresholds | None = None) -> KvRouter:
    router = build_kv_router(card(workers[0], component), rng=random.Random(0), busy=busy)
    for worker in workers[1:]:
        router.update_card(card(worker, component))
    return router


def request(rid: str, tokens: list[int], n: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=tokens, sampling_options=SamplingOptions(n=n)
    )


def test_kv_preview_books_nothing_and_names_the_cheapest_worker() -> None:
    router = kv_router("backend", 1, 2)
    prompt = list(range(160))  # 10 blocks
    hashes = compute_block_hashes(prompt[:128], BLOCK)
    router.apply_event(RouterEvent(2, 0, KvBlockStored(block_hashes=hashes)))
    seen = router.preview(request("a", prompt), [1, 2])
    assert seen == PlacementPreview(worker_id=2, cached_tokens=128, queued_prefill_tokens=0)
    assert all(load.active_requests == 0 for load in router.scheduler.sequences.loads().values())
    router.scheduler.schedule("b", list(range(1000, 1320)), [1])  # 320 tokens queued on 1
    assert router.preview(request("c", list(range(5000, 5032))), [1]) == PlacementPreview(
        worker_id=1, cached_tokens=0, queued_prefill_tokens=320
    )


def test_kv_preview_of_all_busy_workers_is_marked_busy_without_a_refusal() -> None:
    router = kv_router("backend", 1, busy=BusyThresholds(waiting_requests=1))
    router.update_load(LoadMetrics(worker_id=1, waiting_requests=3))
    seen = router.preview(request("a", list(range(32))), [1])
    assert seen is not None and seen.busy
    assert router.scheduler.busy_refusals == 0


async def answer(req: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
    if req.kv_transfer_params:  # a prefill leg
        yield LLMEngineOutput(finish_reason=FinishReason.LENGTH, disaggregated_params={"x": 1})
        return
    yield LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.EOS)


def disagg(
    decode_router: KvRouter, prefill_router: KvRouter, prefill_ids: list[int] | None = None
) -> tuple[DisaggregatedEngineClient, InMemoryEngineClient, list[PrefillDecision]]:
    decisions: list[PrefillDecision] = []
    prefill = InMemoryEngineClient(answer, prefill_ids or [11], router=prefill_router)
    decode = InMemoryEngineClient(answer, [1, 2], router=decode_router)
    client = DisaggregatedEngineClient(
        prefill, decode, settings=SETTINGS, on_decision=lambda _m, d: decisions.append(d)
    )
    return client, prefill, decisions


async def run(client: DisaggregatedEngineClient, req: PreprocessedRequest) -> None:
    outputs = [o async for o in client.generate(req)]
    assert outputs[-1].token_ids == [7]


async def test_the_client_prefills_remotely_only_what_is_worth_moving() -> None:
    long_prompt = list(range(400))
    decode_router = kv_router("backend", 1, 2)
    client, prefill, decisions = disagg(decode_router, kv_router("prefill", 11))
    await run(client, request("short", list(range(64))))
    await run(client, request("long", long_prompt))
    hashes = compute_block_hashes(long_prompt[:384], BLOCK)
    decode_router.apply_event(RouterEvent(2, 0, KvBlockStored(block_hashes=hashes)))
    await run(client, request("cached", long_prompt))
    await run(client, request("n3", long_prompt, n=3))
    assert [d.reason for d in decisions] == [
        PrefillReason.SHORT_PROMPT,
        PrefillReason.LONG_PROMPT,
        PrefillReason.CACHED_ON_DECODE,
        PrefillReason.MULTIPLE_CHOICES,
    ]
    assert [leg.request_id for leg in prefill.requests] == ["long"]
    assert decisions[2].decode_cached_tokens == 384
    assert client.remote_prefills == 1 and client.local_prefills == 0
    state = client.debug_state()
    assert state["decisions"] == {
        "cached_on_decode": 1, "long_prompt": 1, "n_choices": 1, "short_prompt": 1,
    }  # fmt: skip
    assert state["settings"]["local_prefill_tokens"] == 100


async def test_a_saturated_prefill_pool_hands_prefills_to_idle_decode_workers() -> None:
    prefill_router = kv_router("prefill", 11)
    prefill_router.scheduler.schedule("queued", list(range(9000, 10200)), [11])  # 1200 queued
    client, prefill, decisions = disagg(kv_router("backend", 1, 2), prefill_router)
    await run(client, request("long", list(range(400))))
    assert decisions[0].reason is PrefillReason.PREFILL_POOL_BUSY
    assert (decisions[0].prefill_queue_tokens, decisions[0].decode_queue_tokens) == (1200, 0)
    assert prefill.requests == []


async def test_no_prefill_worker_is_a_decision_and_a_fallback() -> None:
    fallbacks: list[str] = []
    decisions: list[PrefillDecision] = []
    prefill = InMemoryEngineClient(answer, [], router=kv_router("prefill", 11))
    decode = InMemoryEngineClient(answer, [1], router=kv_router("backend", 1))
    client = DisaggregatedEngineClient(
        prefill,
        decode,
        lambda _m, reason: fallbacks.append(reason),
        settings=SETTINGS,
        on_decision=lambda _m, d: decisions.append(d),
    )
    await run(client, request("long", list(range(400))))
    assert [d.reason for d in decisions] == [PrefillReason.NO_PREFILL_WORKER]
    assert fallbacks == ["no prefill worker"] and client.local_prefills == 1


def test_decisions_are_counted_by_placement_and_reason() -> None:
    metrics = FrontendMetrics()
    metrics.prefill_decision("m", SETTINGS.decide(500, None, None))
    metrics.prefill_decision("m", SETTINGS.decide(50, None, None))
    sample = metrics.registry.get_sample_value
    name = "dynamo_frontend_prefill_decisions_total"
    remote = {"model": "m", "placement": "remote", "reason": "long_prompt"}
    local = {"model": "m", "placement": "local", "reason": "short_prompt"}
    assert sample(name, remote) == 1.0 and sample(name, local) == 1.0
