"""Two frontend replicas in kv mode share their bookings over a real nats-server.

Claims: with replica sync (the default), a tenant workload sent alternately to two
frontends over three mocker workers reaches the prefix hit rate (the workers' own
`usage.prompt_tokens_details.cached_tokens`) and the load spread of one frontend serving
the same workload; each replica sees the other; and the sync is what makes a burst
spread: when one replica has two requests in flight on two of four idle workers, the
other replica sends its next two to the other two workers, round after round, while
without sync (`--no-router-replica-sync`) it is blind to them and, within a few rounds,
sends one to a busy worker.

Frontends and mockers run on the test's event loop (in-loop frontends, each with its own
NATS connection, as separate processes would have); the mockers run at real speed (8 ms
a step), so requests sent together are in flight together.

Workers report their load after each engine step, as vLLM's stats come (and once a
heartbeat), so a router also learns of another replica's requests from the workers, one
step after they arrive. Whether such a report reaches replica B before B places its burst
is a race on a busy machine, so the burst test holds the reports: its mockers always
report themselves idle (`IdleReportingMocker`), and what B knows of A's requests is only
what the sync tells it. A's requests are held too: long enough to outlast any delay, and
cancelled once B's are done, so they are in flight whenever B places.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.service import FrontendConfig
from dynamo.llm.protocols import LoadMetrics
from dynamo.mocker.args import WorkerSettings
from dynamo.mocker.backend import MockerBackend, mocker_worker
from dynamo.mocker.timing import TimingModel
from dynamo.runtime.ports import free_port
from dynamo.testing.frontends import InLoopFrontend
from dynamo.testing.http import fetch_json, wait_for_instances_async
from dynamo.testing.mocker_stacks import mock_engine_config
from dynamo.testing.waiting import wait_until_async

MODEL = "smollm2-replicas"
TENANTS = [f"tenant{i}" for i in range(6)]
ROUNDS = 4
ARRIVAL_GAP_S = 0.03
"""Between two requests of a round: arrivals spread as real traffic, not one instant."""
TENANT_MAX_TOKENS = 64
"""About half a second at real speed: every request of a round is still in flight when
the round's last one arrives, so placements follow the books (load, pinned prefixes),
not ties between idle workers."""
HELD_MAX_TOKENS = 1200
"""A's burst requests would run for about 10 s: they are cancelled once B's are done, so
they are in flight whenever B places, however slow the machine."""
BURST_ROUNDS = 8
"""Without sync, each round spreads perfectly only if B's tie-break among four idle
workers happens to pick the two A did not: probability 1/6, so all eight rounds do with
probability below 1e-6."""


class IdleReportingMocker(MockerBackend):
    """A mocker whose load reports always say it is idle (its heartbeat still goes out):
    a router learns nothing of the requests another replica sent it from the worker."""

    def load_metrics(self, worker_id: int) -> LoadMetrics:
        pool = self.engine.pool
        return LoadMetrics(worker_id=worker_id, total_blocks=pool.num_blocks)

    def watch_load(self, changed: Callable[[], None]) -> None:
        """No report after a step: only the heartbeat, which says idle."""


@dataclass
class Stack:
    frontends: list[str]  # base URLs
    key: str  # the workers' endpoint in /debug/kv


@asynccontextmanager
async def replica_stack(
    nats_url: str,
    model_path: Path,
    tokenizer_cache: Path,
    *,
    workers: int,
    frontends: int,
    replica_sync: bool = True,
    timing: TimingModel = TimingModel(),
    idle_reports: bool = False,
) -> AsyncIterator[Stack]:
    """`workers` mockers and `frontends` kv-mode frontends in a namespace of their own;
    with `idle_reports`, mockers whose load reports always say idle."""
    namespace = "rsync" + uuid.uuid4().hex[:8]
    settings = WorkerSettings(namespace=namespace, nats_server=nats_url, lease_ttl=10.0)
    mockers = []
    for i in range(workers):
        engine_config = mock_engine_config(model_path, timing=timing)
        worker = mocker_worker(
            settings, engine_config, model_path=model_path, served_model_name=MODEL, name=f"m{i}"
        )
        if idle_reports:
            worker.backend = IdleReportingMocker(
                engine_config, speculative_method=settings.speculative_method
            )
        mockers.append(worker)
    async with AsyncExitStack() as stack:
        for worker in mockers:
            await worker.start()
            stack.push_async_callback(worker.stop, drain_timeout=1.0)
        bases = []
        for _ in range(frontends):
            frontend = InLoopFrontend(
                FrontendConfig(
                    http=HttpSettings(host="127.0.0.1", port=free_port()),
                    router=RouterSettings(mode=RouterMode.KV, replica_sync=replica_sync),
                    namespace=namespace,
                    nats_server=nats_url,
                    tokenizer_cache=tokenizer_cache,
                )
            )
            stack.push_async_callback(frontend.stop)
            bases.append(frontend.base_url)
        key = f"{namespace}/backend/generate"
        for base in bases:
            await wait_for_instances_async(base, MODEL, workers, timeout=60, interval=0.05)
            await wait_until_async(
                lambda base=base: sees_workers(base, key, workers),
                timeout=30,
                what=f"{base}'s kv router to see {workers} workers",
            )
        yield Stack(bases, key)


async def debug_state(base: str, key: str) -> dict[str, Any]:
    return (await fetch_json(f"{base}/debug/kv"))["models"][MODEL][key]


async def sees_workers(base: str, key: str, count: int) -> bool:
    try:
        return len((await debug_state(base, key))["feed"]["live_workers"]) == count
    except KeyError:  # no router yet
        return False


async def routed(stack: Stack) -> dict[str, int]:
    """Requests sent to each worker, summed over every frontend's router."""
    total: dict[str, int] = {}
    for base in stack.frontends:
        for worker, view in (await debug_state(base, stack.key))["workers"].items():
            total[worker] = total.get(worker, 0) + view["routed"]["requests"]
    return total


async def books_hold(base: str, key: str, count: int) -> bool:
    """Whether this frontend's books hold `count` requests in flight (its own and, with
    sync, the other replica's)."""
    workers = (await debug_state(base, key))["workers"].values()
    return sum(view["active_requests"] for view in workers) == count


def tenant_prompt(tenant: str, question: str) -> str:
    """A long shared prefix per tenant (about 20 blocks of 16 tokens), then a question."""
    facts = " ".join(f"{tenant}-fact-{i}" for i in range(60))
    return f"You answer for {tenant}. Known facts: {facts}.\nQuestion: {question}\nAnswer:"


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


async def run_tenant_workload(stack: Stack) -> tuple[float, dict[str, int]]:
    """Every tenant once per round, arrivals `ARRIVAL_GAP_S` apart, request i of the
    whole workload to frontend i mod N. Returns the workers' prefix hit rate (cached over
    prompt tokens) and the requests each worker got."""
    clients = [client(base) for base in stack.frontends]
    prompt_tokens = cached_tokens = 0
    try:
        sent = 0
        for round_ in range(ROUNDS):
            tasks = []
            for tenant in TENANTS:
                target = clients[sent % len(clients)]
                sent += 1
                tasks.append(
                    asyncio.ensure_future(
                        target.completions.create(
                            model=MODEL,
                            prompt=tenant_prompt(tenant, f"What is fact {round_}?"),
                            max_tokens=TENANT_MAX_TOKENS,
                        )
                    )
                )
                await asyncio.sleep(ARRIVAL_GAP_S)
            for response in await asyncio.gather(*tasks):
                usage = response.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                prompt_tokens += usage.prompt_tokens
                cached_tokens += usage.prompt_tokens_details.cached_tokens or 0
    finally:
        for c in clients:
            await c.close()
    return cached_tokens / prompt_tokens, await routed(stack)


async def test_two_replicas_match_one_frontend(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with replica_stack(
        nats_url, embedded_model, tmp_path / "tok", workers=3, frontends=1
    ) as one:
        hit_one, spread_one = await run_tenant_workload(one)
    async with replica_stack(
        nats_url, embedded_model, tmp_path / "tok", workers=3, frontends=2
    ) as two:
        hit_two, spread_two = await run_tenant_workload(two)
        states = [await debug_state(base, two.key) for base in two.frontends]
    sync = [state["replica_sync"] for state in states]
    assert list(sync[0]["replicas"]) == [sync[1]["replica_id"]]
    assert list(sync[1]["replicas"]) == [sync[0]["replica_id"]]
    assert all(s["changes_in"] > 0 and s["rejected"] == 0 for s in sync), sync
    total = len(TENANTS) * ROUNDS
    assert sum(spread_one.values()) == sum(spread_two.values()) == total
    # A tenant's first request misses, its later ones find its prefix: (ROUNDS-1)/ROUNDS
    # of the prefix, about 0.7 of the prompt tokens.
    assert hit_one > 0.6, hit_one
    assert abs(hit_two - hit_one) <= 0.05, (hit_one, hit_two)
    # Tenants stay on their worker: each worker serves two tenants, every round.
    per_tenant = ROUNDS
    assert sorted(spread_one.values()) == [2 * per_tenant] * 3, spread_one
    assert sorted(spread_two.values()) == sorted(spread_one.values()), (spread_one, spread_two)


def send(target: openai.AsyncOpenAI, tag: str, max_tokens: int = 20) -> asyncio.Future[Any]:
    """A request with a prompt of its own (no prefix shared with any other), in flight
    for its prefill and `max_tokens` decode steps."""
    prompt = tenant_prompt(f"burst-{tag}", tag)
    return asyncio.ensure_future(
        target.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    )


async def burst_collisions(stack: Stack, *, wait_for_sync: bool) -> list[int]:
    """Rounds of: replica A has two requests (distinct prompts) in flight, then replica B
    sends two. Returns, per round, the most requests any one worker got."""
    a, b = stack.frontends
    clients = [client(a), client(b)]
    worst = []
    try:
        for round_ in range(BURST_ROUNDS):
            before = await routed(stack)
            first = [send(clients[0], f"{round_}-{tag}", HELD_MAX_TOKENS) for tag in ("a1", "a2")]
            await wait_until_async(
                lambda: books_hold(a, stack.key, 2), timeout=10, what="A's burst", interval=0.005
            )
            if wait_for_sync:
                await wait_until_async(
                    lambda: books_hold(b, stack.key, 2),
                    timeout=5,
                    what="B to see A's burst",
                    interval=0.005,
                )
            second = [send(clients[1], f"{round_}-b1"), send(clients[1], f"{round_}-b2")]
            await asyncio.gather(*second)
            for request in first:  # held until B's are placed and done: cancelled now
                request.cancel()
            await asyncio.gather(*first, return_exceptions=True)
            after = await routed(stack)
            worst.append(max(after[w] - before.get(w, 0) for w in after))
            for base in (a, b):  # every booking released before the next round
                await wait_until_async(
                    lambda base=base: books_hold(base, stack.key, 0),
                    timeout=10,
                    what="books to empty",
                )
    finally:
        for c in clients:
            await c.close()
    return worst


async def test_sync_is_what_spreads_a_burst_over_idle_workers(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with replica_stack(
        nats_url, embedded_model, tmp_path / "tok", workers=4, frontends=2, idle_reports=True
    ) as synced:
        with_sync = await burst_collisions(synced, wait_for_sync=True)
    async with replica_stack(
        nats_url,
        embedded_model,
        tmp_path / "tok",
        workers=4,
        frontends=2,
        replica_sync=False,
        idle_reports=True,
    ) as blind:
        states = [await debug_state(base, blind.key) for base in blind.frontends]
        assert all("replica_sync" not in state for state in states)
        without_sync = await burst_collisions(blind, wait_for_sync=False)
    assert with_sync == [1] * BURST_ROUNDS, with_sync
    assert max(without_sync) == 2, (with_sync, without_sync)
