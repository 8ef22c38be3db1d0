"""The KV router predicts caches from its own decisions, over a real nats-server with two
simulated (mocker) workers behind an in-loop frontend in `--router-mode kv`.

Claims: two requests of one new prefix sent at once land on the same worker (no events
can have arrived for it yet); with `--no-kv-events` and workers that publish no events,
tenants first spread by load, and every later request of a tenant goes to the worker that
served its first and finds its prefix there (by the router's own books); `GET /debug/kv`
shows the router reading no events and the blocks it anticipates.

The mockers run at real speed (8 ms a step), so requests sent together are in flight
together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai

from dynamo.frontend.engine.routing import RouterMode, RouterSettings
from dynamo.mocker.timing import TimingModel
from dynamo.testing.http import fetch_json, routed_one_more
from dynamo.testing.mocker_clusters import mockers_behind_frontend
from dynamo.testing.mocker_stacks import mock_engine_config

MODEL = "smollm2-anticipation"


@asynccontextmanager
async def kv_stack(
    nats_url: str, model_path: Path, work_dir: Path, *, kv_events: bool
) -> AsyncIterator[tuple[str, str, openai.AsyncOpenAI]]:
    """Two mocker workers (publishing KV events only when `kv_events`) and a kv-mode
    frontend reading them or not, its tokenizer cache in `work_dir`; yields the frontend's
    base URL, the debug key of the workers' endpoint and an official client of the frontend."""
    async with mockers_behind_frontend(
        nats_url,
        model_path,
        work_dir / "tok",
        model=MODEL,
        engine_config=mock_engine_config(model_path, timing=TimingModel()),
        router=RouterSettings(mode=RouterMode.KV, kv_events=kv_events),
        namespace_prefix="antic",
        publish_kv_events=kv_events,
    ) as stack:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.base}/v1", api_key="x", max_retries=0
        ) as client:
            yield stack.base, stack.endpoint_key, client


def tenant_prompt(tenant: str, question: str) -> str:
    """A long shared prefix per tenant (about 20 blocks of 16 tokens), then a question."""
    facts = " ".join(f"{tenant}-fact-{i}" for i in range(60))
    return f"You answer for {tenant}. Known facts: {facts}.\nQuestion: {question}\nAnswer:"


async def complete(client: openai.AsyncOpenAI, prompt: str) -> None:
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)


async def routed(base: str, key: str) -> dict[str, int]:
    """Requests the router sent each worker so far."""
    return requests_of(await debug_state(base, key))


def requests_of(state: dict[str, Any]) -> dict[str, int]:
    return {worker: view["routed"]["requests"] for worker, view in state["workers"].items()}


async def debug_state(base: str, key: str) -> dict[str, Any]:
    return (await fetch_json(f"{base}/debug/kv"))["models"][MODEL][key]


async def test_two_requests_of_a_new_prefix_sent_at_once_share_a_worker(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with kv_stack(nats_url, embedded_model, tmp_path, kv_events=True) as (base, key, client):
        for tenant in ("acme", "globex", "initech"):
            before = await routed(base, key)
            await asyncio.gather(
                complete(client, tenant_prompt(tenant, "What is fact 3?")),
                complete(client, tenant_prompt(tenant, "Which fact comes last?")),
            )
            after = await routed(base, key)
            counts = sorted(after[w] - before.get(w, 0) for w in after)
            assert counts[-1] == 2, f"{tenant}: split over workers {before} -> {after}"
        state = await debug_state(base, key)
        assert state["kv_events"] is True
        assert state["anticipated"]["added"] > 0


async def test_without_events_a_tenant_returns_to_the_worker_that_served_it(
    nats_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    async with kv_stack(nats_url, embedded_model, tmp_path, kv_events=False) as (base, key, client):
        tenants = ("acme", "globex", "initech", "umbrella")
        # All at once: the bookings of the first ones make their workers look fuller.
        await asyncio.gather(*(complete(client, tenant_prompt(t, "Hello?")) for t in tenants))
        homes: dict[str, str] = {}
        for round_ in range(2):
            for tenant in tenants:
                before = await debug_state(base, key)
                await complete(client, tenant_prompt(tenant, f"What is fact {round_}?"))
                after = await debug_state(base, key)
                worker = routed_one_more(requests_of(before), requests_of(after))
                assert homes.setdefault(tenant, worker) == worker, (tenant, round_)
                found = after["routing"]["overlap_blocks"] - before["routing"]["overlap_blocks"]
                assert found >= 10, f"{tenant}: {found} blocks of its prefix found"
        assert len(set(homes.values())) == 2, homes  # the tenants spread over both
        state = await debug_state(base, key)
        assert state["kv_events"] is False and state["feed"]["events"] == 0
        assert state["anticipated"]["blocks"] > 0
