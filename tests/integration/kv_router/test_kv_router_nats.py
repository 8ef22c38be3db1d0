"""The KV router's NATS feeds against a real nats-server, fed by vLLM's real ZMQ publisher.

Path under test: vLLM `ZmqEventPublisher` → worker relay (`dynamo.vllm.serving.publishers`) →
JetStream (`dyn_kv_events`) → `create_kv_router` on a separate runtime → indexer →
`select`. Claims: blocks a worker stores are routed to; removals are forgotten; a router
started after the events replays them; a worker that leaves loses its blocks, and a dead
worker's history replayed later is dropped; a restarted relay purges the old history; load
reports reach the cost function.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from kv_support import (
    COMPONENT,
    ENDPOINT,
    B,
    SimWorker,
    events_arrive,
    new_namespace,
    prompt,
)

from dynamo.llm.kv_router import KvRouter, WorkerScore, create_kv_router
from dynamo.llm.kv_router.publisher import LoadPublisher
from dynamo.llm.kv_router.subjects import KV_EVENTS_STREAM, kv_events_subject
from dynamo.llm.protocols import (
    KvAllCleared,
    LoadMetrics,
    PreprocessedRequest,
    RouterEvent,
    decode,
)
from dynamo.runtime import Client, DistributedRuntime
from dynamo.testing.runtimes import connected_runtime
from dynamo.testing.waiting import wait_until_async


@pytest.fixture
def namespace() -> str:
    return new_namespace()


@pytest.fixture
async def frontend_rt(nats_url: str) -> AsyncIterator[DistributedRuntime]:
    async with connected_runtime(nats_url, lease_ttl=1.0, drain_timeout=1.0) as runtime:
        yield runtime


@pytest.fixture
async def workers(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[list[SimWorker]]:
    started = [
        await SimWorker.start(nats_url, namespace, tmp_path),
        await SimWorker.start(nats_url, namespace, tmp_path),
    ]
    try:
        yield started
    finally:
        for worker in started:
            await worker.leave()


async def client_for(runtime: DistributedRuntime, namespace: str, count: int) -> Client:
    client = await runtime.namespace(namespace).component(COMPONENT).endpoint(ENDPOINT).client()
    await client.wait_for_instances(10, min_count=count)
    return client


@asynccontextmanager
async def routing_to(
    runtime: DistributedRuntime, worker: SimWorker, count: int
) -> AsyncIterator[tuple[Client, KvRouter]]:
    """A client that sees `count` instances of the workers' endpoint and a KV router for
    `worker`'s model over it, closed on exit."""
    client = await client_for(runtime, worker.namespace, count)
    router = await create_kv_router(runtime, worker.card(), client)
    try:
        yield client, router
    finally:
        await router.close()


@pytest.fixture
async def routed(
    frontend_rt: DistributedRuntime, workers: list[SimWorker]
) -> AsyncIterator[tuple[Client, KvRouter]]:
    """`routing_to` both workers, for the first one's model, before anything is stored."""
    async with routing_to(frontend_rt, workers[0], 2) as opened:
        yield opened


def request(request_id: str, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(request_id=request_id, model="sim", token_ids=tokens)


def blocks_of(router: KvRouter, worker: SimWorker) -> int:
    return router.scheduler.indexer.block_count(worker.instance_id)


def scores_by_worker(
    router: KvRouter, tokens: list[int], workers: list[SimWorker]
) -> dict[int, WorkerScore]:
    """The router's cost breakdown for `tokens` on each of `workers`, by instance id."""
    scored = router.scheduler.score(tokens, [w.instance_id for w in workers])
    return {score.worker_id: score for score in scored}


def load_seen(router: KvRouter, worker: SimWorker) -> dict[str, Any]:
    """The load the router last heard `worker` report (its `/debug/kv` view)."""
    return router.debug_state()["workers"][f"{worker.instance_id:016x}"]["load"]


async def test_stored_blocks_attract_requests_and_removed_ones_are_forgotten(
    workers: list[SimWorker], routed: tuple[Client, KvRouter]
) -> None:
    (a, b), (client, router) = workers, routed
    tokens = prompt(6)
    vllm_hashes = a.store(tokens)
    await events_arrive(lambda: blocks_of(router, a) == 6, "the router to index a's 6 blocks")
    index = router.scheduler.indexer
    assert index.find_matches_for_tokens(tokens).scores == {a.instance_id: 6}

    # Shares 4 blocks with what `a` caches, then diverges: `a` is cheaper.
    shared = request("r1", tokens[: 4 * B] + [90_000 + i for i in range(2 * B)])
    assert await router.select(shared, client.instance_ids()) == a.instance_id
    assert shared.routing is not None and shared.routing.overlap_blocks == 4
    # Nothing cached anywhere, and `a` now carries r1's blocks: `b` wins.
    fresh = request("r2", prompt(6, offset=50_000))
    assert await router.select(fresh, client.instance_ids()) == b.instance_id
    router.on_finished("r1")
    router.on_finished("r2")

    a.remove(vllm_hashes[3:])  # evicting a block evicts its descendants' matches
    await events_arrive(
        lambda: blocks_of(router, a) == 3, "the router to forget a's 3 evicted blocks"
    )
    assert index.find_matches_for_tokens(tokens).scores == {a.instance_id: 3}
    feed = router.debug_state()["feed"]
    assert feed["events"] >= 4 and feed["events_malformed"] == 0


async def test_a_router_started_later_rebuilds_the_index_from_the_stream(
    frontend_rt: DistributedRuntime, workers: list[SimWorker]
) -> None:
    a, b = workers
    a.store(prompt(5))
    a.store(prompt(3, offset=7_000))
    b.store(prompt(2, offset=9_000))
    await a.wait_relayed()
    await b.wait_relayed()

    async with routing_to(frontend_rt, a, 2) as (client, router):
        # No waiting: create_kv_router returns once the replay has caught up.
        assert blocks_of(router, a) == 8 and blocks_of(router, b) == 2
        assert router.debug_state()["feed"]["replay_complete"] is True
        late = request("late", [*prompt(5), 1, 2, 3])
        assert await router.select(late, client.instance_ids()) == a.instance_id
        assert late.routing is not None and late.routing.overlap_blocks == 5
        router.on_finished("late")


async def test_a_worker_that_leaves_loses_its_blocks(
    workers: list[SimWorker], routed: tuple[Client, KvRouter]
) -> None:
    (a, b), (_, router) = workers, routed
    tokens = prompt(4)
    a.store(tokens)
    b.store(tokens)
    await events_arrive(
        lambda: blocks_of(router, a) == 4 and blocks_of(router, b) == 4,
        "the router to index 4 blocks of each worker",
    )

    await a.leave()
    index = router.scheduler.indexer
    await events_arrive(
        lambda: a.instance_id not in index.workers(), "the router to drop the worker that left"
    )
    assert index.find_matches_for_tokens(tokens).scores == {b.instance_id: 4}
    assert router.debug_state()["feed"]["workers_removed"] == 1


async def test_history_of_a_dead_worker_is_dropped_after_replay(
    frontend_rt: DistributedRuntime, namespace: str, workers: list[SimWorker]
) -> None:
    a, b = workers
    tokens = prompt(4)
    a.store(tokens)
    b.store(tokens)
    await a.wait_relayed()
    await b.wait_relayed()
    await a.leave()  # its events stay in the stream; its instance record is gone

    client = await client_for(frontend_rt, namespace, 1)
    await events_arrive(
        lambda: client.instance_ids() == [b.instance_id], "the client to see only the live worker"
    )
    router = await create_kv_router(frontend_rt, b.card(), client, grace_s=0.3)
    try:
        index = router.scheduler.indexer
        await wait_until_async(
            lambda: a.instance_id not in index.workers(),
            timeout=5,
            what="the replayed history of the dead worker to be dropped",
        )
        assert index.find_matches_for_tokens(tokens).scores == {b.instance_id: 4}
    finally:
        await router.close()


async def test_a_restarted_relay_purges_the_workers_old_events(
    frontend_rt: DistributedRuntime, namespace: str, workers: list[SimWorker]
) -> None:
    a, _ = workers
    a.store(prompt(4))
    await a.wait_relayed()
    assert a.relay is not None
    await a.relay.stop()
    # Same worker id, new relay (as after an engine restart under the same runtime).
    await a.start_relay()
    subject = kv_events_subject(namespace, COMPONENT, a.instance_id)
    info = await frontend_rt.js.stream_info(KV_EVENTS_STREAM, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}
    last = await frontend_rt.js.get_last_msg(KV_EVENTS_STREAM, subject)
    assert isinstance(decode(last.data, RouterEvent).data, KvAllCleared)

    async with routing_to(frontend_rt, a, 2) as (_, router):
        assert blocks_of(router, a) == 0


async def test_load_reports_reach_the_cost_function(
    frontend_rt: DistributedRuntime, namespace: str, workers: list[SimWorker]
) -> None:
    a, b = workers
    reported = LoadMetrics(worker_id=a.instance_id, active_blocks=40, total_blocks=100)
    publisher = await LoadPublisher(
        a.runtime, namespace, COMPONENT, a.instance_id, lambda: reported
    ).start()
    try:
        async with routing_to(frontend_rt, a, 2) as (_, router):
            await events_arrive(
                lambda: router.debug_state()["feed"]["load_reports"] > 0,
                "a load report to reach the router",
            )
            tokens = prompt(3, offset=123)
            scores = scores_by_worker(router, tokens, workers)
            assert scores[a.instance_id].active_blocks == scores[b.instance_id].active_blocks + 40
            view = load_seen(router, a)
            assert view["active_blocks"] == 40 and view["total_blocks"] == 100

            reported = LoadMetrics(worker_id=a.instance_id, active_blocks=0, total_blocks=100)
            await wait_until_async(
                lambda: load_seen(router, a)["active_blocks"] == 0,
                timeout=3,
                what="the router to see a's load drop to 0",
            )
            scores = scores_by_worker(router, tokens, workers)
            assert scores[a.instance_id].cost == scores[b.instance_id].cost
    finally:
        await publisher.stop()
