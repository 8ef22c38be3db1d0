"""Router decisions on the frontend's `/metrics`: every placement the engine client makes
is reported once, with its kind (new, retry before any output, migration after tokens)
and the KV router's expected overlap, and lands in
`dynamo_frontend_router_decisions_total` / `dynamo_frontend_router_overlap_blocks_total`
under the worker's hex instance id (the dashboard's router panels read these)."""

from __future__ import annotations

from typing import Any

from frontend_support import FakeClient

from dynamo.frontend.engine.client import (
    PLACEMENT_MIGRATION,
    PLACEMENT_NEW,
    PLACEMENT_RETRY,
    RuntimeEngineClient,
)
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.llm.protocols import (
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    RoutingHints,
    StopConditions,
)
from dynamo.llm.router import Router
from dynamo.runtime import InstanceGoneError

DONE = LLMEngineOutput(token_ids=[7], finish_reason=FinishReason.EOS)


class OverlapRouter(Router):
    """Picks the highest candidate and records an overlap, as the KV router does."""

    def __init__(self, overlap: int | None) -> None:
        self.overlap = overlap

    async def select(self, request: PreprocessedRequest, instance_ids: Any) -> int:
        if self.overlap is not None:
            request.routing = RoutingHints(overlap_blocks=self.overlap)
        return max(instance_ids)


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="req", model="m", token_ids=[1, 2], stop_conditions=StopConditions(max_tokens=3)
    )


async def _run(fake: FakeClient, router: Router, **kwargs: Any) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []
    client = RuntimeEngineClient(fake, router, on_routed=lambda *a: seen.append(a), **kwargs)
    [_ async for _ in client.generate(_request())]
    return seen


async def test_a_first_placement_is_reported_with_the_routers_overlap() -> None:
    seen = await _run(FakeClient([[DONE]]), OverlapRouter(overlap=5))
    assert seen == [("m", 2, PLACEMENT_NEW, 5)]


async def test_a_router_without_overlap_reports_none() -> None:
    seen = await _run(FakeClient([[DONE]]), OverlapRouter(overlap=None))
    assert seen == [("m", 2, PLACEMENT_NEW, None)]


async def test_a_worker_lost_before_output_counts_a_retry_then_a_migration_after_tokens() -> None:
    fake = FakeClient(
        [[InstanceGoneError(3)], [LLMEngineOutput(token_ids=[9]), InstanceGoneError(2)], [DONE]],
        ids=[1, 2, 3],
    )
    seen = await _run(fake, OverlapRouter(overlap=None), migration_limit=1)
    assert [(inst, kind) for _, inst, kind, _ in seen] == [
        (3, PLACEMENT_NEW),
        (2, PLACEMENT_RETRY),
        (1, PLACEMENT_MIGRATION),
    ]


def test_metrics_count_decisions_per_worker_and_sum_overlap_only_when_known() -> None:
    metrics = FrontendMetrics()
    metrics.routed("backend", "m", 0xAB, PLACEMENT_NEW, 4)
    metrics.routed("backend", "m", 0xAB, PLACEMENT_NEW, 2)
    metrics.routed("prefill", "m", 0xCD, PLACEMENT_RETRY, None)
    registry = metrics.registry
    worker_ab = {"model": "m", "component": "backend", "worker": f"{0xAB:016x}"}
    assert (
        registry.get_sample_value(
            "dynamo_frontend_router_decisions_total", {**worker_ab, "placement": "new"}
        )
        == 2
    )
    assert registry.get_sample_value("dynamo_frontend_router_overlap_blocks_total", worker_ab) == 6
    worker_cd = {"model": "m", "component": "prefill", "worker": f"{0xCD:016x}"}
    assert (
        registry.get_sample_value(
            "dynamo_frontend_router_decisions_total", {**worker_cd, "placement": "retry"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("dynamo_frontend_router_overlap_blocks_total", worker_cd) is None
    )
